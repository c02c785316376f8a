"""The prefix form of the decayed scores for chunks of mild decay (GLA, the gated delta rule per head and per channel).

Chunks whose total log-decay is at most ``MILD_DECAY`` get their scores as ``(x ⊙ e^{b})(y ⊙
e^{−b})ᵀ``; the others keep the range-by-range products. References: the token-by-token
recurrence differentiated by autograd, in float64 (and float64 truth for float32 accuracy).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops import _common, decay as _decay

F64 = dict(rtol=1e-9, atol=1e-10)
FAMILIES = ["gla", "gated_delta", "gated_delta_channel"]


def _inputs(family, T, D, seed, log_g=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 3
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    if family != "gla":
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    shape = (B, H, T) if family == "gated_delta" else (B, H, T, D)
    if log_g is None:
        log_g = F.logsigmoid(torch.randn(*shape, generator=g, dtype=dtype)) / 8   # every gate >= e^-1 here
    S0 = torch.randn(B, H, D, D, generator=g, dtype=dtype)
    return [x.detach().clone().requires_grad_() for x in (q, k, v, log_g.expand(shape), beta, S0)]


def _grads(family, xs, method, chunk_size=16):
    q, k, v, log_g, beta, S0 = xs
    if family == "gla":
        out, S = linattn.gated_linear_attention(q, k, v, log_g, method=method, chunk_size=chunk_size,
                                                initial_state=S0, return_state=True)
    else:
        out, S = linattn.gated_delta_rule(q, k, v, log_g, beta, method=method, chunk_size=chunk_size,
                                          initial_state=S0, return_state=True)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    w_S = torch.linspace(1, -2, S.numel(), dtype=S.dtype).reshape(S.shape)
    grads = torch.autograd.grad((out * w_out).sum() + (S * w_S).sum(), xs, allow_unused=True)
    return [out, S, *(torch.zeros_like(x) if d is None else d for x, d in zip(xs, grads))]


@pytest.fixture
def choices(monkeypatch):
    """Records every group's choice (True: the prefix form) of the PyTorch chunk form, which the test runs
    whatever the host's calibration chose for the compiled CPU loops (they make no such choice)."""
    seen = []
    real = _decay.mild_groups

    def spy(*args):
        out = real(*args)
        seen.extend(out)
        return out
    import linattn.ops.gla.chunk as gla_chunk
    import linattn.ops.wy.function as wy_function
    monkeypatch.setattr(gla_chunk, "mild_groups", spy)
    monkeypatch.setattr(wy_function, "mild_groups", spy)
    with linattn.backends.use_backends("torch"):
        yield seen


def test_mild_groups_decide_by_depth_size_and_finite_entries():
    C, D = 32, 4
    g = torch.full((4, C, 1), -(_decay.MILD_DECAY - 0.5) / C)      # depth just below the bound
    g[1] = -(_decay.MILD_DECAY + 0.5) / C                           # and just above it
    x, y = torch.ones(4, C, D), torch.ones(4, C, D)
    x[2, 3, 1] = float("nan")                                       # non-finite entries do not count
    x[3, 0, 0] = 1e30                                               # Dk·max|x|·max|y|·e^{3·bound} overflows
    one_each = [slice(i, i + 1) for i in range(4)]
    assert _decay.mild_groups(one_each, g, x, y) == [True, False, True, False]
    assert _decay.mild_groups([slice(0, 1), slice(1, 4)], g, x, y) == [True, False]
    per_channel = g.expand(4, C, D).clone()
    per_channel[0, :, 2] = -(_decay.MILD_DECAY + 0.5) / C           # one channel too deep is enough
    assert _decay.mild_groups(one_each[:1], per_channel, x, y) == [False]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["prefix", "ranges", "mixed"])
def test_both_forms_and_a_mix_match_the_recurrence_in_float64(family, path, choices, monkeypatch):
    T, C, D = 100, 16, 5
    gen = torch.Generator().manual_seed(3)
    shape = (2, 3, T) if family == "gated_delta" else (2, 3, T, D)
    log_g = F.logsigmoid(torch.randn(*shape, generator=gen, dtype=torch.float64)) / 4
    if path == "ranges":
        log_g = log_g - 2.0                                         # depth > 32 in every chunk
    if path == "mixed":
        log_g[:, 1] -= 2.0                                          # the second head's chunks are deep
        monkeypatch.setattr(_common, "GROUP_NUMBERS", 1)             # one chunk per group
    xs = _inputs(family, T, D, 0, log_g)
    got = _grads(family, xs, "chunk", C)
    ref = _grads(family, xs, "recurrent", C)
    for name, a, b in zip(["out", "S", "dq", "dk", "dv", "dlog_g", "dbeta", "dS0"], got, ref):
        torch.testing.assert_close(a, b, **F64, msg=lambda m: f"{name}: {m}")
    expected = {"prefix": {True}, "ranges": {False}, "mixed": {True, False}}[path]
    assert set(choices) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_accuracy_at_the_bound(family, monkeypatch):
    """Every chunk as deep as the prefix form allows: float32 outputs and gradients stay within 2e-6
    of the largest entry of the float64 truth, as the range-by-range form does."""
    T, C, D = 256, 64, 32
    depth = _decay.MILD_DECAY * 0.99
    shape = (2, 3, T) if family == "gated_delta" else (2, 3, T, D)
    xs64 = _inputs(family, T, D, 1, torch.full(shape, -depth / C, dtype=torch.float64))
    truth = _grads(family, xs64, "recurrent", C)
    xs = [x.detach().float().requires_grad_() for x in xs64]
    errors = {}
    for bound in (_decay.MILD_DECAY, -1.0):                           # the prefix form, then the ranges
        monkeypatch.setattr(_decay, "MILD_DECAY", bound)
        got = _grads(family, xs, "chunk", C)
        errors[bound] = [(a.double() - t).abs().max().item() / t.abs().max().item()
                         for a, t in zip(got, truth) if t.abs().max() > 0]   # (GLA has no beta)
    for e_prefix, e_ranges in zip(*errors.values()):
        assert e_prefix < 2e-6 and e_ranges < 2e-6, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_the_prefix_form_is_the_one_used_for_mild_gates_only(family, choices):
    T, C, D = 64, 32, 4
    mild = _inputs(family, T, D, 2)                                   # logsigmoid(x)/8: depth ~ 3 per chunk
    _grads(family, mild, "chunk", C)
    assert choices and all(choices)
    choices.clear()
    shape = mild[3].shape
    strong = _inputs(family, T, D, 2, torch.full(shape, -1.0, dtype=torch.float64))   # depth 32
    _grads(family, strong, "chunk", C)
    assert choices and not any(choices)


def test_prefix_factors_and_their_gradient_against_autograd():
    gen = torch.Generator().manual_seed(4)
    g = (F.logsigmoid(torch.randn(3, 8, 2, generator=gen, dtype=torch.float64))).requires_grad_()
    outs = _decay.prefix_factors(g)
    b = g.cumsum(1)
    expected = (b.exp(), (-b).exp(), (b[:, -1:] - b).exp(), b[:, -1:].exp())
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    ws = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in expected]
    ref = torch.autograd.grad(sum((w * x).sum() for w, x in zip(ws, expected)), g)[0]
    got = _decay.prefix_factors_backward(*(w * x for w, x in zip(ws, expected)))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_the_bound_keeps_every_factor_finite_in_float32():
    g = torch.full((1, 64, 1), -_decay.MILD_DECAY / 64)
    assert all(torch.isfinite(x).all() for x in _decay.prefix_factors(g))
    assert math.exp(3 * _decay.MILD_DECAY) < torch.finfo(torch.float32).max


@pytest.mark.parametrize("family", FAMILIES)
def test_one_strong_gate_sends_its_chunk_to_the_ranges(family, choices):
    """A single gate below e^{-MILD_GATE} in a chunk of slow decay (total depth far below the bound):
    the prefix form would leave that gate's gradient as a difference of large sums (found by a
    new-user test: one gate of e^{-15.9} got a float32 gradient 3-9 times off). The chunk takes the
    ranges, and the gradient of the strong gate keeps its relative accuracy."""
    T, C, D = 64, 64, 8
    shape = (2, 3, T) if family == "gated_delta" else (2, 3, T, D)
    log_g = torch.full(shape, -0.01, dtype=torch.float64)
    log_g[:, :, 20] = -(_decay.MILD_GATE + 0.5)
    xs64 = _inputs(family, T, D, 5, log_g)
    truth = _grads(family, xs64, "recurrent", C)[5]
    xs = [x.detach().float().requires_grad_() for x in xs64]
    got = _grads(family, xs, "chunk", C)[5].double()
    assert choices and not any(choices)
    spike = (slice(None), slice(None), 20)
    assert (got[spike] - truth[spike]).abs().max() < 1e-5 * truth[spike].abs().max()
    choices.clear()
    log_g[:, :, 20] = -(_decay.MILD_GATE - 0.5)                      # within the bound: the prefix form
    _grads(family, _inputs(family, T, D, 5, log_g), "chunk", C)
    assert choices and all(choices)
