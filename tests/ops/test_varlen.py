"""Packed batches (``cu_seqlens``, flash-linear-attention's meaning) on every causal op.

The reference is one call per sequence (the recurrent method, float64), each from its own initial
state: the packed call's outputs, its (N, ...) states and the gradient of every input must equal
theirs, with empty sequences (first, inside, last), lengths off the chunk grid, grouped value heads.
"""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import backends
from linattn.kernels import cpu
from linattn.ops import varlen
from linattn.ops.varlen import CPU_PADDING_FACTOR, PADDING_FACTOR, Packing

from decay_cases import OPS, PER_TOKEN, call, inputs, assert_same_values_and_grads

TIGHT = dict(rtol=1e-10, atol=1e-10)
LENGTHS = {
    "ragged": [5, 23, 1, 17],
    "empty_segments": [0, 7, 0, 0, 13, 1, 0],
    "one": [19],
}


def _offsets(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _per_sequence(op, x, lengths, with_state):
    """Each sequence alone (recurrent method): outputs along T, states stacked (N, ...)."""
    outs, states, start = [], [], 0
    for i, n in enumerate(lengths):
        S0 = x["S0"][i:i + 1] if with_state else None
        if n == 0:
            states.append(x["S0"][i] if with_state else torch.zeros_like(x["S0"][i]))
            continue
        piece = {name: x[name][:, :, start:start + n] for name in ("q", "k", "v", *PER_TOKEN[op])}
        out, S = call(op, x, **piece, S0=S0, method="recurrent")
        outs.append(out)
        states.append(S[0])
        start += n
    return torch.cat(outs, dim=2), torch.stack(states)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("method,chunk_size", [("chunk", 8), ("chunk", 64), ("recurrent", 64)])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("factor", [CPU_PADDING_FACTOR, PADDING_FACTOR], ids=["one_length_a_bucket", "padded_buckets"])
def test_a_packed_batch_equals_one_call_per_sequence(op, lengths, method, chunk_size, r, factor, monkeypatch):
    monkeypatch.setattr(varlen, "CPU_PADDING_FACTOR", factor)        # on the CPU, also buckets that pad
    lengths = LENGTHS[lengths]
    x = inputs(op, B=1, H=2, r=r, T=sum(lengths), states=len(lengths))
    out, S = call(op, x, cu_seqlens=_offsets(lengths), method=method, chunk_size=chunk_size)
    ref_out, ref_S = _per_sequence(op, x, lengths, with_state=True)
    grads, ref_grads = assert_same_values_and_grads(out, S, ref_out, ref_S, x, **TIGHT)


@pytest.mark.parametrize("op", OPS)
def test_without_initial_state_every_sequence_starts_empty(op):
    lengths = LENGTHS["empty_segments"]
    x = inputs(op, B=1, T=sum(lengths), states=len(lengths))
    out, S = call(op, x, S0=None, cu_seqlens=_offsets(lengths), chunk_size=4)
    ref_out, ref_S = _per_sequence(op, x, lengths, with_state=False)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)
    assert not S[[0, 2, 3, 6]].any()                                 # the empty sequences: zeros


@pytest.mark.parametrize("op", OPS)
def test_an_empty_sequence_returns_a_copy_of_its_initial_state(op):
    lengths = [3, 0, 4]
    x = inputs(op, B=1, T=7, states=3)
    _, S = call(op, x, cu_seqlens=_offsets(lengths))
    assert torch.equal(S[1], x["S0"][1])
    S[1].zero_()                                                      # its own memory: the caller's is untouched
    assert x["S0"][1].abs().sum() > 0


@pytest.mark.parametrize("op", ["gla", "delta", "gated_delta"])
def test_float32_packed_batch_matches_its_float64_sequences(op):
    lengths = [9, 0, 30, 2]
    x = inputs(op, B=1, T=41, states=4)
    x32 = {name: t.detach().float() for name, t in x.items()}
    out, S = call(op, x32, cu_seqlens=_offsets(lengths), chunk_size=16)
    ref_out, ref_S = _per_sequence(op, x, lengths, with_state=True)
    torch.testing.assert_close(out, ref_out.float(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(S, ref_S.float(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("method", ["chunk", "recurrent", "quadratic"])
@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("factor", [CPU_PADDING_FACTOR, PADDING_FACTOR], ids=["one_length_a_bucket", "padded_buckets"])
def test_linear_attention_packed_equals_one_call_per_sequence(method, feature_map, factor, monkeypatch):
    monkeypatch.setattr(varlen, "CPU_PADDING_FACTOR", factor)
    lengths = [0, 7, 13, 0, 1, 9]
    N, T, H = len(lengths), sum(lengths), 2
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, H, T, 5, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    v = torch.randn(1, H, T, 3, generator=g, dtype=torch.float64).requires_grad_()
    S0 = torch.rand(N, H, 5, 3, generator=g, dtype=torch.float64).requires_grad_()
    z0 = torch.rand(N, H, 5, generator=g, dtype=torch.float64).requires_grad_()
    out, st = linattn.linear_attention(q, k, v, causal=True, feature_map=feature_map, method=method, chunk_size=4,
                                       cu_seqlens=_offsets(lengths), return_state=True,
                                       initial_state=linattn.LinearAttentionState(S0, z0))
    outs, Ss, zs, start = [], [], [], 0
    for i, n in enumerate(lengths):
        if n == 0:
            Ss.append(S0[i])
            zs.append(z0[i])
            continue
        o, s = linattn.linear_attention(q[:, :, start:start + n], k[:, :, start:start + n], v[:, :, start:start + n],
                                        causal=True, feature_map=feature_map, method="recurrent", return_state=True,
                                        initial_state=linattn.LinearAttentionState(S0[i:i + 1], z0[i:i + 1]))
        outs.append(o)
        Ss.append(s.S[0])
        zs.append(s.z[0])
        start += n
    ref_out, ref_S, ref_z = torch.cat(outs, 2), torch.stack(Ss), torch.stack(zs)
    for got, ref in ((out, ref_out), (st.S, ref_S), (st.z, ref_z)):
        torch.testing.assert_close(got, ref, **TIGHT)
    leaves = dict(q=q, k=k, v=v, S0=S0, z0=z0)
    g1 = torch.autograd.grad(out.sum() + (st.S * 2).sum() + (st.z * 3).sum(), list(leaves.values()))
    g2 = torch.autograd.grad(ref_out.sum() + (ref_S * 2).sum() + (ref_z * 3).sum(), list(leaves.values()))
    for name, a, b in zip(leaves, g1, g2):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("factor", [PADDING_FACTOR, CPU_PADDING_FACTOR])
def test_buckets_pad_within_their_factor_and_keep_every_sequence_once(factor):
    lengths = [4096] + [100] * 40 + [0, 0] + [7, 3000, 1, 2999]
    offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
    packing = Packing(offsets, factor)
    seen = sorted(s for members, _ in packing.buckets for s in members) + packing.empty
    assert sorted(seen) == list(range(len(lengths)))
    for members, L in packing.buckets:
        assert L == max(lengths[s] for s in members)
        assert len(members) * L <= factor * sum(lengths[s] for s in members)
    assert len(packing.buckets) <= 6


def _qkv(B=1, T=6):
    return torch.randn(B, 2, T, 4), torch.randn(B, 2, T, 4), torch.randn(B, 2, T, 3)


@pytest.mark.parametrize("cu,error,message", [
    ([0, 3, 6], None, None),
    (torch.tensor([0, 3, 6.0]), TypeError, r"cu_seqlens must be an int32 or int64 tensor .*float32"),
    ([[0, 3, 6]], ValueError, r"cu_seqlens must be 1-D with N \+ 1 >= 2 offsets, got shape \(1, 3\)"),
    ([0], ValueError, r"cu_seqlens must be 1-D with N \+ 1 >= 2 offsets"),
    ([1, 3, 6], ValueError, r"non-decreasing offsets from 0 to seq = 6 .*got \[1, 3, 6\]"),
    ([0, 3, 5], ValueError, r"non-decreasing offsets from 0 to seq = 6 .*got \[0, 3, 5\]"),
    ([0, 4, 3, 6], ValueError, r"non-decreasing offsets from 0 to seq = 6 .*got \[0, 4, 3, 6\]"),
    ((0, 3, 6), TypeError, r"cu_seqlens must be a 1-D int32 or int64 torch.Tensor .*got tuple"),
])
@pytest.mark.parametrize("op", ["retention", "delta", "linear_attention"])
def test_bad_cu_seqlens_raise_errors_that_name_it(op, cu, error, message):
    q, k, v = _qkv()
    cu = torch.tensor(cu) if isinstance(cu, list) else cu
    fn = {"retention": lambda **kw: linattn.retention(q, k, v, 0.9, **kw),
          "delta": lambda **kw: linattn.delta_rule(q, k, v, torch.rand(1, 2, 6), **kw),
          "linear_attention": lambda **kw: linattn.linear_attention(q, k, v, causal=True, **kw)}[op]
    if error is None:
        fn(cu_seqlens=cu)
    else:
        with pytest.raises(error, match=message):
            fn(cu_seqlens=cu)


@pytest.mark.parametrize("op", ["retention", "gla", "linear_attention"])
def test_cu_seqlens_needs_one_row_and_no_mask(op):
    cu = torch.tensor([0, 2, 6])
    for B, mask, message in ((2, None, r"one row \(B = 1.*got B = 2"),
                             (1, torch.ones(1, 6, dtype=torch.bool), r"cu_seqlens and attention_mask cannot be combined")):
        q, k, v = _qkv(B)
        fn = {"retention": lambda **kw: linattn.retention(q, k, v, 0.9, **kw),
              "gla": lambda **kw: linattn.gated_linear_attention(q, k, v, -torch.rand(B, 2, 6, 4), **kw),
              "linear_attention": lambda **kw: linattn.linear_attention(q, k, v, causal=True, **kw)}[op]
        with pytest.raises(ValueError, match=message):
            fn(cu_seqlens=cu, attention_mask=mask)


def test_cu_seqlens_states_have_one_row_per_sequence_and_linear_attention_must_be_causal():
    q, k, v = _qkv()
    cu = torch.tensor([0, 2, 2, 6])
    with pytest.raises(ValueError, match=r"initial_state must have shape .*\(3, 2, 4, 3\) \(B: N \(sequences"):
        linattn.delta_rule(q, k, v, torch.rand(1, 2, 6), cu_seqlens=cu, initial_state=torch.zeros(1, 2, 4, 3))
    with pytest.raises(ValueError, match=r"cu_seqlens .* needs causal=True"):
        linattn.linear_attention(q, k, v, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"cannot see where the sequences of a packed batch"):
        linattn.retention(q, k, v, 0.9, cu_seqlens=cu, feature_map=linattn.get_feature_map("cosformer", max_len=8))


@pytest.mark.skipif(not cpu.cpu_kernel_available(), reason=f"no C++ compiler for the CPU kernel: "
                                                          f"{cpu.build_info().get('error')}")
@pytest.mark.parametrize("op", OPS)
def test_the_compiled_cpu_path_runs_the_buckets_of_a_packed_batch(op):
    """A bucket is an ordinary batched call: the compiled CPU path runs it, and last_backend() says so."""
    lengths = [6, 0, 11, 3]
    x = inputs(op, B=1, T=20, states=4)
    with backends.use_backends("cpu"):
        out, S = call(op, x, cu_seqlens=_offsets(lengths), chunk_size=4)
    assert backends.last_backend() == "cpu"
    ref_out, ref_S = _per_sequence(op, x, lengths, with_state=True)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    torch.testing.assert_close(S, ref_S, **TIGHT)


def test_packed_linear_attention_runs_its_buckets_on_the_triton_backend(monkeypatch, triton_backend):
    """Each bucket is an ordinary batched call: where the fused Triton kernel can run (forced here, with a
    stand-in kernel: the quadratic form), it runs every bucket, and last_backend() says so."""
    from linattn import kernels
    from linattn.ops.linear import quadratic_linear_attention

    calls = []

    def kernel(phi_q, phi_k, v_aug, S0, chunk_size, out_dtype=None):
        calls.append(phi_q.shape[0])
        return quadratic_linear_attention(phi_q, phi_k, v_aug, S0, True, need_state=True)

    monkeypatch.setitem(vars(kernels), "chunk_linear_attention_triton", kernel)
    triton_backend(lambda tensors, chunk_size: None)
    lengths = [5, 0, 40, 3, 40]                        # the two of 40 share a bucket on any device
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, sum(lengths), 4, generator=g) for _ in range(3))
    with backends.use_backends("triton", "torch"):
        out, st = linattn.linear_attention(q, k, v, causal=True, chunk_size=16, cu_seqlens=_offsets(lengths),
                                           return_state=True)
    assert backends.last_backend() == "triton"
    assert sum(calls) == 4 and len(calls) == len(Packing([0] + torch.tensor(lengths).cumsum(0).tolist(), CPU_PADDING_FACTOR).buckets)
    start = 0
    for i, n in enumerate(lengths):
        if n:
            ref, ref_st = linattn.linear_attention(q[:, :, start:start + n], k[:, :, start:start + n],
                                                   v[:, :, start:start + n], causal=True, method="recurrent",
                                                   return_state=True)
            torch.testing.assert_close(out[:, :, start:start + n], ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st.S[i:i + 1], ref_st.S, rtol=1e-5, atol=1e-6)
        start += n
    assert not st.S[1].any() and not st.z[1].any()


def test_packed_linear_attention_falls_back_visibly_where_triton_cannot_run(triton_backend):
    triton_backend(lambda tensors, chunk_size: "no CUDA here (forced)")
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    with backends.use_backends("triton"), pytest.raises(RuntimeError, match=r"triton: no CUDA here \(forced\)"):
        linattn.linear_attention(q, k, v, causal=True, chunk_size=16, cu_seqlens=torch.tensor([0, 5, 12]))
    with backends.use_backends("triton", "torch"):
        linattn.linear_attention(q, k, v, causal=True, chunk_size=16, cu_seqlens=torch.tensor([0, 5, 12]))
    assert backends.last_backend() == "torch"
