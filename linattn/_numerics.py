"""Numerical building blocks shared by the attention algorithms (private).

- :func:`no_autocast`: linattn chooses its own precision (float32 accumulation for half
  inputs, float64 for float64), so its arithmetic runs with ``torch.autocast`` switched off;
  otherwise autocast would turn some of its matmuls into bfloat16 ones and mix dtypes.
- :func:`masked_matmul`: ``A @ X`` for an ``A`` that is zero outside a causal pattern, such
  that a non-finite entry of ``X`` only reaches the outputs that are allowed to see it (a
  plain matmul forms ``0 · NaN = NaN`` in every row).
- :func:`guarded_normaliser`: the normaliser of linear attention, replaced by ``eps`` only
  where it is zero, negative or not finite (never clamped from below).
- :class:`CausalPoison`: the chunk forms' way of keeping non-finite inputs causal: compute on
  inputs whose non-finite entries are replaced by 0, then set to NaN exactly the outputs (and
  state entries) that depend on a non-finite input.
- :func:`compiling`: whether ``torch.compile`` is tracing the caller.
- :data:`LOG_G_FLOOR`: the floor of every log-gate the gated chunk forms use.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["no_autocast", "masked_matmul", "compiling", "all_finite", "host_all", "unwrap", "guarded_normaliser",
           "divide_by_normaliser", "safe_normaliser", "CausalPoison", "LOG_G_FLOOR"]


def no_autocast(device) -> contextlib.AbstractContextManager:
    """A context in which autocast is off for ``device``'s type (a no-op where autocast does not exist).

    ``device`` is a ``torch.device`` or a tensor (its device).
    """
    device_type = device.device.type if isinstance(device, Tensor) else device.type
    if device_type == "cpu" and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling():
        return contextlib.nullcontext()               # nothing to switch off (the common case, cheaply)
    available = getattr(torch.amp, "is_autocast_available", None)     # torch >= 2.4
    if not (available(device_type) if available else device_type in ("cpu", "cuda")):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def compiling() -> bool:
    """True while ``torch.compile`` (dynamo) traces the calling code."""
    return torch.compiler.is_compiling()


def unwrap(t: Tensor) -> Tensor:
    """The plain tensor under ``torch.func`` wrappers (vmap's batched tensors, grad's tracking tensors).

    A Python ``if`` on tensor data is refused under ``vmap``; on the unwrapped tensor, which
    holds the values of every vmapped element, it is allowed, and a check of "all entries"
    then checks every element at once.
    """
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def host_all(t: Tensor) -> bool:
    """Whether every entry of the bool tensor ``t`` is True, also under ``torch.func`` transforms
    (for every vmapped element)."""
    return bool(unwrap(t).all())


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of every tensor is finite (one host synchronisation for all of them).

    Tensors on the "meta" device hold no values and count as finite.
    """
    # detach(): isfinite is composite (abs, eq), and abs would record its input for a backward
    # that never comes (a transient copy of the reference autograd counts as saved)
    flags = [torch.isfinite(t.detach()).all() for t in tensors if t is not None and t.device.type != "meta"]
    return host_all(torch.stack(flags)) if flags else True


def masked_matmul(A: Tensor, X: Tensor, allowed: Tensor) -> Tensor:
    """``A @ X`` where output ``i`` depends only on the rows ``j`` of ``X`` with ``allowed[i, j]``.

    ``A`` (..., I, J) is zero wherever ``allowed`` (I, J) (0/1, or broadcastable to ``A``) is 0.
    A plain matmul still multiplies those zeros with ``X``: a NaN or infinity in row ``j`` of
    ``X`` then turns every output row into NaN, also the rows that must not see row ``j`` (in
    causal attention: the earlier tokens). Here non-finite entries of ``X`` are replaced by 0
    for the product, and each output entry ``(i, d)`` that does see a non-finite ``X[j, d]``
    (some allowed ``j``) is set to NaN: it depends on a non-finite input. The test "does it
    see one" is itself a matmul of 0/1 matrices, exact in floating point.
    """
    bad = ~torch.isfinite(X)                                      # (..., J, D)
    out = A @ X.masked_fill(bad, 0.0)                             # (..., I, D)
    seen = allowed.to(X.dtype) @ bad.to(X.dtype)                  # (..., I, D): bad entries each output sees
    return out.masked_fill(seen > 0, float("nan"))


def guarded_normaliser(den: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The normaliser to divide by, and where it is used as computed.

    A positive finite normaliser is used as it is, however small: the output is then the
    exact weighted average ``Σ_j a_ij v_j / Σ_j a_ij`` (a lower bound such as
    ``max(den, eps)`` would instead return ``num / eps``, a wrong number, whenever the
    normaliser is small but positive). Only a normaliser that is zero, negative or not
    finite is replaced by ``eps``: zero happens with non-negative maps such as ReLU (and then
    the numerator is zero too: the output is 0); negative only with feature maps that take
    negative values, for which normalised linear attention has no meaning; NaN or infinite
    only with non-finite inputs or features. Returns ``(den_used, ok)``, ``ok`` True where
    ``den`` itself is used.
    """
    ok = (den > 0) & (den < float("inf"))
    return torch.where(ok, den, eps), ok


def safe_normaliser(den: Tensor, eps: float) -> Tensor:
    """The first result of :func:`guarded_normaliser` in three operations: ``den`` where it is positive and
    finite, else ``eps`` (``where`` sends zero, negatives and NaN to ``eps``, ``nan_to_num_`` then ``+inf``)."""
    return torch.where(den > 0, den, eps).nan_to_num_(posinf=eps)


def divide_by_normaliser(out_aug: Tensor, normalize: bool, eps: float) -> Tensor:
    """Split ``(..., Dv + 1)`` into numerator and normaliser and divide (or return the numerator).

    The normaliser is used as computed unless it is zero, negative or not finite
    (:func:`guarded_normaliser`).
    """
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    if not normalize:
        return num
    return num / safe_normaliser(den, eps)


class CausalPoison:
    """Non-finite inputs of a causal computation, made harmless for the positions before them.

    A chunked causal computation multiplies the zeros of its causal masks with later tokens'
    keys and values: a NaN or infinity there (``0 · NaN = NaN``) would reach earlier positions.
    So the computation runs on inputs whose non-finite entries are replaced by 0 (the sanitised
    ``q``, ``k``, ``v`` below), which are then exactly the inputs of the positions before the
    first bad one: those positions get bit for bit the outputs they would get if the later
    positions held finite values. Afterwards every output that depends on a non-finite input is
    set to NaN (:meth:`outputs`), and so is every state entry (:meth:`state`).

    Dependence, for every update of this package (each value column of the state evolves on its
    own, keys act on all columns): output ``(t, d)`` depends on ``q_t``, on every ``k_s`` and on
    ``v_s[d]`` for ``s <= t``; state column ``d`` on every ``k_s`` and ``v_s[d]``; the normaliser
    ``z`` of linear attention on every ``k_s``.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, Dk)`` features of queries and keys.
    v : Tensor
        ``(B, H, T, Dv)`` values.
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        bad_q, bad_k, bad_v = ~torch.isfinite(q), ~torch.isfinite(k), ~torch.isfinite(v)
        self.q, self.k, self.v = q.masked_fill(bad_q, 0.0), k.masked_fill(bad_k, 0.0), v.masked_fill(bad_v, 0.0)
        bad_key = bad_k.any(-1, keepdim=True)                                    # (B, H, T, 1)
        seen = (bad_key | bad_v).to(torch.int32).cumsum(dim=2) > 0               # (B, H, T, Dv): some s <= t
        self._out = seen | bad_q.any(-1, keepdim=True)                           # (B, H, T, Dv)
        self._state = seen[:, :, -1:]                                            # (B, H, 1, Dv): columns of S
        self._z = bad_key.any(dim=2)                                             # (B, H, 1): all of z

    def outputs(self, out: Tensor) -> Tensor:
        """``(B, H, T, Dv)`` outputs with NaN where they depend on a non-finite input."""
        return out.masked_fill(self._out, float("nan"))

    def state(self, S: Tensor) -> Tensor:
        """``(B, H, Dk, Dv)`` state with NaN in the columns that saw a non-finite value or key."""
        return S.masked_fill(self._state, float("nan"))

    def normaliser(self, z: Tensor) -> Tensor:
        """``(B, H, Dk)`` normaliser state, all NaN if any key was non-finite."""
        return z.masked_fill(self._z, float("nan"))


# The gated chunk forms clamp log-gates from below at this value before using them. Without
# the clamp, float32 sums of accepted log-gates such as -1e38 overflow to -inf (the scalar
# gates' range sums), and -inf · 0 = NaN in a masked product. Why -1000:
# - exp(-1000) is exactly 0 in float32 (exp underflows to 0 below about -103.97, subnormals
#   included) and in float64 (below about -745.13), the two dtypes the chunk forms compute in.
#   Every factor is exp of a sum of non-positive log-gates, or a product of such exps, and
#   rounding is monotone, so a range that holds a clamped entry has the factor exactly 0
#   with or without the clamp. The result is bit-identical to the unclamped computation whenever
#   that one did not overflow, i.e. for every realistic input.
# - A sum of C entries >= -1000 is >= -1000·C, finite in float32 for any C < 3.4e35: no
#   chunk length can overflow it.
# - Below the clamp the gradient of log_g is exactly 0 (clamp passes none), as it is in the
#   recurrent form, where d exp(log_g)/d log_g = exp(log_g) underflows to 0 as well.
LOG_G_FLOOR = -1000.0
