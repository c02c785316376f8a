"""The normaliser: however small, a positive normaliser is divided by as it is.

``eps`` only replaces a normaliser that is zero, negative or not finite. Normalised linear
attention is a weighted average, so it is invariant to a positive rescaling of φ(q) (one
query's features) or of all φ(k): the tests scale them down to 1e-30.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import linattn
from linattn._numerics import all_finite
from refimpl import ref_linear_attention

METHODS = [(False, "parallel"), (False, "quadratic"), (True, "quadratic"), (True, "recurrent"), (True, "chunk")]


def _features(B, H, T, M, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    phi_q = torch.rand(B, H, T, M, generator=g, dtype=torch.float64).add_(0.05).to(dtype)
    phi_k = torch.rand(B, H, T, M, generator=g, dtype=torch.float64).add_(0.05).to(dtype)
    v = torch.randn(B, H, T, 3, generator=g, dtype=torch.float64).to(dtype)
    return phi_q, phi_k, v


@settings(max_examples=30)
@given(log_scale=st.floats(-30, 0), T=st.integers(1, 30), C=st.integers(1, 9), seed=st.integers(0, 1000),
       which=st.sampled_from(["q", "k"]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_property_invariant_to_positive_rescaling(log_scale, T, C, seed, which, dtype):
    c = 10.0 ** log_scale
    phi_q, phi_k, v = _features(1, 2, T, 4, seed, dtype)
    scaled_q, scaled_k = (phi_q * c, phi_k) if which == "q" else (phi_q, phi_k * c)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    for causal, method in METHODS:
        ref = linattn.linear_attention(phi_q, phi_k, v, feature_map=None, causal=causal, method=method, chunk_size=C)
        got = linattn.linear_attention(scaled_q, scaled_k, v, feature_map=None, causal=causal, method=method,
                                       chunk_size=C)
        torch.testing.assert_close(got, ref, **tol)
    # the step API: one token at a time
    state, ref_state = None, None
    for t in range(T):
        y, state = linattn.linear_attention_step(scaled_q[:, :, t], scaled_k[:, :, t], v[:, :, t], state,
                                                 feature_map=None)
        y_ref, ref_state = linattn.linear_attention_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], ref_state,
                                                         feature_map=None)
        torch.testing.assert_close(y, y_ref, **tol)


@pytest.mark.parametrize("causal,method", METHODS)
def test_backward_is_exact_for_tiny_normalisers(causal, method):
    """Gradients through a normaliser of ~1e-28 equal those of the unscaled problem (scaled back)."""
    phi_q, phi_k, v = _features(1, 2, 11, 4, seed=3, dtype=torch.float64)
    c = 1e-14
    a = (phi_q * c).requires_grad_()
    b = (phi_k * c).requires_grad_()
    out = linattn.linear_attention(a, b, v, feature_map=None, causal=causal, method=method, chunk_size=4)
    ga, gb = torch.autograd.grad(out.square().sum(), (a, b))
    a0, b0 = phi_q.clone().requires_grad_(), phi_k.clone().requires_grad_()
    out0 = linattn.linear_attention(a0, b0, v, feature_map=None, causal=causal, method=method, chunk_size=4)
    ga0, gb0 = torch.autograd.grad(out0.square().sum(), (a0, b0))
    torch.testing.assert_close(out, out0, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ga * c, ga0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gb * c, gb0, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("std", [1.0, 2.5, 4.0])
def test_performer_features_of_large_inputs_average_correctly(std):
    """Performer features of inputs of std 2.5 give normalisers ~1e-7: the output is still the average."""
    g = torch.Generator().manual_seed(0)
    q, k = (std * torch.randn(1, 2, 64, 16, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 64, 8, generator=g)
    phi = linattn.PerformerFeatures(16, 64, seed=1)
    for causal in (False, True):
        out = linattn.linear_attention(phi(q, is_query=True), phi(k), v, feature_map=None, causal=causal)
        ref, _, _ = ref_linear_attention(phi(q.double(), is_query=True), phi(k.double()), v, feature_map=None,
                                         causal=causal)
        torch.testing.assert_close(out.double(), ref, rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------- all_finite records nothing for autograd


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
