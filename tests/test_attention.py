"""linear_attention and softmax_attention against independent float64 references.

Every expected value here comes from tests/refimpl.py (the masked quadratic form written
from the API contract), never from linattn itself.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import linattn
from refimpl import (
    CAUSAL_METHODS,
    NONCAUSAL_METHODS,
    grads,
    methods_for,
    rand_qkv,
    ref_linear_attention,
    ref_linear_attention_big_causal,
    ref_linear_attention_big_noncausal,
    ref_softmax_attention,
)

# float64 against a float64 reference: only summation order differs.
TIGHT = dict(rtol=1e-10, atol=1e-12)

CASES = [(c, m) for c in (False, True) for m in methods_for(c)]
CASE_IDS = [f"{'causal' if c else 'noncausal'}-{m}" for c, m in CASES]


def _la(q, k, v, causal, method, **kw):
    return linattn.linear_attention(q, k, v, causal=causal, method=method, **kw)


def _check_values_and_grads(q, k, v, causal, method, tol=TIGHT, extra_inputs=(), **kw):
    """Compare output and grads of q, k, v (and extra_inputs) with the float64 reference."""
    ref_kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("chunk_size", "method")}
    if ref_kw.get("initial_state") is not None:
        ref_kw["initial_state"] = (ref_kw["initial_state"].S, ref_kw["initial_state"].z)
    out = _la(q, k, v, causal, method, **kw)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal, **ref_kw)
    assert out.shape == ref.shape
    assert out.dtype == q.dtype
    torch.testing.assert_close(out, ref.to(out.dtype), **tol)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(123))
    inputs = (q, k, v, *extra_inputs)
    got = grads(out, inputs, g.to(out.dtype))
    exp = grads(ref, inputs, g)
    for name, a, b in zip(("q", "k", "v", "S0", "z0"), got, exp):
        if b is None:  # the output does not depend on it (z0 when normalize=False)
            assert a is None or torch.count_nonzero(a) == 0, f"nonzero gradient of unused {name}"
            continue
        assert a is not None, f"no gradient reached {name}"
        torch.testing.assert_close(a, b.to(a.dtype), **tol, msg=lambda m, name=name: f"grad of {name}: {m}")


# --------------------------------------------------------------------------------------
# Every method against the masked quadratic form: values and gradients
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_matches_reference_values_and_grads(causal, method, normalize, feature_map):
    q, k, v = rand_qkv(2, 3, 37, 8, 5, seed=1, requires_grad=True)
    _check_values_and_grads(
        q, k, v, causal, method, feature_map=feature_map, normalize=normalize, chunk_size=8
    )


@pytest.mark.parametrize("T", [1, 63, 64, 65, 128, 300, 513])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_sequence_lengths_around_chunk_size(T, causal, method):
    """chunk_size 64 with T below, at, just above, and far above multiples of it; D != Dv."""
    if method == "recurrent" and T > 65:
        # the token loop's backward is slow at long T: values only (gradients are checked up to T=65)
        q, k, v = rand_qkv(1, 2, T, 33, 65, seed=T)
        out = _la(q, k, v, causal, method, chunk_size=64)
        ref, _, _ = ref_linear_attention(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, **TIGHT)
        return
    q, k, v = rand_qkv(1, 2, T, 33, 65, seed=T, requires_grad=True)
    _check_values_and_grads(q, k, v, causal, method, chunk_size=64)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_unnormalized_sequence_lengths(causal, method):
    for T in (1, 64, 65, 130):
        q, k, v = rand_qkv(2, 2, T, 33, 65, seed=T)
        out = _la(q, k, v, causal, method, chunk_size=64, normalize=False)
        ref, _, _ = ref_linear_attention(q, k, v, causal=causal, normalize=False)
        torch.testing.assert_close(out, ref, **TIGHT)


@settings(max_examples=40)
@given(
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    T=st.integers(1, 40),
    D=st.integers(1, 7),
    Dv=st.integers(1, 7),
    chunk_size=st.integers(1, 20),
    causal=st.booleans(),
    normalize=st.booleans(),
    method_index=st.integers(0, 3),
    feature_map=st.sampled_from(["elu+1", "relu"]),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(B, H, T, D, Dv, chunk_size, causal, normalize, method_index, feature_map, seed):
    methods = methods_for(causal)
    method = methods[method_index % len(methods)]
    q, k, v = rand_qkv(B, H, T, D, Dv, seed=seed, requires_grad=True)
    _check_values_and_grads(
        q, k, v, causal, method,
        chunk_size=chunk_size, normalize=normalize, feature_map=feature_map,
    )


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_gradient_of_k_normalized(causal, method):
    """dk with normalize=True (it flows through numerator AND denominator) equals autograd on the reference."""
    q, k, v = rand_qkv(2, 2, 97, 6, 4, seed=7)
    k = (2.0 * k).requires_grad_(True)  # larger keys: a stronger, more varied normaliser
    out = _la(q, k, v, causal, method, normalize=True, chunk_size=32)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal, normalize=True)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (dk,) = torch.autograd.grad((out * g).sum(), k)
    (dk_ref,) = torch.autograd.grad((ref * g).sum(), k)
    torch.testing.assert_close(dk, dk_ref, **TIGHT)
    # the denominator's share of dk is large: an implementation that dropped it would fail above
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a.tril()
    num_only = (a @ v) / a.sum(-1, keepdim=True).detach()
    (dk_num_only,) = torch.autograd.grad((num_only * g).sum(), k)
    assert (dk_num_only - dk_ref).abs().max() > 1e-2 * dk_ref.abs().max()


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_gradcheck_small(causal, method):
    """Numerical vs analytical gradient (catches a wrong hand-written backward)."""
    q, k, v = rand_qkv(1, 2, 6, 3, 2, seed=11, requires_grad=True)
    fn = lambda q, k, v: _la(q, k, v, causal, method, chunk_size=4)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


# --------------------------------------------------------------------------------------
# Heads and batch elements are independent; each head is normalised by its own keys
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_each_head_normalised_by_its_own_keys(causal, method):
    B, H, T, D, Dv = 2, 4, 50, 8, 6
    q, k, v = rand_qkv(B, H, T, D, Dv, seed=3)
    scales = torch.tensor([4.0, 0.1, 1.0, 2.5], dtype=torch.float64)[None, :, None, None]
    k = k * scales  # very different normalisers per head: summing them across heads is visible
    v = v.clone()
    v[:, 1] = 1.0  # head 1: values all one -> a correctly normalised output is exactly 1
    out = _la(q, k, v, causal, method, chunk_size=16)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(out[:, 1], torch.ones_like(out[:, 1]), **TIGHT)
    # the wrong answer (normaliser summed over heads) is far from the right one
    fq, fk = F.elu(q) + 1, F.elu(k) + 1
    a = fq @ fk.transpose(-1, -2)
    if causal:
        a = a.tril()
    wrong = (a @ v) / a.sum(-1, keepdim=True).sum(1, keepdim=True)
    assert (wrong - ref).abs().max() > 0.1
    # each head alone (and each batch element alone) gives the same result
    for h in range(H):
        alone = _la(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], causal, method, chunk_size=16)
        torch.testing.assert_close(out[:, h : h + 1], alone, **TIGHT)
    for b in range(B):
        alone = _la(q[b : b + 1], k[b : b + 1], v[b : b + 1], causal, method, chunk_size=16)
        torch.testing.assert_close(out[b : b + 1], alone, **TIGHT)


# --------------------------------------------------------------------------------------
# Exactness: constant values give that constant, to the last few bits
# --------------------------------------------------------------------------------------
#
# With v = 1 the numerator and the normaliser are the same sum, so y = num / den = 1.
# Bit-for-bit equality would need both sums to be added in the same order, and BLAS
# does not promise that across the columns of one matmul (MKL computes column 0 and
# column 64 of the same product in different orders), nor between a matmul and a
# matrix-vector product. The deviation is then a few units in the last place (measured:
# at most 6.5 ulps of 1.0 over these shapes); a normaliser taken over the wrong keys or
# heads is off by O(1). The bound below, 16 machine epsilons, separates the two.
ULPS_OF_ONE = 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_all_ones_values_give_ones(causal, method, dtype):
    for T, D, Dv in [(100, 8, 4), (1, 3, 1), (70, 33, 65), (513, 64, 64)]:
        q, k, _ = rand_qkv(2, 3, T, D, Dv, dtype=dtype, seed=T)
        v = torch.ones(2, 3, T, Dv, dtype=dtype)
        out = _la(q, k, v, causal, method, chunk_size=16, normalize=True)
        assert out.dtype == dtype
        err = (out - 1).abs().max().item()
        assert err <= ULPS_OF_ONE * torch.finfo(dtype).eps, f"T={T}: max |out-1| = {err:.3e}"


# --------------------------------------------------------------------------------------
# Causality
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_future_tokens_do_not_change_past_outputs(method):
    T = 130
    q, k, v = rand_qkv(2, 2, T, 8, 5, seed=21)
    out = _la(q, k, v, True, method, chunk_size=64)
    for t in (0, 20, 63, 64, 100, T - 2):
        g = torch.Generator().manual_seed(t)
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, :, t + 1 :] = 30.0 * torch.randn(x[:, :, t + 1 :].shape, generator=g, dtype=x.dtype)
        out2 = _la(q2, k2, v2, True, method, chunk_size=64)
        torch.testing.assert_close(out2[:, :, : t + 1], out[:, :, : t + 1], rtol=1e-13, atol=1e-14)
        assert not torch.allclose(out2[:, :, t + 1 :], out[:, :, t + 1 :])


@pytest.mark.parametrize("method", CAUSAL_METHODS)
def test_past_outputs_have_zero_gradient_from_future_inputs(method):
    T, t = 40, 17
    q, k, v = rand_qkv(1, 2, T, 4, 3, seed=2, requires_grad=True)
    out = _la(q, k, v, True, method, chunk_size=8)
    dq, dk, dv = torch.autograd.grad(out[:, :, : t + 1].sum(), (q, k, v))
    for name, d in (("q", dq), ("k", dk), ("v", dv)):
        assert torch.count_nonzero(d[:, :, t + 1 :]) == 0, f"d out[:t+1] / d {name}[t+1:] is not zero"


# --------------------------------------------------------------------------------------
# Padding masks
# --------------------------------------------------------------------------------------


def _padded_batch(lengths, T, D, Dv, *, left, seed):
    """Each sequence's real tokens, and a padded batch with PAD keys set to zero (phi(0) = 1 for elu+1)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [
        tuple(torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for d in (D, D, Dv)) for n in lengths
    ]
    B = len(lengths)
    q = torch.randn(B, 2, T, D, generator=g, dtype=torch.float64)  # padded queries: arbitrary
    k = torch.zeros(B, 2, T, D, dtype=torch.float64)  # padded keys: zero (masking before phi would see ones)
    v = 5.0 * torch.randn(B, 2, T, Dv, generator=g, dtype=torch.float64)  # padded values: large, nonzero
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (n, (qs, ks, vs)) in enumerate(zip(lengths, seqs)):
        sl = slice(T - n, T) if left else slice(0, n)
        q[b, :, sl], k[b, :, sl], v[b, :, sl] = qs[0], ks[0], vs[0]
        mask[b, sl] = True
    return seqs, (q, k, v), mask


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("left", [True, False], ids=["left-pad", "right-pad"])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_padding_mask_matches_unpadded_sequences(causal, method, left, normalize):
    T, lengths = 70, [70, 61, 33, 1]
    seqs, (q, k, v), mask = _padded_batch(lengths, T, 6, 4, left=left, seed=9)
    out, state = _la(
        q, k, v, causal, method, attention_mask=mask, chunk_size=16, normalize=normalize, return_state=True
    )
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=causal, attention_mask=mask, normalize=normalize)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(state.S, S_ref, **TIGHT)
    torch.testing.assert_close(state.z, z_ref, **TIGHT)
    for b, (n, (qs, ks, vs)) in enumerate(zip(lengths, seqs)):
        sl = slice(T - n, T) if left else slice(0, n)
        alone, st_alone = _la(qs, ks, vs, causal, method, chunk_size=16, normalize=normalize, return_state=True)
        torch.testing.assert_close(out[b : b + 1, :, sl], alone, **TIGHT)
        torch.testing.assert_close(state.S[b : b + 1], st_alone.S, **TIGHT)
        torch.testing.assert_close(state.z[b : b + 1], st_alone.z, **TIGHT)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_padding_mask_gradients(causal, method):
    _, (q, k, v), mask = _padded_batch([40, 29, 7], 40, 5, 3, left=True, seed=4)
    for x in (q, k, v):
        x.requires_grad_(True)
    _check_values_and_grads(q, k, v, causal, method, attention_mask=mask, chunk_size=16)
    out = _la(q, k, v, causal, method, attention_mask=mask, chunk_size=16)
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    pad = ~mask[:, None, :, None]
    assert torch.count_nonzero(dk * pad) == 0 and torch.count_nonzero(dv * pad) == 0


# --------------------------------------------------------------------------------------
# Cross-attention (Tq != Tk), initial state and returned state
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("Tq,Tk", [(7, 19), (40, 3), (1, 65), (65, 1)])
@pytest.mark.parametrize("method", NONCAUSAL_METHODS)
def test_cross_attention(method, Tq, Tk):
    q, k, v = rand_qkv(2, 3, Tq, 5, 7, Tk=Tk, seed=Tq * 100 + Tk, requires_grad=True)
    _check_values_and_grads(q, k, v, False, method)
    mask = torch.rand(2, Tk, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[:, 0] = True
    _check_values_and_grads(q, k, v, False, method, attention_mask=mask)
    out = _la(q, k, v, False, method)
    assert out.shape == (2, 3, Tq, 7)


def _rand_state(B, H, M, Dv, seed, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    S0 = torch.randn(B, H, M, Dv, generator=g, dtype=torch.float64).to(dtype)
    z0 = (torch.rand(B, H, M, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)  # positive, like a real z
    if requires_grad:
        S0.requires_grad_(True)
        z0.requires_grad_(True)
    return S0, z0


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_initial_state_and_return_state(causal, method, normalize):
    q, k, v = rand_qkv(2, 3, 45, 6, 4, seed=13, requires_grad=True)
    S0, z0 = _rand_state(2, 3, 6, 4, seed=14, requires_grad=True)
    init = linattn.LinearAttentionState(S=S0, z=z0)
    out, state = _la(
        q, k, v, causal, method, initial_state=init, return_state=True, normalize=normalize, chunk_size=16
    )
    assert isinstance(state, linattn.LinearAttentionState)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=causal, initial_state=(S0, z0), normalize=normalize)
    torch.testing.assert_close(out, ref, **TIGHT)
    assert state.S.shape == (2, 3, 6, 4) and state.z.shape == (2, 3, 6)
    assert state.S.dtype == torch.float64 and state.z.dtype == torch.float64
    torch.testing.assert_close(state.S, S_ref, **TIGHT)
    torch.testing.assert_close(state.z, z_ref, **TIGHT)
    # gradients reach the initial state too (needed to train across segments)
    _check_values_and_grads(
        q, k, v, causal, method, extra_inputs=(S0, z0),
        initial_state=init, normalize=normalize, chunk_size=16,
    )
    # the inputs are not modified in place
    S0_before, z0_before = S0.detach().clone(), z0.detach().clone()
    _la(q, k, v, causal, method, initial_state=init, return_state=True, chunk_size=16)
    assert torch.equal(S0, S0_before) and torch.equal(z0, z0_before)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_initial_z_is_used(causal, method):
    """S0 = 0 with a nonzero z0 must still change the normalised output (a state without z would not)."""
    q, k, v = rand_qkv(1, 2, 20, 4, 3, seed=5)
    S0 = torch.zeros(1, 2, 4, 3, dtype=torch.float64)
    z0 = torch.full((1, 2, 4), 50.0, dtype=torch.float64)
    out = _la(q, k, v, causal, method, initial_state=linattn.LinearAttentionState(S=S0, z=z0), chunk_size=8)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal, initial_state=(S0, z0))
    plain, _, _ = ref_linear_attention(q, k, v, causal=causal)
    assert (ref - plain).abs().max() > 0.1
    torch.testing.assert_close(out, ref, **TIGHT)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_return_state_without_initial_state(causal, method):
    q, k, v = rand_qkv(2, 2, 33, 5, 3, seed=6)
    out, state = _la(q, k, v, causal, method, return_state=True, chunk_size=8)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(state.S, S_ref, **TIGHT)
    torch.testing.assert_close(state.z, z_ref, **TIGHT)
    plain = _la(q, k, v, causal, method, chunk_size=8)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)


HALVES = [(m, m, n) for m in CAUSAL_METHODS for n in (True, False)] + [
    ("chunk", "recurrent", True), ("recurrent", "chunk", True), ("quadratic", "chunk", True), ("chunk", "quadratic", False),
]


@pytest.mark.parametrize("first,second,normalize", HALVES)
def test_two_halves_resumed_equal_one_run(first, second, normalize):
    """T=256 as two halves of 128, the second resumed from the first's state, equals one causal run."""
    T = 256
    q, k, v = rand_qkv(2, 2, T, 8, 6, seed=17)
    full, st_full = _la(q, k, v, True, second, normalize=normalize, return_state=True, chunk_size=64)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, normalize=normalize)
    torch.testing.assert_close(full, ref, **TIGHT)
    h = T // 2
    out1, st1 = _la(q[:, :, :h], k[:, :, :h], v[:, :, :h], True, first, normalize=normalize,
                    return_state=True, chunk_size=64)
    out2, st2 = _la(q[:, :, h:], k[:, :, h:], v[:, :, h:], True, second, normalize=normalize,
                    initial_state=st1, return_state=True, chunk_size=64)
    torch.testing.assert_close(torch.cat([out1, out2], dim=2), ref, **TIGHT)
    torch.testing.assert_close(st2.S, S_ref, **TIGHT)
    torch.testing.assert_close(st2.z, z_ref, **TIGHT)
    if normalize:
        # a resumed state missing z (z0 = 0) gives a clearly different second half
        no_z, _, _ = ref_linear_attention(q[:, :, h:], k[:, :, h:], v[:, :, h:], causal=True,
                                          initial_state=(st1.S, torch.zeros_like(st1.z)))
        assert (no_z - ref[:, :, h:]).abs().max() > 0.1


@pytest.mark.parametrize("chunk_size", [1, 3, 64, 1000])
def test_chunk_sizes(chunk_size):
    q, k, v = rand_qkv(2, 2, 77, 5, 6, seed=chunk_size, requires_grad=True)
    _check_values_and_grads(q, k, v, True, "chunk", chunk_size=chunk_size)


def test_auto_is_parallel_when_noncausal_and_chunk_when_causal():
    q, k, v = rand_qkv(2, 2, 100, 8, 5, seed=8)
    torch.testing.assert_close(_la(q, k, v, False, "auto"), _la(q, k, v, False, "parallel"), rtol=0, atol=0)
    for cs in (16, 64):
        torch.testing.assert_close(
            _la(q, k, v, True, "auto", chunk_size=cs), _la(q, k, v, True, "chunk", chunk_size=cs), rtol=0, atol=0
        )


def test_default_arguments():
    """Defaults: elu+1, non-causal, normalised, eps 1e-6."""
    q, k, v = rand_qkv(2, 2, 30, 5, 6, seed=1)
    ref, _, _ = ref_linear_attention(q, k, v)
    torch.testing.assert_close(linattn.linear_attention(q, k, v), ref, **TIGHT)


# --------------------------------------------------------------------------------------
# eps, feature_map=None, custom feature maps with M != D
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_small_positive_normalisers_give_the_exact_average(causal, method):
    """A normaliser far below eps is still divided by as it is: eps never changes a valid output."""
    g = torch.Generator().manual_seed(0)
    q = torch.rand(1, 2, 12, 3, generator=g, dtype=torch.float64) * 1e-4
    k = torch.rand(1, 2, 12, 3, generator=g, dtype=torch.float64) * 1e-4   # den ~ 1e-8 < eps
    v = torch.randn(1, 2, 12, 2, generator=g, dtype=torch.float64)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal, feature_map=None)
    for eps in (1e-6, 1e-3, 1.0):
        out = _la(q, k, v, causal, method, feature_map=None, eps=eps, chunk_size=5)
        torch.testing.assert_close(out, ref, **TIGHT)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_the_issue_example_gives_one(causal, method):
    """q = k = -8 with elu+1 (features e^-8, normaliser 4 e^-16 ~ 4.5e-7 < eps): the average of ones is 1."""
    for dtype in (torch.float32, torch.float64):
        q = k = torch.full((1, 1, 1, 4), -8.0, dtype=dtype)
        v = torch.ones(1, 1, 1, 2, dtype=dtype)
        out = _la(q, k, v, causal, method)
        assert out.dtype == dtype
        torch.testing.assert_close(out, torch.ones_like(out), rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_eps_replaces_only_zero_or_negative_normalisers(causal, method):
    """Signed features (feature_map=None): where the normaliser is <= 0 the output is num / eps."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 12, 3, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 3, generator=g, dtype=torch.float64)
    k[:, :, 0] = 0.0                       # a zero normaliser at the first causal position
    v = torch.randn(1, 2, 12, 2, generator=g, dtype=torch.float64)
    for eps in (1e-6, 1e-2):
        out = _la(q, k, v, causal, method, feature_map=None, eps=eps, chunk_size=5)
        ref, _, _ = ref_linear_attention(q, k, v, causal=causal, feature_map=None, eps=eps)
        torch.testing.assert_close(out, ref, **TIGHT)
        a = q @ k.transpose(-1, -2)
        if causal:
            a = a.tril()
        den, num = a.sum(-1, keepdim=True), a @ v
        negative = den <= 0
        assert negative.any()                      # the case is exercised
        torch.testing.assert_close(out[negative.expand_as(out)], (num / eps)[negative.expand_as(num)], **TIGHT)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_feature_map_none(causal, method, normalize):
    """q, k are already features (nonnegative for the normalised form; anything when unnormalised)."""
    g = torch.Generator().manual_seed(2)
    M = 9
    if normalize:
        q = torch.rand(2, 2, 30, M, generator=g, dtype=torch.float64)
        k = torch.rand(2, 2, 30, M, generator=g, dtype=torch.float64)
    else:
        q = torch.randn(2, 2, 30, M, generator=g, dtype=torch.float64)
        k = torch.randn(2, 2, 30, M, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 30, 4, generator=g, dtype=torch.float64)
    for x in (q, k, v):
        x.requires_grad_(True)
    _check_values_and_grads(q, k, v, causal, method, feature_map=None, normalize=normalize, chunk_size=8)


def _cat_feature_map(x):
    return torch.cat([F.elu(x) + 1, x.square(), torch.ones_like(x[..., :1])], dim=-1)  # M = 2D + 1


class _RandomFeatures(torch.nn.Module):
    """exp(x W) / sqrt(M): a positive random-feature map with M != D (Performer-like)."""

    def __init__(self, D, M):
        super().__init__()
        g = torch.Generator().manual_seed(99)
        self.register_buffer("W", 0.3 * torch.randn(D, M, generator=g, dtype=torch.float64))

    def forward(self, x):
        return torch.exp(x @ self.W.to(x.dtype)) / self.W.shape[1] ** 0.5


@pytest.mark.parametrize("which", ["callable-2D+1", "module-M13", "module-M2"])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_custom_feature_map_with_M_not_D(causal, method, which):
    D, Dv = 5, 3
    fmap = {"callable-2D+1": _cat_feature_map, "module-M13": _RandomFeatures(D, 13),
            "module-M2": _RandomFeatures(D, 2)}[which]
    M = fmap(torch.zeros(1, D, dtype=torch.float64)).shape[-1]
    assert M != D
    q, k, v = rand_qkv(2, 2, 26, D, Dv, seed=3, requires_grad=True)
    _check_values_and_grads(q, k, v, causal, method, feature_map=fmap, chunk_size=8)
    S0, z0 = _rand_state(2, 2, M, Dv, seed=4)
    out, state = _la(q, k, v, causal, method, feature_map=fmap, chunk_size=8,
                     initial_state=linattn.LinearAttentionState(S=S0, z=z0), return_state=True)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=causal, feature_map=fmap, initial_state=(S0, z0))
    torch.testing.assert_close(out, ref, **TIGHT)
    assert state.S.shape == (2, 2, M, Dv) and state.z.shape == (2, 2, M)
    torch.testing.assert_close(state.S, S_ref, **TIGHT)
    torch.testing.assert_close(state.z, z_ref, **TIGHT)


# --------------------------------------------------------------------------------------
# Layouts and dtypes
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_non_contiguous_inputs(causal, method):
    """(B, T, H, D) tensors transposed to (B, H, T, D) views, as a model produces them."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 31, 3, d, generator=g, dtype=torch.float64).transpose(1, 2) for d in (6, 6, 4))
    assert not q.is_contiguous()
    out = _la(q, k, v, causal, method, chunk_size=8)
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref, **TIGHT)
    torch.testing.assert_close(out, _la(q.contiguous(), k.contiguous(), v.contiguous(), causal, method,
                                        chunk_size=8), **TIGHT)


@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_float32_close_to_float64_reference(causal, method):
    q, k, v = rand_qkv(2, 3, 150, 16, 16, dtype=torch.float32, seed=2)
    out = _la(q, k, v, causal, method, chunk_size=32)
    assert out.dtype == torch.float32
    ref, _, _ = ref_linear_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,method", CASES, ids=CASE_IDS)
def test_half_dtypes_small(causal, method, dtype):
    """Output in the input dtype; state in float32; values within a few ulps of the output dtype."""
    q, k, v = rand_qkv(2, 2, 70, 16, 8, dtype=dtype, seed=4)
    S0, z0 = _rand_state(2, 2, 16, 8, seed=5, dtype=torch.float32)
    out, state = _la(q, k, v, causal, method, chunk_size=16, return_state=True,
                     initial_state=linattn.LinearAttentionState(S=S0, z=z0))
    assert out.dtype == dtype
    assert state.S.dtype == torch.float32 and state.z.dtype == torch.float32
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=causal, initial_state=(S0, z0))
    # tolerance: ~2 ulps of the output dtype at 1 (the features are computed from the rounded inputs)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    # the state is accumulated in float32: float32-level agreement
    torch.testing.assert_close(state.S.double(), S_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(state.z.double(), z_ref, rtol=1e-5, atol=1e-4)
    # without an initial state too
    out0, state0 = _la(q, k, v, causal, method, chunk_size=16, return_state=True)
    assert out0.dtype == dtype
    assert state0.S.dtype == torch.float32 and state0.z.dtype == torch.float32
    _, S_ref0, z_ref0 = ref_linear_attention(q, k, v, causal=causal)
    torch.testing.assert_close(state0.S.double(), S_ref0, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(state0.z.double(), z_ref0, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_long_sequence_noncausal_is_finite(dtype):
    """T=8192: the normaliser (about 8192 * phi(q).phi(k) ~ 1e6) overflows float16 unless accumulated in float32."""
    T, D, Dv = 8192, 64, 32
    q, k, v = rand_qkv(1, 2, T, D, Dv, dtype=dtype, seed=8192)
    ref = ref_linear_attention_big_noncausal(q, k, v)
    fq, fk = F.elu(q.double()) + 1, F.elu(k.double()) + 1
    assert (fq @ fk.sum(-2, keepdim=True).transpose(-1, -2)).max() > 65504  # the overflow is real
    for method in ("auto", "parallel"):
        out = _la(q, k, v, False, method)
        assert out.dtype == dtype
        assert torch.isfinite(out).all(), f"{method}: non-finite output in {dtype}"
        # stated tolerance: 2 ulps at 1 of the output dtype (outputs are weighted means of v, |out| < 1)
        tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(out.double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_long_sequence_causal_is_finite(dtype):
    T, D, Dv = 8192, 16, 16
    q, k, v = rand_qkv(1, 1, T, D, Dv, dtype=dtype, seed=1)
    q, k = q * 2, k * 2  # larger features: the causal prefix sums pass 65504 too
    ref = ref_linear_attention_big_causal(q, k, v)
    fq, fk = F.elu(q.double()) + 1, F.elu(k.double()) + 1
    assert (fq * fk.cumsum(-2)).sum(-1).max() > 65504  # the causal normaliser overflows float16
    out = _la(q, k, v, True, "chunk", chunk_size=64)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


# --------------------------------------------------------------------------------------
# softmax_attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3, 1.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_matches_reference(causal, scale):
    q, k, v = rand_qkv(2, 3, 29, 8, 5, seed=2, requires_grad=True)
    out = linattn.softmax_attention(q, k, v, causal=causal, scale=scale)
    ref = ref_softmax_attention(q, k, v, causal=causal, scale=scale)
    assert out.shape == (2, 3, 29, 5) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, **TIGHT)
    g = torch.randn(ref.shape, dtype=torch.float64)
    for a, b in zip(grads(out, (q, k, v), g), grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("Tq,Tk", [(5, 17), (17, 5), (1, 1)])
def test_softmax_cross_attention_with_mask(Tq, Tk):
    q, k, v = rand_qkv(3, 2, Tq, 4, 6, Tk=Tk, seed=Tq + Tk)
    mask = torch.ones(3, Tk, dtype=torch.bool)
    mask[1, : Tk // 2] = False
    mask[2, :] = False  # batch element 2 sees no key at all -> its outputs are 0
    out = linattn.softmax_attention(q, k, v, attention_mask=mask)
    ref = ref_softmax_attention(q, k, v, attention_mask=mask)
    torch.testing.assert_close(out, ref, **TIGHT)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isfinite(out).all()


def test_softmax_left_padded_causal_rows_without_keys_are_zero():
    q, k, v = rand_qkv(2, 2, 12, 4, 3, seed=3, requires_grad=True)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    out = linattn.softmax_attention(q, k, v, causal=True, attention_mask=mask)
    ref = ref_softmax_attention(q, k, v, causal=True, attention_mask=mask)
    torch.testing.assert_close(out, ref, **TIGHT)
    assert torch.equal(out[1, :, :5], torch.zeros_like(out[1, :, :5]))
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(d).all() for d in (dq, dk, dv))
    # real tokens equal the unpadded sequence
    alone = linattn.softmax_attention(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], causal=True)
    torch.testing.assert_close(out[1:, :, 5:], alone, **TIGHT)


@pytest.mark.parametrize("scale", [None, 0.125, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_matches_torch_sdpa(causal, scale):
    q, k, v = rand_qkv(2, 4, 33, 16, 16, dtype=torch.float32, seed=7)
    out = linattn.softmax_attention(q, k, v, causal=causal, scale=scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_softmax_with_padding_matches_sdpa():
    q, k, v = rand_qkv(2, 2, 10, 8, 8, Tk=14, dtype=torch.float32, seed=1)
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, 9:] = False
    out = linattn.softmax_attention(q, k, v, attention_mask=mask)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


def test_linear_attention_state_is_dataclass():
    assert dataclasses.is_dataclass(linattn.LinearAttentionState)
    names = [f.name for f in dataclasses.fields(linattn.LinearAttentionState)]
    assert names[:2] == ["S", "z"] or set(names) >= {"S", "z"}
