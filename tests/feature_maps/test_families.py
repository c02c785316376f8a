"""The feature maps of chapter 6: squared ReLU, DPFP, Performer (FAVOR+), Taylor, Hedgehog, cosFormer.

Each map is checked against its defining formula (written out here, independently), and
every map against four properties: no coupling between the elements of a batch, no leakage
from later to earlier tokens in causal attention, finite outputs for float16 inputs at
T = 4096, and argument errors that name the argument.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.feature_maps import (
    CosFormerFeatures,
    DPFPFeatures,
    HedgehogFeatures,
    PerformerFeatures,
    TaylorFeatures,
    distill_feature_map,
    get_feature_map,
    squared_relu,
)

D = 8


def _randn(*shape, seed=0, dtype=torch.float64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


# Every map, as a factory (a fresh object per test), with its feature count for head_dim D.
MAPS = {
    "elu+1": (lambda: linattn.elu_plus_one, D),
    "relu": (lambda: linattn.relu, D),
    "squared_relu": (lambda: squared_relu, D),
    "dpfp": (lambda: DPFPFeatures(nu=2), 2 * D * 2),
    "performer": (lambda: PerformerFeatures(D, 32, seed=3), 32),
    "performer_iid": (lambda: PerformerFeatures(D, 32, orthogonal=False, seed=3), 32),
    "taylor": (lambda: TaylorFeatures(), 1 + D + D * (D + 1) // 2),
    "hedgehog": (lambda: _trained_hedgehog(), 2 * D),
    "cosformer": (lambda: CosFormerFeatures(), 2 * D),
    "cosformer_maxlen": (lambda: CosFormerFeatures(max_len=5000), 2 * D),
}
# Causal attention refuses cosFormer without a fixed max_len (its features would depend on the
# length of the input: an earlier output would change with the number of tokens after it).
CAUSAL_MAPS = [name for name in MAPS if name != "cosformer"]
MAP_CASES = [(name, causal) for name in MAPS for causal in (False, True) if causal is False or name in CAUSAL_MAPS]


def _trained_hedgehog():
    """A Hedgehog map moved away from its identity start (weights of both signs, a bias)."""
    h = HedgehogFeatures(D)
    with torch.no_grad():
        h.weight.add_(0.3 * _randn(D, D, seed=11, dtype=torch.float32))
        h.bias.add_(0.1 * _randn(D, seed=12, dtype=torch.float32))
    return h


# ------------------------------------------------------------------------------------------
# Names, shapes, and use through linear_attention
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MAPS))
def test_feature_count_and_dtype(name):
    factory, M = MAPS[name]
    phi = factory()
    for dtype in (torch.float64, torch.float32, torch.float16):
        x = _randn(2, 3, 7, D, dtype=dtype)
        y = phi(x)
        assert y.shape == (2, 3, 7, M) and y.dtype == dtype


@pytest.mark.parametrize("name,cls,causal", [
    (name, cls, causal)
    for name, cls in [("dpfp", DPFPFeatures), ("performer", PerformerFeatures), ("favor+", PerformerFeatures),
                      ("Taylor", TaylorFeatures), ("cosformer", CosFormerFeatures)]
    for causal in (False, True) if not (causal and cls is CosFormerFeatures)])
def test_by_name_equals_object(name, cls, causal):
    """A name passed to linear_attention builds the map with its defaults: same numbers as the object."""
    q, k, v = (_randn(2, 2, 33, D, seed=s) for s in range(3))
    a = linattn.linear_attention(q, k, v, feature_map=name, causal=causal)
    b = linattn.linear_attention(q, k, v, feature_map=cls(), causal=causal)
    assert isinstance(get_feature_map(name), cls)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hedgehog_by_name_needs_head_dim():
    with pytest.raises(TypeError, match=r"hedgehog.*head_dim"):
        get_feature_map("hedgehog")
    assert isinstance(get_feature_map("hedgehog", head_dim=4), HedgehogFeatures)


@pytest.mark.parametrize("name,causal", MAP_CASES)
def test_methods_agree_and_step_matches(name, causal):
    """Every map runs through every method of linear_attention with the same result."""
    phi = MAPS[name][0]()
    q, k, v = (_randn(2, 2, 40, D, seed=10 + s) for s in range(3))
    ref = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal, method="quadratic")
    methods = ("chunk", "recurrent") if causal else ("parallel",)
    for method in methods:
        out = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal, method=method, chunk_size=16)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_squared_relu_values():
    x = _randn(3, 5, D)
    assert torch.equal(squared_relu(x), torch.clamp(x, min=0) ** 2)
    assert torch.equal(get_feature_map("squared_relu")(x), squared_relu(x))


# ------------------------------------------------------------------------------------------
# DPFP
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_matches_its_definition(nu):
    x = _randn(4, 6, D)
    r = torch.cat([x.clamp(min=0), (-x).clamp(min=0)], dim=-1)     # (..., 2D)
    n2 = 2 * D
    expected = torch.stack(
        [r[..., i] * r[..., (i - n) % n2] for n in range(1, nu + 1) for i in range(n2)], dim=-1)
    torch.testing.assert_close(DPFPFeatures(nu)(x), expected, rtol=0, atol=0)


def test_dpfp_order_too_large():
    """From ν = D on, the products at distance D, relu(x_i)·relu(-x_i), are always zero: refused."""
    x = _randn(2, D)
    assert (DPFPFeatures(nu=D - 1)(x) != 0).any()
    for nu in (D, 2 * D):
        with pytest.raises(ValueError, match=rf"DPFP needs nu < D for inputs with D = {D}, got nu = {nu}.*always zero"):
            DPFPFeatures(nu=nu)(x)
    with pytest.raises(ValueError, match=r"got nu = 1"):                # D = 1: every DPFP feature would be 0
        DPFPFeatures(nu=1)(_randn(2, 1))


# ------------------------------------------------------------------------------------------
# Performer (FAVOR+)
# ------------------------------------------------------------------------------------------


def _performer_estimates(orthogonal, n_draws, q, k, M):
    est = []
    for seed in range(n_draws):
        phi = PerformerFeatures(q.shape[-1], M, orthogonal=orthogonal, seed=seed, scale=1.0)
        est.append((phi(q) * phi(k)).sum(-1))
    return torch.stack(est)                                          # (n_draws, pairs)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_performer_is_unbiased(orthogonal):
    """Averaged over 4000 draws of W, φ(q)ᵀφ(k) approaches exp(qᵀk).

    Tolerance: for every (q, k) pair the mean of the draws (M = 64 features each) is within
    4 standard errors of exp(qᵀk), the standard error estimated from the same draws. The
    test has power because the exact standard error of the i.i.d. estimator,
    ``exp(qᵀk) · sqrt((exp(|q + k|²) − 1) / (M · n))`` (Choromanski et al., 2021, Lemma 2;
    orthogonal draws have less), is below 5 % of exp(qᵀk). (The estimator is heavy-tailed:
    the standard error measured from the draws tends to fall short of the exact one, so the
    power is checked with the exact one.)
    """
    n, M = 4000, 64
    q = _randn(6, D, seed=1, scale=0.4)
    k = _randn(6, D, seed=2, scale=0.4)
    exact = (q * k).sum(-1).exp()
    exact_se = torch.sqrt((((q + k) ** 2).sum(-1).exp() - 1) / (M * n))        # relative to exp(qᵀk)
    assert (exact_se < 0.05).all(), exact_se
    est = _performer_estimates(orthogonal, n, q, k, M=M)
    mean, se = est.mean(0), est.std(0) / math.sqrt(est.shape[0])
    assert ((mean - exact).abs() <= 4 * se).all(), ((mean - exact) / se)


def test_performer_orthogonal_draws_have_lower_variance():
    """Measured over 20000 independent draws of M = D = 16 features: the variance of φ(q)ᵀφ(k) / exp(qᵀk),
    averaged over 6 pairs, is below 90 % of the i.i.d. one with orthogonal draws (about 78 % measured).

    One map with 20000·D features holds 20000 independent blocks; the mean over each block of D features
    is one draw of an M = D estimator (orthogonal blocks are drawn independently of each other).
    """
    n, dim = 20000, 16
    q = _randn(6, dim, seed=1, scale=0.2)
    k = _randn(6, dim, seed=2, scale=0.2)
    exact = (q * k).sum(-1).exp()
    variance = {}
    for orthogonal in (True, False):
        phi = PerformerFeatures(dim, n * dim, orthogonal=orthogonal, seed=0, scale=1.0)
        draws = (phi(q) * phi(k) * (n * dim)).reshape(6, n, dim).mean(-1)          # (pairs, draws)
        variance[orthogonal] = (draws.var(1) / exact**2).mean()
    assert variance[True] < 0.9 * variance[False], (variance[True] / variance[False])


def test_performer_projection_is_orthogonal_in_blocks_with_gaussian_norms():
    W = PerformerFeatures(D, 3 * D, seed=5).projection                  # (3D, D)
    for b in range(3):
        block = W[b * D:(b + 1) * D]
        gram = block @ block.T
        torch.testing.assert_close(gram - torch.diag(torch.diagonal(gram)), torch.zeros(D, D, dtype=W.dtype),
                                   rtol=0, atol=1e-12)
    norms = W.norm(dim=1)
    assert not torch.allclose(norms, norms[0].expand_as(norms))      # chi-distributed, not all √D
    iid = PerformerFeatures(D, 3 * D, orthogonal=False, seed=5).projection
    assert (iid[:D] @ iid[:D].T - torch.diag((iid[:D] ** 2).sum(1))).abs().max() > 0.1


def test_performer_fixed_between_calls_redraw_and_seed():
    x = _randn(2, 3, 5, D)
    phi = PerformerFeatures(D, 24, seed=7)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    y1, y2 = phi(x), phi(x)
    assert torch.equal(y1, y2)
    assert torch.equal(torch.get_rng_state(), state)                   # the global generator is untouched
    assert torch.equal(PerformerFeatures(D, 24, seed=7)(x), y1)        # same seed, same features
    lazy = PerformerFeatures(num_features=24, seed=7)
    assert lazy.projection is None
    assert torch.equal(lazy(x), y1) and lazy.projection.shape == (24, D)
    W_old = phi.projection.clone()
    assert phi.redraw() is phi and phi.seed == 8
    assert not torch.equal(phi.projection, W_old)
    assert torch.equal(phi.projection, PerformerFeatures(D, 24, seed=8).projection)
    phi.redraw(seed=7)
    assert torch.equal(phi(x), y1)
    assert "projection" in phi.state_dict()


def test_performer_state_dict_round_trip_into_a_lazy_map():
    """A saved projection (e.g. redrawn during training) loads into a fresh map built by name."""
    trained = PerformerFeatures(num_features=24, seed=0)
    x = _randn(2, 1, 5, D)
    trained(x)
    trained.redraw(seed=9)
    fresh = get_feature_map("performer", num_features=24)
    assert fresh.projection is None
    fresh.load_state_dict(trained.state_dict())
    assert torch.equal(fresh(x), trained(x))


def test_performer_default_scale_targets_softmax_kernel():
    """Default scale 1/√D: averaged over 20000 draws (blocks of M = D), φ(q)ᵀφ(k) is within 4 standard
    errors of exp(qᵀk/√D)."""
    n = 20000
    q, k = _randn(6, D, seed=1, scale=0.5), _randn(6, D, seed=2, scale=0.5)
    exact = ((q * k).sum(-1) / math.sqrt(D)).exp()
    phi = PerformerFeatures(D, n * D, seed=0)
    draws = (phi(q) * phi(k) * (n * D)).reshape(6, n, D).mean(-1)
    se = draws.std(1) / math.sqrt(n)
    assert (se < 0.05 * exact).all()
    assert ((draws.mean(1) - exact).abs() <= 4 * se).all(), ((draws.mean(1) - exact) / se)


def test_performer_is_computed_in_log_space():
    """A key of norm 60 (scale 1): exp(Wx) overflows and exp(-|x|²/2) underflows, their product is NaN;
    the features (formed as one exponent) are finite and equal the float64 formula."""
    phi = PerformerFeatures(D, 16, seed=0, scale=1.0)
    x = _randn(4, D, seed=3, dtype=torch.float32)
    x = 60 * x / x.norm(dim=-1, keepdim=True)
    W = phi.projection.float()
    naive = torch.exp(x @ W.T) * torch.exp(-0.5 * (x * x).sum(-1, keepdim=True)) / 4
    assert not torch.isfinite(naive).all()
    y = phi(x)
    assert torch.isfinite(y).all()
    xd = x.double()
    exact = torch.exp(xd @ phi.projection.T - 0.5 * (xd * xd).sum(-1, keepdim=True)) / 4
    torch.testing.assert_close(y.double(), exact, rtol=1e-4, atol=1e-30)


def test_performer_query_stabiliser_is_exact_for_normalised_attention():
    """is_query=True divides each query's features by their maximum: the normalised output is unchanged,
    and queries whose float32 features overflow become usable."""
    phi = PerformerFeatures(D, 32, seed=1)
    q, k, v = (_randn(2, 2, 30, D, seed=20 + s) for s in range(3))
    ref = linattn.linear_attention(q, k, v, feature_map=phi)
    fq = phi(q, is_query=True)
    torch.testing.assert_close(fq.amax(-1), torch.ones_like(fq[..., 0]), rtol=1e-15, atol=0)
    out = linattn.linear_attention(fq, phi(k), v, feature_map=None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    # A query on a projection row of a large head (D = 256): its exponent |ω|²/2 > 88 overflows float32;
    # the stabilised features stay finite and give the float64 answer.
    big = PerformerFeatures(256, 256, seed=0, scale=1.0)
    q32 = big.projection[:1].float().reshape(1, 1, 1, 256).expand(1, 1, 4, 256).contiguous()
    k32, v32 = (_randn(1, 1, 9, 256, seed=30 + s, dtype=torch.float32, scale=0.1) for s in range(2))
    assert not torch.isfinite(big(q32)).all()
    assert not torch.isfinite(linattn.linear_attention(q32, k32, v32, feature_map=big)).all()
    out = linattn.linear_attention(big(q32, is_query=True), big(k32), v32, feature_map=None)
    ref = linattn.linear_attention(q32.double(), k32.double(), v32.double(), feature_map=big)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Taylor (Based)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 1.0, 0.3])
@pytest.mark.parametrize("dim", [1, 3, 8, 16])
def test_taylor_identity_to_float64_precision(scale, dim):
    """φ(q)ᵀφ(k) = 1 + s + s²/2 with s = qᵀk · scale, to float64 rounding.

    Tolerance: 8 ε (1 + a + a²/2) with a = scale · Σ_d |q_d k_d| and ε the float64 machine epsilon,
    the rounding bound of the sums involved (cancellation makes a relative bound on s meaningless).
    """
    q = _randn(200, dim, seed=dim, scale=2.0)
    k = _randn(200, dim, seed=dim + 100, scale=2.0)
    phi = TaylorFeatures(scale)
    s = (q * k).sum(-1) * (scale if scale is not None else 1 / math.sqrt(dim))
    a = (q * k).abs().sum(-1) * (scale if scale is not None else 1 / math.sqrt(dim))
    lhs = (phi(q) * phi(k)).sum(-1)
    rhs = 1 + s + s * s / 2
    bound = 8 * torch.finfo(torch.float64).eps * (1 + a + a * a / 2)
    assert ((lhs - rhs).abs() <= bound).all(), ((lhs - rhs).abs() / bound).max()
    assert phi(q).shape[-1] == 1 + dim + dim * (dim + 1) // 2
    assert (lhs >= 0.5 - 1e-12).all()


def test_taylor_attention_equals_explicit_polynomial_weights():
    q, k, v = (_randn(2, 2, 25, D, seed=40 + s) for s in range(3))
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    a = (1 + s + s * s / 2).tril()
    expected = (a @ v) / a.sum(-1, keepdim=True)
    out = linattn.linear_attention(q, k, v, feature_map=TaylorFeatures(), causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------------------------------
# cosFormer
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,max_len", [(False, None), (False, 100), (True, 100)])
def test_cosformer_similarity_is_relu_times_cosine(causal, max_len):
    q, k, v = (_randn(2, 2, 30, D, seed=50 + s) for s in range(3))
    L = 30 if max_len is None else max_len
    i = torch.arange(30, dtype=torch.float64)
    cos = torch.cos(math.pi / 2 * (i[:, None] - i[None, :]) / L)                 # (T, T)
    a = (F.relu(q) @ F.relu(k).transpose(-1, -2)) * cos
    if causal:
        a = a.tril()
    den = a.sum(-1, keepdim=True)
    expected = (a @ v) / torch.where(den > 0, den, 1e-6)
    phi = CosFormerFeatures(max_len)
    torch.testing.assert_close((phi(q) @ phi(k).transpose(-1, -2)), (F.relu(q) @ F.relu(k).transpose(-1, -2)) * cos,
                               rtol=1e-12, atol=1e-13)
    out = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_cosformer_without_max_len_is_refused_where_it_would_be_wrong():
    q, k, v = (_randn(1, 2, 10, D, seed=50 + s) for s in range(3))
    for fn in (lambda phi: linattn.linear_attention(q, k, v, feature_map=phi, causal=True),
               lambda phi: linattn.retention(q, k, v, 0.9, feature_map=phi),
               lambda phi: linattn.linear_attention(q, k[:, :, :7], v[:, :, :7], feature_map=phi)):
        with pytest.raises(ValueError, match=r"CosFormerFeatures needs a fixed max_len.*max_len=None"):
            fn(CosFormerFeatures())


def test_cosformer_earlier_outputs_do_not_depend_on_the_tokens_after_them():
    """With a fixed max_len, the outputs of a prefix are those of the whole sequence (causal)."""
    phi = CosFormerFeatures(max_len=64)
    q, k, v = (_randn(1, 2, 40, D, seed=60 + s) for s in range(3))
    full = linattn.linear_attention(q, k, v, feature_map=phi, causal=True)
    part = linattn.linear_attention(q[:, :, :23], k[:, :, :23], v[:, :, :23], feature_map=phi, causal=True)
    torch.testing.assert_close(part, full[:, :, :23], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("call", ["linear_attention", "retention", "gated_linear_attention", "delta_rule",
                                  "gated_delta_rule"])
def test_position_dependent_maps_cannot_resume_from_a_state(call):
    """The state does not record how many tokens it has seen: resuming would restart the positions."""
    phi = CosFormerFeatures(max_len=64)
    q, k, v = (_randn(1, 2, 12, D, seed=62 + s) for s in range(3))
    if call == "linear_attention":
        state = linattn.LinearAttentionState(torch.zeros(1, 2, 2 * D, D, dtype=q.dtype), torch.zeros(1, 2, 2 * D, dtype=q.dtype))
        run = lambda: linattn.linear_attention(q, k, v, feature_map=phi, causal=True, initial_state=state)
    else:
        extra = {"retention": (0.9,), "gated_linear_attention": (torch.zeros(1, 2, 12, 2 * D, dtype=q.dtype),),
                 "delta_rule": (torch.full((1, 2, 12), 0.5, dtype=q.dtype),),
                 "gated_delta_rule": (torch.zeros(1, 2, 12, dtype=q.dtype), torch.full((1, 2, 12), 0.5, dtype=q.dtype))}[call]
        S0 = torch.zeros(1, 2, 2 * D, D, dtype=q.dtype)
        run = lambda: getattr(linattn, call)(q, k, v, *extra, feature_map=phi, initial_state=S0)
    with pytest.raises(ValueError, match=r"position-dependent feature_map CosFormerFeatures cannot continue from "
                                         r"initial_state.*offset="):
        run()
    with pytest.raises(ValueError, match=r"linear_attention_step cannot apply the position-dependent"):
        linattn.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], feature_map=phi)


def test_cosformer_streaming_with_max_len():
    """With max_len, a prefix gets the features of the whole sequence, and offset continues it."""
    phi = CosFormerFeatures(max_len=64)
    x = _randn(1, 2, 40, D)
    full = phi(x)
    torch.testing.assert_close(phi(x[:, :, :25]), full[:, :, :25], rtol=0, atol=0)
    torch.testing.assert_close(phi(x[:, :, 25:], offset=25), full[:, :, 25:], rtol=1e-15, atol=1e-15)
    step = phi(x[:, :, 31:32], offset=31)[:, :, 0]                                # one token, decoding
    torch.testing.assert_close(step, full[:, :, 31], rtol=1e-15, atol=1e-15)


# ------------------------------------------------------------------------------------------
# Hedgehog
# ------------------------------------------------------------------------------------------


def test_hedgehog_is_softmax_over_plus_minus_projection():
    h = _trained_hedgehog().double()
    x = _randn(3, 9, D)
    y = x @ h.weight.T + h.bias
    expected = torch.softmax(torch.cat([y, -y], -1), -1)
    torch.testing.assert_close(h(x), expected, rtol=1e-14, atol=1e-15)
    fresh = HedgehogFeatures(D, bias=False)
    assert torch.equal(fresh.weight, torch.eye(D)) and fresh.bias is None
    torch.testing.assert_close(fresh(x), torch.softmax(torch.cat([x, -x], -1), -1), rtol=1e-14, atol=1e-15)
    wide = HedgehogFeatures(D, num_features=12)
    assert wide(x).shape == (3, 9, 24)
    torch.testing.assert_close(wide(x).sum(-1), torch.ones(3, 9, dtype=x.dtype), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_distillation_lowers_the_kl_to_softmax_weights(causal):
    q, k = (_randn(2, 2, 48, D, seed=60 + s, dtype=torch.float32) for s in range(2))
    h = HedgehogFeatures(D)
    history = distill_feature_map(h, q, k, steps=100, lr=0.05, causal=causal)
    assert len(history) == 100 and all(math.isfinite(x) for x in history)
    assert history[-1] < 0.7 * history[0], (history[0], history[-1])
    # the reported loss is the mean KL(softmax row || linear row)
    A = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(
        ~torch.ones(48, 48, dtype=torch.bool).tril() if causal else torch.zeros(48, 48, dtype=torch.bool),
        float("-inf")), -1)
    h0 = HedgehogFeatures(D)
    a = h0(q) @ h0(k).transpose(-1, -2)
    a = (a.tril() if causal else a)
    A_hat = a / a.sum(-1, keepdim=True)
    kl = (A * (A.clamp_min(1e-30).log() - A_hat.clamp_min(1e-30).log())).sum(-1).mean()
    assert abs(history[0] - kl.item()) < 1e-5


# ------------------------------------------------------------------------------------------
# Properties shared by every map
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,causal", MAP_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_batch_coupling(name, causal, dtype):
    """Scaling the keys of one batch element leaves the outputs of every other element bit for bit unchanged
    (a stabilising maximum taken over the whole batch would not)."""
    phi = MAPS[name][0]()
    q, k, v = (_randn(3, 2, 37, D, seed=70 + s, dtype=dtype) for s in range(3))
    before = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal)
    k2 = k.clone()
    k2[0] *= 25.0
    after = linattn.linear_attention(q, k2, v, feature_map=phi, causal=causal)
    assert torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0], after[0])


@pytest.mark.parametrize("name", CAUSAL_MAPS)
@pytest.mark.parametrize("method", ["chunk", "recurrent", "quadratic"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_no_future_leakage(name, method, dtype):
    """In causal attention, changing the keys and values after position t leaves outputs up to t bit for bit
    unchanged (a stabiliser computed over the whole sequence would not)."""
    phi = MAPS[name][0]()
    T, t = 48, 29
    q, k, v = (_randn(2, 2, T, D, seed=80 + s, dtype=dtype) for s in range(3))
    before = linattn.linear_attention(q, k, v, feature_map=phi, causal=True, method=method, chunk_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1:] = 20.0 * _randn(2, 2, T - t - 1, D, seed=99, dtype=dtype)
    v2[:, :, t + 1:] = -v2[:, :, t + 1:] * 7
    after = linattn.linear_attention(q, k2, v2, feature_map=phi, causal=True, method=method, chunk_size=16)
    assert torch.equal(before[:, :, :t + 1], after[:, :, :t + 1])
    assert not torch.equal(before[:, :, t + 1:], after[:, :, t + 1:])


def _global_max_performer(phi):
    """The bug the two tests above guard against: one stabilising maximum over every token of the batch."""
    def features(x):
        xs = x * phi.scale ** 0.5 if phi.scale else x / D ** 0.25
        log_phi = xs @ phi.projection.to(x.dtype).T - 0.5 * (xs * xs).sum(-1, keepdim=True)
        return torch.exp(log_phi - log_phi.amax()) / math.sqrt(phi.projection.shape[0])
    return features


def test_the_property_tests_catch_a_global_stabiliser():
    """A key on a projection row has the largest possible exponent; under one maximum over the whole
    tensor it shifts every other token's features, in other batch elements and at earlier positions."""
    perf = PerformerFeatures(D, 32, seed=3)
    bad = _global_max_performer(perf)
    q, k, v = (_randn(3, 2, 48, D, seed=70 + s) for s in range(3))
    W = perf.projection
    spike = W[W.norm(dim=1).argmax()] * D ** 0.25                    # x̃ = ω: exponent |ω|²/2, the largest
    out = linattn.linear_attention(q, k, v, feature_map=bad, causal=True)
    k2 = k.clone()
    k2[0, :, 5] = spike
    assert not torch.equal(out[1:], linattn.linear_attention(q, k2, v, feature_map=bad, causal=True)[1:])
    k3 = k.clone()
    k3[:, :, 40] = spike
    assert not torch.equal(out[:, :, :40], linattn.linear_attention(q, k3, v, feature_map=bad, causal=True)[:, :, :40])
    good = [linattn.linear_attention(q, kk, v, feature_map=perf, causal=True) for kk in (k, k2, k3)]
    assert torch.equal(good[0][1:], good[1][1:]) and torch.equal(good[0][:, :, :40], good[2][:, :, :40])


@pytest.mark.parametrize("name", list(MAPS))
def test_float16_inputs_give_finite_outputs_at_T_4096(name):
    phi = MAPS[name][0]()
    q, k, v = (_randn(1, 2, 4096, D, seed=90 + s, dtype=torch.float16) for s in range(3))
    for causal in (False, True) if name in CAUSAL_MAPS else (False,):
        out = linattn.linear_attention(q, k, v, feature_map=phi, causal=causal)
        assert out.dtype == torch.float16 and torch.isfinite(out).all(), (name, causal)


@pytest.mark.parametrize("name", ["performer", "taylor", "dpfp", "cosformer_maxlen", "hedgehog"])
def test_gradients_match_finite_differences(name):
    phi = MAPS[name][0]().double() if name in ("performer", "hedgehog") else MAPS[name][0]()
    q, k, v = (_randn(1, 1, 6, D, seed=95 + s, scale=0.5).requires_grad_() for s in range(3))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linattn.linear_attention(q, k, v, feature_map=phi, causal=True), (q, k, v))


# ------------------------------------------------------------------------------------------
# Argument errors: they name the argument and show what was given and what was expected
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build,err,pattern", [
    (lambda: DPFPFeatures(nu=0), ValueError, r"nu must be >= 1, got 0"),
    (lambda: DPFPFeatures(nu=1.5), TypeError, r"nu must be an int, got float"),
    (lambda: PerformerFeatures(head_dim=0), ValueError, r"head_dim must be >= 1, got 0"),
    (lambda: PerformerFeatures(8, num_features=-3), ValueError, r"num_features must be >= 1, got -3"),
    (lambda: PerformerFeatures(8, 16.0), TypeError, r"num_features must be an int, got float"),
    (lambda: PerformerFeatures(8, orthogonal=1), TypeError, r"orthogonal must be a bool, got int"),
    (lambda: PerformerFeatures(8, seed=-1), ValueError, r"seed must be >= 0, got -1"),
    (lambda: PerformerFeatures(8, scale=0.0), ValueError, r"scale must be a positive finite number, got 0.0"),
    (lambda: PerformerFeatures(8, scale="1"), TypeError, r"scale must be a float, got str"),
    (lambda: PerformerFeatures(8).redraw(seed=2.0), TypeError, r"seed must be an int, got float"),
    (lambda: TaylorFeatures(scale=float("inf")), ValueError, r"scale must be a positive finite number, got inf"),
    (lambda: HedgehogFeatures(True), TypeError, r"head_dim must be an int, got bool"),
    (lambda: HedgehogFeatures(8, num_features=0), ValueError, r"num_features must be >= 1, got 0"),
    (lambda: HedgehogFeatures(8, bias=None), TypeError, r"bias must be a bool, got NoneType"),
    (lambda: CosFormerFeatures(max_len=0), ValueError, r"max_len must be >= 1, got 0"),
    (lambda: get_feature_map("performer", heads=3), TypeError, r"'performer'.*heads"),
    (lambda: get_feature_map("squared_relu", scale=2), TypeError, r"'squared_relu' takes no options.*scale"),
    (lambda: get_feature_map("cosine"), ValueError, r"unknown feature_map 'cosine'.*'taylor'"),
])
def test_constructor_errors(build, err, pattern):
    with pytest.raises(err, match=pattern):
        build()


@pytest.mark.parametrize("phi,x,err,pattern", [
    (PerformerFeatures(8), torch.randn(2, 5, 6), ValueError, r"head_dim 8.*\(2, 5, 6\).*last dim 6"),
    (PerformerFeatures(8), torch.randint(0, 3, (2, 8)), TypeError, r"x must be a floating-point tensor, got dtype torch.int64"),
    (HedgehogFeatures(8), torch.randn(2, 5, 6), ValueError, r"expects x of shape \(\.\.\., 8\), got \(2, 5, 6\)"),
    (TaylorFeatures(), [1.0, 2.0], TypeError, r"x must be a torch.Tensor, got list"),
    (CosFormerFeatures(), torch.randn(2, 5, 8), ValueError, r"\(batch, heads, seq, dim\).*got \(2, 5, 8\)"),
    (CosFormerFeatures(max_len=10), torch.randn(1, 1, 11, 8), ValueError, r"offset \+ T = 0 \+ 11 exceed max_len = 10"),
    (DPFPFeatures(), torch.ones(3, dtype=torch.bool), TypeError, r"x must be a floating-point tensor, got dtype torch.bool"),
])
def test_call_errors(phi, x, err, pattern):
    with pytest.raises(err, match=pattern):
        phi(x)


def test_call_option_errors():
    with pytest.raises(TypeError, match=r"is_query must be a bool, got int"):
        PerformerFeatures(8)(torch.randn(2, 8), is_query=1)
    with pytest.raises(ValueError, match=r"offset must be >= 0, got -2"):
        CosFormerFeatures()(torch.randn(1, 1, 4, 8), offset=-2)


def test_distill_errors():
    q = torch.randn(1, 1, 5, 4)
    with pytest.raises(TypeError, match=r"feature_map must be an nn.Module with trainable parameters, got function"):
        distill_feature_map(linattn.elu_plus_one, q, q)
    with pytest.raises(TypeError, match=r"trainable parameters, got TaylorFeatures"):
        distill_feature_map(TaylorFeatures(), q, q)
    h = HedgehogFeatures(4)
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, heads, seq, dim\), got \(5, 4\)"):
        distill_feature_map(h, q[0, 0], q)
    with pytest.raises(ValueError, match=r"same shape, got q \(1, 1, 5, 4\) and k \(1, 1, 6, 4\)"):
        distill_feature_map(h, q, torch.randn(1, 1, 6, 4))
    with pytest.raises(ValueError, match=r"steps must be >= 1, got 0"):
        distill_feature_map(h, q, q, steps=0)
    with pytest.raises(ValueError, match=r"lr must be a positive finite number, got -1"):
        distill_feature_map(h, q, q, lr=-1)
    with pytest.raises(TypeError, match=r"causal must be a bool, got str"):
        distill_feature_map(h, q, q, causal="yes")


# ------------------------------------------------------------------------------------------
# Hedgehog's start: the identity where it exists, random rows elsewhere
# ------------------------------------------------------------------------------------------


def test_hedgehog_identity_init_draws_the_rows_beyond_the_identity():
    wide = HedgehogFeatures(D, num_features=3 * D)
    assert torch.equal(wide.weight[:D], torch.eye(D))
    extra = wide.weight[D:].double()
    assert extra.abs().min() > 0                                         # no zero row, no zero entry
    assert abs(extra.pow(2).sum(-1).mean().item() - 1.0) < 0.35          # N(0, 1/D) entries: rows of norm ~1
    again = HedgehogFeatures(D, num_features=3 * D)
    assert torch.equal(wide.weight, again.weight)                        # counter-based: deterministic
    other = HedgehogFeatures(D, num_features=3 * D, seed=1)
    assert torch.equal(other.weight[:D], torch.eye(D)) and not torch.equal(other.weight[D:], wide.weight[D:])
    narrow = HedgehogFeatures(D, num_features=D // 2)
    assert torch.equal(narrow.weight, torch.eye(D // 2, D))


def test_hedgehog_zero_rows_would_get_no_gradient_and_drawn_rows_do():
    """The reason for the random rows: a zero row is a stationary point of any loss of the weights."""
    q, k = (_randn(1, 2, 24, D, seed=70 + s) for s in range(2))
    for zero_rows, expect_zero in ((True, True), (False, False)):
        h = HedgehogFeatures(D, num_features=2 * D).double()
        if zero_rows:
            with torch.no_grad():
                h.weight[D:] = 0.0
        A = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
        a = h(q) @ h(k).transpose(-1, -2)
        loss = -(A * (a / a.sum(-1, keepdim=True)).log()).sum(-1).mean()
        loss.backward()
        extra_grad = h.weight.grad[D:].abs().max().item()
        assert (extra_grad < 1e-15) == expect_zero, extra_grad


def test_hedgehog_random_init_and_bad_init():
    h = HedgehogFeatures(D, init="random", seed=5)
    assert not torch.equal(h.weight, torch.eye(D)) and h.weight.abs().min() > 0
    assert "init='random'" in repr(h) and "seed=5" in repr(h)
    with pytest.raises(ValueError, match=r"init must be one of \('identity', 'random'\), got 'eye'"):
        HedgehogFeatures(D, init="eye")
    with pytest.raises(TypeError, match=r"init must be a str"):
        HedgehogFeatures(D, init=None)
    with pytest.raises(ValueError, match=r"seed must be >= 0"):
        HedgehogFeatures(D, seed=-1)


def test_elu_plus_one_gradient_is_min_phi_one_and_its_second_derivative_is_exact():
    # first derivative: 1 for x > 0, e^x for x <= 0, bit for bit; second: 0 for x > 0, also where
    # 1 + x rounds to 1 in float32 (x = 1e-9), e^x for x <= 0
    x = torch.tensor([-30.0, -2.0, -1e-9, 0.0, 1e-9, 0.5, 40.0], requires_grad=True)
    (g,) = torch.autograd.grad(linattn.elu_plus_one(x).sum(), x, create_graph=True)
    ref = torch.where(x.detach() > 0, torch.ones_like(x), torch.exp(x.detach()))
    assert torch.equal(g.detach(), ref)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert torch.equal(h, torch.where(x.detach() > 0, torch.zeros_like(x), torch.exp(x.detach())))
    (g1,) = torch.autograd.grad(linattn.elu_plus_one(x).sum(), x)           # the two-pass path
    assert torch.equal(g1, ref)
