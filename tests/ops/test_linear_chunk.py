"""The fast chunkwise path (method="chunk"): autograd behaviour, memory, mixed precision."""

import pytest
import torch

import linattn
from linattn.bench import peak_memory
from refimpl import ref_linear_attention


def _qkv(B, H, T, D, Dv, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64)
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v))


def test_double_backward_raises_instead_of_silently_wrong_hessian():
    q, k, v = _qkv(1, 1, 7, 4, 4, requires_grad=True)
    y = linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=4)
    # create_graph=True itself works (torch.func.grad uses it for first derivatives) ...
    (gq_chunk,) = torch.autograd.grad(y.pow(2).sum(), q, create_graph=True)
    assert gq_chunk.requires_grad
    # ... and differentiating that gradient again raises instead of treating it as a constant
    with pytest.raises(RuntimeError, match="second derivatives .* are not supported"):
        torch.autograd.grad(gq_chunk.pow(2).sum(), q)
    # the quadratic form supports it, and single backward still works on the chunk path
    y = linattn.linear_attention(q, k, v, causal=True, method="quadratic")
    (gq,) = torch.autograd.grad(y.pow(2).sum(), q, create_graph=True)
    assert torch.autograd.grad(gq.pow(2).sum(), q)[0].isfinite().all()


@pytest.mark.parametrize("T", [8, 13])
def test_output_can_be_modified_in_place(T):
    q, k, v = _qkv(1, 1, T, 4, 4, dtype=torch.float32, requires_grad=True)
    y = linattn.linear_attention(q, k, v, causal=True, chunk_size=4)
    y.add_(1.0)  # e.g. an in-place residual; not a view of anything internal
    assert y._base is None


def test_output_modified_in_place_then_backward_is_an_autograd_error_not_a_wrong_gradient():
    q, k, v = _qkv(1, 1, 8, 4, 4, dtype=torch.float32, requires_grad=True)
    y = linattn.linear_attention(q, k, v, causal=True, chunk_size=4)
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_chunk_size_longer_than_sequence_costs_no_padding():
    q, k, v = _qkv(1, 1, 10, 64, 64, dtype=torch.float32)
    small = peak_memory(lambda: linattn.linear_attention(q, k, v, causal=True, chunk_size=16))
    huge = peak_memory(lambda: linattn.linear_attention(q, k, v, causal=True, chunk_size=4096))
    assert huge == small


def test_unused_state_outputs_need_no_gradient():
    q, k, v = _qkv(2, 2, 70, 8, 5, requires_grad=True)
    out, state = linattn.linear_attention(q, k, v, causal=True, return_state=True, chunk_size=16)
    out.sum().backward()                       # no gradient flows into state.S / state.z
    q_r, k_r, v_r = (x.detach().requires_grad_() for x in (q, k, v))
    ref_out, _, _ = ref_linear_attention(q_r, k_r, v_r, causal=True)
    ref_out.sum().backward()
    for got, want in ((q.grad, q_r.grad), (k.grad, k_r.grad), (v.grad, v_r.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # and a loss on the state alone reaches k and v but not q
    q2, k2, v2 = _qkv(2, 2, 70, 8, 5, requires_grad=True)
    _, state = linattn.linear_attention(q2, k2, v2, causal=True, return_state=True, chunk_size=16)
    (state.S.sum() + state.z.sum()).backward()
    assert q2.grad is None or torch.count_nonzero(q2.grad) == 0
    assert torch.count_nonzero(k2.grad) > 0 and torch.count_nonzero(v2.grad) > 0


# Mixed precision. Tolerances: the inputs are rounded to the half dtype, the state and the
# normaliser are float32, and only the output is rounded again, so the error against the
# float64 result on the same (rounded) inputs is about one rounding of the output:
# half an ulp of |y| <= 1 is 2**-11 for float16 and 2**-8 for bfloat16. We allow twice that.
HALF_TOL = {torch.float16: 2 * 2.0**-11, torch.bfloat16: 2 * 2.0**-8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_half_precision_error_against_float64_is_one_output_rounding(dtype, causal):
    q, k, v = _qkv(1, 2, 2048, 32, 32, dtype=dtype, seed=1)
    out = linattn.linear_attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    ref = linattn.linear_attention(q.double(), k.double(), v.double(), causal=causal, method="quadratic")
    err = (out.double() - ref).abs().max().item()
    assert err <= HALF_TOL[dtype], f"{dtype}: max error {err:.2e} > {HALF_TOL[dtype]:.2e}"


@pytest.mark.parametrize("causal", [True, False])
def test_float16_at_65536_tokens_is_finite(causal):
    # The normaliser reaches ~T*M*e^(1/2) >> 65504 here: it must not be accumulated in float16.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 65536, 16, generator=g).to(torch.float16) for _ in range(3))
    out, state = linattn.linear_attention(q, k, v, causal=causal, return_state=True)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert state.z.dtype == torch.float32 and state.z.max().item() > torch.finfo(torch.float16).max
    # the last query of the causal run sees every key: it must equal the non-causal answer's float32 value
    ref = linattn.linear_attention(q[:, :, -1:].float(), k.float(), v.float())
    assert torch.allclose(out[:, :, -1:].float(), ref, atol=2 * 2.0**-11, rtol=0)


def _chunk_matches_reference(q, k, v, chunk_size, normalize, state):
    """The chunk method's output and final state against the float64 masked quadratic form; returns both
    (output, state) and the reference's (output, S, z)."""
    out, st_out = linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=chunk_size,
                                           normalize=normalize, initial_state=state, return_state=True)
    ref, S_ref, z_ref = ref_linear_attention(q, k, v, causal=True, normalize=normalize,
                                             initial_state=None if state is None else (state.S, state.z))
    for got, want in ((out, ref), (st_out.S, S_ref), (st_out.z, z_ref)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    return out, st_out, ref, S_ref, z_ref


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(1, 200), D=st.integers(1, 9),
    Dv=st.integers(1, 9), chunk_size=st.integers(1, 70), normalize=st.booleans(),
    with_state=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_chunk_with_state_matches_float64_reference(B, H, T, D, Dv, chunk_size, normalize,
                                                             with_state, seed):
    """The fast chunk path: outputs, final state and every gradient (q, k, v, S0, z0) against the
    masked quadratic form in float64, for random shapes, ragged T and any chunk size."""
    q, k, v = _qkv(B, H, T, D, Dv, seed=seed, requires_grad=True)
    g = torch.Generator().manual_seed(seed + 1)
    state = None
    params = [q, k, v]
    if with_state:
        S0 = torch.rand(B, H, D, Dv, generator=g, dtype=torch.float64).requires_grad_()
        z0 = torch.rand(B, H, D, generator=g, dtype=torch.float64).requires_grad_()
        state = linattn.LinearAttentionState(S0, z0)
        params += [S0, z0]
    out, st_out, ref, S_ref, z_ref = _chunk_matches_reference(q, k, v, chunk_size, normalize, state)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_S = torch.randn(S_ref.shape, generator=g, dtype=torch.float64)
    loss = (out * w_out).sum() + (st_out.S * w_S).sum() + st_out.z.sum()
    loss_ref = (ref * w_out).sum() + (S_ref * w_S).sum() + z_ref.sum()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads_ref = torch.autograd.grad(loss_ref, params, allow_unused=True)
    for got, want in zip(grads, grads_ref):
        if want is None:
            assert got is None or torch.count_nonzero(got) == 0
        else:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def _by_head_everywhere(mp, min_chunks=4, block=3):
    """Let the head-by-head no-grad forward run on small problems (its thresholds are performance rules)."""
    import linattn.ops.linear.chunk as chunk_module
    mp.setattr(chunk_module, "BY_HEAD_MIN_CHUNKS", min_chunks)
    mp.setattr(chunk_module, "BY_HEAD_MIN_SIZE", 1)
    mp.setattr(chunk_module, "HEAD_BLOCK_CHUNKS", block)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), chunk_size=st.integers(1, 5), T=st.integers(20, 120),
    D=st.integers(1, 6), Dv=st.integers(1, 6), normalize=st.booleans(), with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_no_grad_forward_matches_float64_reference(B, H, chunk_size, T, D, Dv, normalize, with_state,
                                                            seed):
    """A call that needs no gradient, run head by head (thresholds lowered so that small problems take that
    path; blocks of 3 chunks, so several blocks and a ragged tail): output and final state against the masked
    quadratic form in float64."""
    q, k, v = _qkv(B, H, T, D, Dv, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    state = None
    if with_state:
        state = linattn.LinearAttentionState(torch.rand(B, H, D, Dv, generator=g, dtype=torch.float64),
                                             torch.rand(B, H, D, generator=g, dtype=torch.float64))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad(), linattn.backends.use_backends("torch"):
        _by_head_everywhere(mp)
        _chunk_matches_reference(q, k, v, chunk_size, normalize, state)


def test_no_grad_forward_sums_the_states_in_order(monkeypatch):
    """Finite values whose running sums stay finite (2e38, -2e38, -2e38, 2e38 and 1e8, -1e8, 1): the head-by-head
    forward sums the chunk states one after another, as the Function does, so no partial sum overflows and no
    small term is lost (a grouped scan gave -inf and 0 here, found by a new-user test)."""
    _by_head_everywhere(monkeypatch, min_chunks=1, block=64)
    T = 64
    q = k = torch.ones(1, 1, T, 1)
    for values, want_after in (((2e38, -2e38, -2e38, 2e38), 0.0), ((1e8, -1e8, 1.0, 0.0), 1.0)):
        v = torch.zeros(1, 1, T, 1)
        v[0, 0, 7:11, 0] = torch.tensor(values)
        with torch.no_grad(), linattn.backends.use_backends("torch"):
            out, st = linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=1, normalize=False,
                                               feature_map=None, return_state=True)
        assert torch.equal(out[0, 0, 10:, 0], torch.full((T - 10,), want_after)), out[0, 0, 8:14, 0]
        assert st.S.item() == want_after


def test_no_grad_forward_keeps_no_sequence_long_workspace(monkeypatch):
    """Without a gradient to compute, the chunk form keeps no (B, H, N, C, C) scores for a backward: its peak
    memory stays below half of that tensor (the Function, which saves them for the backward, takes more than
    all of it)."""
    _by_head_everywhere(monkeypatch, min_chunks=128)
    B, H, D, C = 1, 8, 2, 32
    T = C * 128
    q, k, v = _qkv(B, H, T, D, D)
    with torch.no_grad(), linattn.backends.use_backends("torch"):
        peak = peak_memory(lambda: linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=C))
    assert peak < B * H * T * C * 8 / 2, peak


def test_no_grad_forward_keeps_non_finite_inputs_causal(monkeypatch):
    """A NaN in one key of a long no-grad call: every output before it is the finite reference value, and the
    state and outputs from it on are NaN (as the Function's forward gives them)."""
    _by_head_everywhere(monkeypatch, min_chunks=16)
    q, k, v = _qkv(1, 2, 640, 4, 3)
    k[0, 1, 300, 2] = float("nan")
    with linattn.backends.use_backends("torch"):
        with torch.no_grad():
            out, st_out = linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=4,
                                                   return_state=True)
        want, want_state = linattn.linear_attention(q.clone().requires_grad_(), k, v, causal=True, method="chunk",
                                                    chunk_size=4, return_state=True)      # the Function
    ref = ref_linear_attention(q[:, :, :300], k[:, :, :300], v[:, :, :300], causal=True)[0]
    torch.testing.assert_close(out[:, :, :300], ref, rtol=1e-9, atol=1e-10)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(st_out.S.isnan(), want_state.S.isnan())
    assert out[0, 1, 300:].isnan().all() and out[0, 0].isfinite().all()


@pytest.mark.parametrize("T", [200, 128 * 32])      # the Function's path, and the length of the head-by-head path
@pytest.mark.parametrize("normalize", [True, False])
def test_chunk_forward_mode_ad_outside_torch_func(T, normalize):
    """Forward-mode duals (torch.autograd.forward_ad, no torch.func transform) get the chunk form's tangent: the
    same as autograd's forward mode through the quadratic form, in float64."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(3)
    q, k, v, tq, tk, tv = (torch.randn(1, 2, T, 32, generator=g, dtype=torch.float64) for _ in range(6))
    tangents = {}
    with fwAD.dual_level():
        for method in ("chunk", "quadratic"):
            y = linattn.linear_attention(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), fwAD.make_dual(v, tv),
                                         causal=True, method=method, chunk_size=32, normalize=normalize)
            tangents[method] = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(tangents["chunk"], tangents["quadratic"], rtol=1e-9, atol=1e-10)
