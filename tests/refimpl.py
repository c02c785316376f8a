"""Independent float64 references for the tests (written from the API contract, not from linattn).

Nothing here imports linattn: these are the definitions the package is checked against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CAUSAL_METHODS = ("quadratic", "recurrent", "chunk", "auto")
NONCAUSAL_METHODS = ("parallel", "quadratic", "auto")
ALL_METHODS = ("parallel", "quadratic", "recurrent", "chunk", "auto")


def methods_for(causal: bool) -> tuple[str, ...]:
    return CAUSAL_METHODS if causal else NONCAUSAL_METHODS


def ref_phi(feature_map, x: torch.Tensor) -> torch.Tensor:
    """The feature map phi, by name / callable / None, applied to x."""
    if feature_map is None:
        return x
    if callable(feature_map):
        return feature_map(x)
    if feature_map == "elu+1":
        return F.elu(x) + 1.0
    if feature_map == "relu":
        return F.relu(x)
    raise AssertionError(f"no reference for feature map {feature_map!r}")


def ref_normaliser(den, eps):
    """The normaliser divided by: den itself where it is positive and finite, else eps."""
    ok = (den > 0) & torch.isfinite(den)
    return torch.where(ok, den, torch.full_like(den, eps))


def ref_linear_attention(
    q,
    k,
    v,
    *,
    feature_map="elu+1",
    causal=False,
    normalize=True,
    eps=1e-6,
    attention_mask=None,
    initial_state=None,
):
    """The masked quadratic form, computed in float64 (differentiable).

    For query i: num_i = sum_j a_ij v_j (+ phi(q_i)^T S0), den_i = sum_j a_ij (+ phi(q_i).z0),
    a_ij = phi(q_i).phi(k_j) over visible j (j <= i if causal, and unmasked);
    out = num / den if normalize else num, where den is replaced by eps only if it is zero,
    negative or not finite (ref_normaliser).

    Returns (out, S, z): S, z the state after all keys (masked keys excluded).
    """
    q, k, v = q.double(), k.double(), v.double()
    fq, fk = ref_phi(feature_map, q), ref_phi(feature_map, k)
    B, H, Tq, _ = fq.shape
    Tk = fk.shape[-2]
    a = fq @ fk.transpose(-1, -2)  # (B,H,Tq,Tk)
    visible = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        assert Tq == Tk
        visible = visible & torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
    keymask = torch.ones(B, Tk, dtype=torch.bool, device=q.device)
    if attention_mask is not None:
        keymask = attention_mask.bool()
        visible = visible & keymask[:, None, None, :]
    a = torch.where(visible, a, torch.zeros((), dtype=a.dtype))
    num = a @ v
    den = a.sum(-1)
    fk_masked = torch.where(keymask[:, None, :, None], fk, torch.zeros((), dtype=fk.dtype))
    S = fk_masked.transpose(-1, -2) @ v  # (B,H,M,Dv)
    z = fk_masked.sum(-2)  # (B,H,M)
    if initial_state is not None:
        S0, z0 = initial_state
        S0, z0 = S0.double(), z0.double()
        num = num + fq @ S0
        den = den + (fq * z0[:, :, None, :]).sum(-1)
        S = S + S0
        z = z + z0
    out = num / ref_normaliser(den, eps)[..., None] if normalize else num
    return out, S, z


def ref_linear_attention_big_noncausal(q, k, v, *, feature_map="elu+1", eps=1e-6):
    """Non-causal normalised linear attention by the associative form, in float64 (for long T)."""
    q, k, v = q.double(), k.double(), v.double()
    fq, fk = ref_phi(feature_map, q), ref_phi(feature_map, k)
    kv = fk.transpose(-1, -2) @ v
    z = fk.sum(-2)
    return (fq @ kv) / ref_normaliser(fq @ z[..., None], eps)


def ref_linear_attention_big_causal(q, k, v, *, feature_map="elu+1", eps=1e-6):
    """Causal normalised linear attention by prefix sums, in float64 (for long T)."""
    q, k, v = q.double(), k.double(), v.double()
    fq, fk = ref_phi(feature_map, q), ref_phi(feature_map, k)
    S = torch.cumsum(fk[..., :, None] * v[..., None, :], dim=-3)  # (B,H,T,M,Dv)
    z = torch.cumsum(fk, dim=-2)
    num = torch.einsum("bhtm,bhtmv->bhtv", fq, S)
    den = (fq * z).sum(-1)
    return num / ref_normaliser(den, eps)[..., None]


def ref_softmax_attention(q, k, v, *, causal=False, scale=None, attention_mask=None):
    """Softmax attention in float64; query rows with no visible key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    B, H, Tq, Tk = s.shape
    visible = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
    if causal:
        visible = visible & torch.ones(Tq, Tk, dtype=torch.bool).tril()
    if attention_mask is not None:
        visible = visible & attention_mask.bool()[:, None, None, :]
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(s - m)  # exp(-inf) = 0 for hidden keys
    den = w.sum(-1, keepdim=True)
    p = torch.where(den > 0, w / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(w))
    return p @ v


def rand_qkv(B, H, Tq, D, Dv, *, Tk=None, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    Tk = Tq if Tk is None else Tk
    q = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, Tk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, H, Tk, Dv, generator=g, dtype=torch.float64).to(dtype)
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def grads(out, inputs, upstream):
    """Gradients of sum(out * upstream) w.r.t. inputs (None where unused)."""
    return torch.autograd.grad((out * upstream).sum(), inputs, allow_unused=True)
