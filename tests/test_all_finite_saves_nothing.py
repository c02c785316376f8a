"""The finiteness check on a forward's outputs must not make autograd record anything."""
import torch

import linattn
from linattn._numerics import all_finite


def _saved(fn):
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        result = fn()
    return seen, result


def test_all_finite_records_no_saved_tensor():
    x = torch.randn(2, 3, requires_grad=True)
    y = torch.randn(4, requires_grad=True)
    seen, ok = _saved(lambda: all_finite(x, y))
    assert ok is True
    assert seen == []
    z = x.detach().clone()
    z[0, 0] = float("nan")
    z.requires_grad_(True)
    seen, ok = _saved(lambda: all_finite(z))
    assert ok is False and seen == []


def test_chunk_form_saves_no_copy_of_the_final_state():
    # every saved tensor belongs to the chunk form's own backward: none has the final state's shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g, requires_grad=True) for _ in range(3))
    seen, _ = _saved(lambda: linattn.linear_attention(q, k, v, causal=True, chunk_size=16))
    assert torch.Size([1, 2, 8, 8]) not in seen and torch.Size([1, 2, 8]) not in seen
