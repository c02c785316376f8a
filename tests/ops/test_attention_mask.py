"""``attention_mask`` on the decay ops (True = real token, Hugging Face's meaning, as everywhere in linattn).

The reference is the call on each row's real tokens alone (unpadded, recurrent method, float64): at
the real positions the masked call's outputs, its final state and every gradient must equal it; a
padded position's output is exactly 0, and so is the gradient of whatever sits there.
"""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import backends
from linattn.kernels import cpu

from decay_cases import OPS, PER_TOKEN, call, inputs, assert_same_values_and_grads

TIGHT = dict(rtol=1e-10, atol=1e-10)
T = 19
MASKS = {                                            # one row each: right, left and inner padding
    "right": [1] * 13 + [0] * 6,
    "left": [0] * 5 + [1] * 14,
    "inside": [1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 0, 1],
    "all_real": [1] * T,
}


def _mask(*rows):
    return torch.tensor([MASKS[r] for r in rows], dtype=torch.bool)


def _unpadded(op, x, mask):
    """Each row's real tokens alone: outputs scattered back (0 at padding) and final states."""
    outs, states = [], []
    for b in range(mask.shape[0]):
        keep = mask[b].nonzero().squeeze(1)
        row = {name: x[name][b:b + 1].index_select(2, keep) for name in ("q", "k", "v", *PER_TOKEN[op])}
        out, S = call(op, x, **row, S0=x["S0"][b:b + 1], method="recurrent")
        full = out.new_zeros(1, *out.shape[1:2], T, out.shape[-1]).index_copy(2, keep, out)
        outs.append(full)
        states.append(S)
    return torch.cat(outs), torch.cat(states)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("method,chunk_size", [("chunk", 4), ("chunk", 64), ("recurrent", 64)])
@pytest.mark.parametrize("r", [1, 2])
def test_masked_call_equals_the_unpadded_rows(op, method, chunk_size, r):
    mask = _mask("right", "left", "inside", "all_real")
    x = inputs(op, B=4, r=r, T=T)
    out, S = call(op, x, attention_mask=mask, method=method, chunk_size=chunk_size)
    ref_out, ref_S = _unpadded(op, x, mask)
    grads, ref_grads = assert_same_values_and_grads(out, S, ref_out, ref_S, x, **TIGHT)
    assert not out.masked_select(~mask[:, None, :, None]).any()      # exactly 0 at padding
    for name in ("q", "k", "v", *PER_TOKEN[op]):                      # what sits at padding changes nothing
        pad = ~mask.view(4, 1, T, *([1] * (x[name].dim() - 3)))
        assert not grads[name].masked_select(pad.expand_as(grads[name])).any(), name


def test_right_padded_retention_returns_the_unpadded_final_state():
    """The repro of the issue: three padded tokens used to decay the state by 0.9³ = 0.729."""
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    _, S_ref = linattn.retention(q[:, :, :5], k[:, :, :5], v[:, :, :5], 0.9, return_state=True)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    out, S = linattn.retention(q, k, v, 0.9, attention_mask=mask, return_state=True)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-6)
    assert not out[:, :, 5:].any()


@pytest.mark.parametrize("op", OPS)
def test_padding_may_hold_anything(op):
    """A NaN in a padded slot of q, k or v reaches nothing (gates and β are checked at every position)."""
    mask = _mask("right", "inside")
    x = {name: t.detach() for name, t in inputs(op, B=2, T=T).items()}
    out, S = call(op, x, attention_mask=mask, chunk_size=8)
    dirty = {}
    for name in ("q", "k", "v"):
        pad = ~mask.view(2, 1, T, 1)
        dirty[name] = x[name].masked_fill(pad, float("nan"))
    out2, S2 = call(op, x, **dirty, attention_mask=mask, chunk_size=8)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(S2, S, rtol=0, atol=0)


@pytest.mark.parametrize("mask,error,message", [
    (torch.ones(2, 5, dtype=torch.bool), ValueError, r"attention_mask must have shape \(batch, seq\) = \(2, 6\), got \(2, 5\)"),
    (torch.ones(2, 6), TypeError, r"attention_mask must be a bool or integer \(0/1\) tensor"),
    (torch.full((2, 6), 2), ValueError, r"attention_mask must be 0 or 1"),
    ([[1] * 6] * 2, TypeError, r"attention_mask must be a torch.Tensor"),
])
@pytest.mark.parametrize("op", OPS)
def test_bad_masks_raise_errors_that_name_it(op, mask, error, message):
    x = {name: t.detach() for name, t in inputs(op, B=2, T=6).items()}
    with pytest.raises(error, match=message):
        call(op, x, attention_mask=mask)


@pytest.mark.skipif(not cpu.cpu_kernel_available(), reason=f"no C++ compiler for the CPU kernel: "
                                                          f"{cpu.build_info().get('error')}")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("r", [1, 2])
def test_masked_calls_run_on_the_compiled_cpu_path_or_say_they_did_not(op, r):
    """One q/k head per value head: the CPU kernel runs the masked call (padding zeroed, gates 0 there);
    grouped heads fall back to PyTorch, and last_backend() names what ran."""
    mask = _mask("right", "left", "inside", "all_real")
    x = inputs(op, B=4, r=r, T=T)
    with backends.use_backends("cpu", "torch"):
        out, S = call(op, x, attention_mask=mask, chunk_size=4)
    assert backends.last_backend() == ("cpu" if r == 1 else "torch")
    ref_out, ref_S = _unpadded(op, x, mask)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
