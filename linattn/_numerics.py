"""Numerical building blocks shared by the attention algorithms (private)."""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["no_autocast", "masked_matmul", "compiling", "all_finite", "host_all", "unwrap", "guarded_normaliser",
           "divide_by_normaliser", "safe_normaliser", "CausalPoison", "LOG_G_FLOOR"]


def no_autocast(device) -> contextlib.AbstractContextManager:
    """A context in which autocast is off for ``device``'s type (a no-op where autocast does not exist)."""
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
    """The plain tensor under ``torch.func`` wrappers (vmap's batched tensors, grad's tracking tensors)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def has_values(t: Tensor) -> bool:
    """Whether ``t`` holds numbers that can be read: False for meta tensors and for the fake tensors of
    ``FakeTensorMode`` (``torch.export``, shape propagation), whose values checks must skip."""
    if t.device.type == "meta":
        return False
    if compiling():                          # under torch.compile the checks run inside the graph
        return True
    fake = getattr(torch._subclasses, "FakeTensor", None)
    return fake is None or not isinstance(unwrap(t), fake)


def host_all(t: Tensor) -> bool:
    """Whether every entry of the bool tensor ``t`` is True, also under ``torch.func`` transforms
    (for every vmapped element)."""
    return bool(unwrap(t).all())


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of every tensor is finite (one host synchronisation for all of them)."""
    # detach(): isfinite is composite (abs, eq), and abs would record its input for a backward
    # that never comes (a transient copy of the reference autograd counts as saved)
    flags = [torch.isfinite(t.detach()).all() for t in tensors if t is not None and has_values(t)]
    return host_all(torch.stack(flags)) if flags else True


def masked_matmul(A: Tensor, X: Tensor, allowed: Tensor) -> Tensor:
    """``A @ X`` where output ``i`` depends only on the rows ``j`` of ``X`` with ``allowed[i, j]``."""
    bad = ~torch.isfinite(X)                                      # (..., J, D)
    out = A @ X.masked_fill(bad, 0.0)                             # (..., I, D)
    seen = allowed.to(X.dtype) @ bad.to(X.dtype)                  # (..., I, D): bad entries each output sees
    return out.masked_fill(seen > 0, float("nan"))


def guarded_normaliser(den: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The normaliser to divide by, and where it is used as computed."""
    ok = (den > 0) & (den < float("inf"))
    return torch.where(ok, den, eps), ok


def safe_normaliser(den: Tensor, eps: float) -> Tensor:
    """The first result of :func:`guarded_normaliser` in three operations: ``den`` where it is positive and
    finite, else ``eps`` (``where`` sends zero, negatives and NaN to ``eps``, ``nan_to_num_`` then ``+inf``)."""
    return torch.where(den > 0, den, eps).nan_to_num_(posinf=eps)


def divide_by_normaliser(out_aug: Tensor, normalize: bool, eps: float) -> Tensor:
    """Split ``(..., Dv + 1)`` into numerator and normaliser and divide (or return the numerator)."""
    num, den = out_aug[..., :-1], out_aug[..., -1:]
    if not normalize:
        return num
    return num / guarded_normaliser(den, eps)[0]


class CausalPoison:
    """Non-finite inputs of a causal computation, made harmless for the positions before them.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, Dk)`` features of queries and keys.
    v : Tensor
        ``(B, HV, T, Dv)`` values (``HV`` a multiple of ``H``: value head ``j`` reads q/k head ``j // (HV // H)``).
    """

    def __init__(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        bad_q, bad_k, bad_v = ~torch.isfinite(q), ~torch.isfinite(k), ~torch.isfinite(v)
        self.q, self.k, self.v = q.masked_fill(bad_q, 0.0), k.masked_fill(bad_k, 0.0), v.masked_fill(bad_v, 0.0)
        r = v.shape[1] // k.shape[1]                    # grouped value heads: v's head j reads q/k head j // r
        bad_key = bad_k.any(-1, keepdim=True).repeat_interleave(r, dim=1)       # (B, HV, T, 1)
        seen = (bad_key | bad_v).to(torch.int32).cumsum(dim=2) > 0               # (B, HV, T, Dv): some s <= t
        self._out = seen | bad_q.any(-1, keepdim=True).repeat_interleave(r, dim=1)   # (B, HV, T, Dv)
        self._state = seen[:, :, -1:]                                            # (B, H, 1, Dv): columns of S
        self._z = bad_key.any(dim=2)                                             # (B, H, 1): all of z

    def outputs(self, out: Tensor) -> Tensor:
        """``(B, HV, T, Dv)`` outputs with NaN where they depend on a non-finite input."""
        return out.masked_fill(self._out, float("nan"))

    def state(self, S: Tensor) -> Tensor:
        """``(B, HV, Dk, Dv)`` state with NaN in the columns that saw a non-finite value or key."""
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
