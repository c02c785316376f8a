"""Fitting a learned feature map to softmax attention's weights (Hedgehog's distillation)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .._checks import check_floating, check_int_at_least, check_positive_finite, check_strict_bool, shape_str

__all__ = ['distill_feature_map']


def distill_feature_map(feature_map: nn.Module, q: Tensor, k: Tensor, *, steps: int = 200,
                        lr: float = 1e-2, scale: Optional[float] = None, causal: bool = False
                        ) -> list[float]:
    """Fit a learnable feature map so that linear attention's weights mimic softmax's.

    Parameters
    ----------
    feature_map : nn.Module
        A map with trainable parameters, e.g. :class:`HedgehogFeatures`; trained in place.
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys to fit on (floating, same shape); not trained.
    steps : int
        Adam steps (full batch).
    lr : float
        Adam's learning rate.
    scale : float, optional
        Softmax temperature; default ``1/√D``.
    causal : bool
        Fit the causal weights (query ``i`` sees keys ``j <= i``).

    Returns
    -------
    list of float
        The loss (mean KL, nats) before each step, ``steps`` values.

    Raises
    ------
    TypeError
        A map without trainable parameters, non-tensor or non-floating inputs, non-int
        ``steps``, non-numeric ``lr`` or ``scale``, non-bool ``causal``.
    ValueError
        ``q`` or ``k`` not 4-D or of different shapes; ``steps < 1``, ``lr <= 0``, ``scale <= 0``.
    """
    params = [p for p in feature_map.parameters() if p.requires_grad] if isinstance(feature_map, nn.Module) else []
    if not params:
        raise TypeError(f"feature_map must be an nn.Module with trainable parameters, got {type(feature_map).__name__}")
    for name, x in (("q", q), ("k", k)):
        check_floating(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, dim), got {shape_str(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q {shape_str(q.shape)} and k {shape_str(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have one dtype, got q {q.dtype} and k {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got q on {q.device} and k on {k.device}")
    steps = check_int_at_least(steps, "steps", minimum=1)
    lr = check_positive_finite(lr, "lr")
    if scale is not None:
        scale = check_positive_finite(scale, "scale")
    check_strict_bool(causal, "causal")
    # Under torch.inference_mode() inputs are inference tensors and autograd is off: train on
    # ordinary copies made outside inference mode.
    # Half inputs are fitted in float32: in float16 the 1e-30 floor of the logarithms rounds to 0.
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.inference_mode(False), torch.enable_grad():
        q, k = q.detach().to(acc, copy=True), k.detach().to(acc, copy=True)
        target = _softmax_weights(q, k, scale, causal)                              # (B, H, T, T)
        entropy = -(target * target.clamp_min(1e-30).log()).sum(-1).mean()
        opt = torch.optim.Adam(params, lr=lr)
        history = []
        for _ in range(steps):
            weights = _kernel_weights(feature_map(q).to(acc), feature_map(k).to(acc), causal)  # (B, H, T, T)
            cross_entropy = -(target * weights.clamp_min(1e-30).log()).sum(-1).mean()
            history.append(float(cross_entropy.detach() - entropy))
            opt.zero_grad()
            cross_entropy.backward()
            opt.step()
    return history


def _softmax_weights(q: Tensor, k: Tensor, scale: Optional[float], causal: bool) -> Tensor:
    """``softmax(QKᵀ · scale)`` rows, causally masked if asked: (B, H, Tq, Tk)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _kernel_weights(phi_q: Tensor, phi_k: Tensor, causal: bool) -> Tensor:
    """``φ(q_i)ᵀφ(k_j)`` normalised over ``j`` (causally masked if asked): (B, H, Tq, Tk)."""
    a = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        a = a.tril()
    return a / a.sum(-1, keepdim=True).clamp_min(1e-30)
