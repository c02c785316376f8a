"""Chapters 1-5 carry one tiny worked example (T = 4 tokens, D = M = Dv = 2) from chapter to
chapter: the T×T matrix, the states after each token, two chunks of two. It only teaches if it
is the same example everywhere, so every one of those chapters must define it with the very
same lines, and the hand-checkable numbers the chapters print must follow from them.
"""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHAPTERS = [sorted((ROOT / "chapters").glob(f"0{n}_*.ipynb"))[0] for n in range(1, 6)]
DEFINITION_RE = re.compile(r"^[qkv]_tiny = torch\.tensor\(.*$", re.M)


def _definition(path: pathlib.Path) -> list[str]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    lines = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines += DEFINITION_RE.findall("".join(cell["source"]))
    return lines


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_chapter_defines_the_tiny_example_like_chapter_1(path):
    first = _definition(CHAPTERS[0])
    assert len(first) == 3, f"chapter 1 should define q_tiny, k_tiny and v_tiny once each, found {first}"
    assert _definition(path) == first, f"{path.name} defines the tiny example differently from chapter 1"


def test_the_tiny_example_is_hand_checkable():
    """elu+1 features of 0 and 1 are 1 and 2: the states are integers, the outputs simple fractions."""
    namespace = {"torch": torch}
    exec("\n".join(_definition(CHAPTERS[0])), namespace)
    q, k, v = (namespace[n] for n in ("q_tiny", "k_tiny", "v_tiny"))
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    assert torch.equal(phi_q, phi_q.round()) and torch.equal(phi_k, phi_k.round())
    S = torch.cumsum(phi_k[:, :, None] * v[:, None, :], dim=0)            # (T, M, Dv) states S_t
    z = torch.cumsum(phi_k, dim=0)                                         # (T, M)
    y = torch.einsum("tm,tmv->tv", phi_q, S) / (phi_q * z).sum(-1, keepdim=True)
    assert torch.equal(S[-1], torch.tensor([[4.0, 5.0], [5.0, 5.0]], dtype=S.dtype))
    expected = torch.tensor([[1, 0], [4 / 7, 3 / 7], [9 / 8, 1 / 4], [3 / 4, 5 / 6]], dtype=y.dtype)
    assert torch.allclose(y, expected, atol=1e-12)
