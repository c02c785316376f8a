"""The decay ops called one way for the tests of grouped heads, packed batches, masks and scale.

``inputs(op, ...)`` builds float64 leaves (q, k with H heads; v, gates, β and the state with HV = r·H
heads); ``call(op, x, **kwargs)`` runs the op on them, any tensor replaced by a keyword of the same
name. The delta rules get L2-normalised keys (as their papers and the layers use them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import linattn

OPS = ("retention", "gla", "delta", "gated_delta", "kda")
PER_TOKEN = {"retention": (), "gla": ("log_g",), "delta": ("beta",), "gated_delta": ("log_g", "beta"),
             "kda": ("log_g", "beta")}


def inputs(op, B=2, H=2, r=1, T=20, D=6, Dv=4, *, seed=0, dtype=torch.float64, states=None, strong=False):
    """A dict of leaves that require grad: q, k ``(B, H, T, D)``, v ``(B, HV, T, Dv)``, the op's gates and β
    ``(B, HV, T[, D])`` (retention: gamma ``(HV,)``), and ``S0`` ``(states or B, HV, D, Dv)``."""
    g = torch.Generator().manual_seed(seed)
    HV = H * r

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def uniform(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    depth = 8.0 if strong else 0.5
    x = dict(q=rand(B, H, T, D), k=rand(B, H, T, D), v=rand(B, HV, T, Dv), S0=rand(states or B, HV, D, Dv))
    if op != "retention" and op != "gla":
        x["k"] = F.normalize(x["k"], dim=-1)
    if op == "retention":
        x["gamma"] = 0.5 + 0.5 * uniform(HV)
    if op in ("gla", "kda"):
        x["log_g"] = -depth * uniform(B, HV, T, D)
    if op == "gated_delta":
        x["log_g"] = -depth * uniform(B, HV, T)
    if op in ("delta", "gated_delta", "kda"):
        x["beta"] = 2 * uniform(B, HV, T)
    return {name: t.to(dtype).requires_grad_() for name, t in x.items()}


def call(op, x, **kwargs):
    """``op`` on the tensors of ``x`` (a keyword named like one of them replaces it; ``S0=None`` drops the state)."""
    t = {**x, **{name: kwargs.pop(name) for name in list(kwargs) if name in x or name == "S0"}}
    kwargs.setdefault("return_state", True)
    if t.get("S0") is not None:
        kwargs.setdefault("initial_state", t["S0"])
    q, k, v = t["q"], t["k"], t["v"]
    if op == "retention":
        return linattn.retention(q, k, v, t["gamma"], **kwargs)
    if op == "gla":
        return linattn.gated_linear_attention(q, k, v, t["log_g"], **kwargs)
    if op == "delta":
        return linattn.delta_rule(q, k, v, t["beta"], **kwargs)
    return linattn.gated_delta_rule(q, k, v, t["log_g"], t["beta"], **kwargs)


def loss_and_grads(out, S, leaves: dict, seed=1):
    """The gradients of a fixed random linear function of ``out`` and ``S`` for every leaf (zeros where unused)."""
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    if S is not None:
        loss = loss + (S * torch.randn(S.shape, generator=g, dtype=S.dtype)).sum()
    names = [n for n, t in leaves.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return {n: torch.zeros_like(leaves[n]) if d is None else d for n, d in zip(names, grads)}


def assert_same_values_and_grads(out, S, ref_out, ref_S, leaves: dict, **tol):
    """``out``, ``S`` and every leaf's gradient (:func:`loss_and_grads`) equal the reference call's; returns both
    gradient dicts."""
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(S, ref_S, **tol)
    grads, ref_grads = loss_and_grads(out, S, leaves), loss_and_grads(ref_out, ref_S, leaves)
    for name in leaves:
        torch.testing.assert_close(grads[name], ref_grads[name], **tol, msg=lambda m: f"d{name}: {m}")
    return grads, ref_grads
