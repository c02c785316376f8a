"""``linattn.bench.peak_memory`` on the CPU does not depend on the number of threads.

Chapter 5 prints peak-memory figures as exact, reproducible numbers (they are checked by
nbval, not ignored). That is only honest if the bookkeeping counts the same tensors whatever
the thread count: this test measures the chapter's cases with one thread and with several.
"""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn.bench import peak_memory


def _forms():
    def cumsum(q, k, v):
        phi_q, phi_k = linattn.elu_plus_one(q), linattn.elu_plus_one(k)
        S = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)          # (B, H, T, M, Dv)
        z = torch.cumsum(phi_k, dim=2)                                          # (B, H, T, M)
        return (phi_q.unsqueeze(-2) @ S).squeeze(-2) / (phi_q * z).sum(-1, keepdim=True)

    def chunk(q, k, v):                         # chapter 5's PyTorch chunk form (the compiled loop has thread buffers)
        with linattn.backends.use_backends("torch"):
            return linattn.linear_attention(q, k, v, causal=True, chunk_size=64)

    return {
        "chunk": chunk,
        "quadratic": lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, method="quadratic"),
        "cumsum": cumsum,
    }


def _measure(fn, q, k, v):
    def forward():
        with torch.no_grad():
            fn(q, k, v)

    return (peak_memory(forward),
            peak_memory(lambda: torch.autograd.grad(fn(q, k, v).sum(), (q, k, v))))


@pytest.mark.parametrize("form", sorted(_forms()))
def test_peak_memory_is_the_same_with_one_thread_and_several(form):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g, requires_grad=True) for _ in range(3))
    fn = _forms()[form]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _measure(fn, q, k, v)
        torch.set_num_threads(4)
        several = _measure(fn, q, k, v)
    finally:
        torch.set_num_threads(before)
    assert one == several, f"{form}: peak bytes (forward, forward + backward) {one} with 1 thread, {several} with 4"
    assert min(one) > 0
