"""Input validation shared by the attention functions (private)."""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from ._numerics import has_values, unwrap


def shape_str(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def check_tensor(x, name: str, ndim: int, layout: str) -> None:
    """``x`` is a floating tensor with ``ndim`` dimensions laid out as ``layout``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {shape_str(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"{name} must not have an empty dimension, got shape {shape_str(x.shape)}")


def step_inputs_ok(q, k, v) -> bool:
    """Whether ``q``, ``k`` ``(B, H, D)`` and ``v`` ``(B, H, Dv)`` pass every check of a decoding step:
    floating tensors of one dtype and device, no empty dimension (one test, no message)."""
    return (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and q.dim() == 3 and k.dim() == 3 and v.dim() == 3 and q.is_floating_point()
            and q.dtype == k.dtype == v.dtype and q.device == k.device == v.device
            and q.shape == k.shape and q.shape[:2] == v.shape[:2] and 0 not in q.shape and v.shape[2] != 0)


def check_layer_input(x, name: str, width: int, width_name: str, weight: Tensor, hint: str = "") -> None:
    """``x`` is a floating ``(batch, seq, width)`` tensor (batch, seq >= 1) in ``weight``'s dtype and
    on its device: the input of a layer whose parameters include ``weight``."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = f"a {x.dtype} tensor of shape {shape_str(x.shape)}" if isinstance(x, Tensor) else type_name(x)
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {got}")
    if x.dim() != 3 or x.shape[-1] != width or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have shape (batch, seq, {width_name}={width}) with batch, seq >= 1{hint}, "
                         f"got {shape_str(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the layer's parameters are {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{name} is on {x.device} but the layer's parameters are on {weight.device}")


def check_same_kind(named: dict[str, Tensor]) -> None:
    """All tensors share one dtype and one device."""
    items = list(named.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {first_name} has dtype {first.dtype}; "
                "q, k and v must share one dtype"
            )
        if x.device != first.device:
            raise ValueError(
                f"{name} is on {x.device} but {first_name} is on {first.device}; "
                "q, k and v must be on one device"
            )


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, causal_only: Optional[str] = None,
              grouped_values: bool = False) -> None:
    """Check q (B,H,Tq,D), k (B,H,Tk,D), v (B,H,Tk,Dv) (``grouped_values``: v (B,HV,Tk,Dv) with
    ``HV`` a multiple of ``H``); causal needs Tq == Tk."""
    layout = "(batch, heads, seq, dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name, 4, layout)
    check_same_kind({"q": q, "k": k, "v": v})
    if grouped_values and q.shape[:2] == k.shape[:2] and v.shape[0] == k.shape[0]:
        if v.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"v must have a multiple of the {k.shape[1]} heads of q and k (grouped value heads: value head j "
                f"reads q/k head j // (HV // H)), got q {shape_str(q.shape)}, k {shape_str(k.shape)}, "
                f"v {shape_str(v.shape)}")
    elif q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        also = " (v may have a multiple of their heads)" if grouped_values else ""
        raise ValueError(
            f"q, k and v must share batch and heads (dims 0 and 1){also}, got "
            f"q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"k and v must have the same sequence length (dim 2), got k {shape_str(k.shape)} "
            f"and v {shape_str(v.shape)}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must have the same head_dim (dim 3), got q {shape_str(q.shape)} "
            f"and k {shape_str(k.shape)}"
        )
    causal = check_bool(causal, "causal")
    if causal and q.shape[2] != k.shape[2]:
        got = f"got q with seq {q.shape[2]} and k with seq {k.shape[2]}"
        if causal_only is not None:
            raise ValueError(
                f"{causal_only} is causal (it has no cross-attention form) and needs as many queries "
                f"as keys: q, k and v must have the same seq (dim 2), {got}"
            )
        raise ValueError(f"causal=True needs as many queries as keys, {got}; use causal=False for cross-attention")


def type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def describe(x) -> str:
    """A value as an error message names it: a tensor by dtype and shape, anything else by type."""
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {shape_str(x.shape)}"
    return type(x).__name__


def check_bool(x, name: str) -> bool:
    """``x`` is a Python or NumPy bool; returns it as a Python bool."""
    if isinstance(x, bool):
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"):
        return bool(x)
    raise TypeError(f"{name} must be a bool, got {type_name(x)}")


def check_positive_float(x, name: str, dtype: torch.dtype) -> float:
    """``x`` is a real number, positive, and representable as a normal number of ``dtype``."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a float, got {type_name(x)}")
    if not isinstance(x, (torch.SymFloat, torch.SymInt)):
        try:
            x = float(x)
        except OverflowError:
            raise ValueError(f"{name} must be a positive finite number, got {x}") from None
    info = torch.finfo(dtype)
    if not (x > 0 and x < math.inf):
        raise ValueError(f"{name} must be a positive finite number, got {x}")
    if not (info.tiny <= x <= info.max):
        raise ValueError(
            f"{name}={x:g} is not a normal {dtype} number (needs {info.tiny:.3g} <= {name} <= "
            f"{info.max:.3g}, the dtype the computation runs in)"
        )
    return x


def check_scale(scale, dtype: torch.dtype) -> Optional[float]:
    """``scale`` of the linear ops: None (or 1: nothing to multiply) or a positive normal number of ``dtype``."""
    if scale is None:
        return None
    scale = check_positive_float(scale, "scale", dtype)
    return None if scale == 1 else scale


def check_attention_mask(mask, k: Tensor) -> Optional[Tensor]:
    """``mask`` is None or a (batch, seq_k) mask for ``k``; returns it as a bool tensor (True = real token)."""
    return attention_mask_as_bool(mask, k.shape[0], k.shape[2], k.device)


def attention_mask_as_bool(mask, batch: int, seq: int, device, name: str = "attention_mask") -> Optional[Tensor]:
    """A ``(batch, seq)`` attention mask as a bool tensor, or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (True or 1 = real token), got {type_name(mask)}")
    if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()):
        raise TypeError(f"{name} must be a bool or integer (0/1) tensor, True or 1 = real token; got dtype "
                        f"{mask.dtype}")
    expected = (batch, seq)
    if tuple(mask.shape) != expected:
        raise ValueError(f"{name} must have shape (batch, seq) = {shape_str(expected)}, got {shape_str(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}")
    if mask.dtype == torch.bool:
        return mask
    check_values((mask == 0) | (mask == 1), name, "0 or 1 (1 = real token) when it is an integer tensor", mask)
    return mask != 0


def check_values(ok: Tensor, name: str, need: str, x: Optional[Tensor] = None) -> None:
    """Every entry of the bool tensor ``ok`` is True; else ``{name} must be {need}`` (nothing to check on
    meta and fake tensors, which hold no values)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok.all(), f"{name} must be {need}")
        return
    if not has_values(ok):                   # meta and fake tensors: no values to check
        return
    with torch.no_grad():
        ok = unwrap(ok)                      # under torch.func transforms: every element's values
        if bool(ok.all()):
            return
        where = tuple(int(i) for i in (~ok).nonzero()[0])
        got = ""
        if x is not None:
            x = unwrap(x)
            got = (f", got {x[where].item()} at index {where}" if x.shape == ok.shape
                   else f", got {x[~ok.expand_as(x)][0].item()}" if ok.dim() == x.dim() else "")
    raise ValueError(f"{name} must be {need}{got}")


def check_log_gate(log_g: Tensor, name: str, need: str) -> None:
    """Every entry of ``log_g`` is finite and ``<= 0``; else the ValueError of :func:`check_values`."""
    if not has_values(log_g):
        return
    if not torch.compiler.is_compiling():
        with torch.no_grad():
            x = unwrap(log_g)
            if x.numel() > 0:
                lo, hi = torch.aminmax(x)
                if bool((hi <= 0) & (lo > -math.inf)):
                    return
    check_values(torch.isfinite(log_g) & (log_g <= 0), name, need, log_g)


def reject_key_padding_mask(fn):
    """Refuse the old keyword ``key_padding_mask`` with an error that explains the rename."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "key_padding_mask" in kwargs:
            raise TypeError(
                f"{fn.__qualname__}() takes attention_mask (True or 1 = real token, as in Hugging Face), "
                "not key_padding_mask: PyTorch's key_padding_mask marks padding with True, the opposite. "
                "Pass attention_mask=~key_padding_mask for a PyTorch-style mask"
            )
        return fn(*args, **kwargs)

    return wrapper


_CHECKED_EPS: dict = {}


def check_eps(eps, dtype: torch.dtype = torch.float64) -> float:
    """``eps`` is positive and neither underflows nor overflows in ``dtype`` (where it is used)."""
    if type(eps) is float and (eps, dtype) in _CHECKED_EPS:
        return eps
    eps = check_positive_float(eps, "eps", dtype)
    if type(eps) is float and len(_CHECKED_EPS) < 64:
        _CHECKED_EPS[eps, dtype] = True
    return eps


def check_positive_int(x, name: str) -> int:
    """``x`` is a Python or NumPy integer >= 1; returns it as a Python int."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(x)}")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return int(x)


def check_chunk_size(chunk_size) -> int:
    return check_positive_int(chunk_size, "chunk_size")


def check_features(phi_x: Tensor, x: Tensor, name: str) -> None:
    """The feature map kept the leading dimensions and returned floats."""
    if not isinstance(phi_x, Tensor):
        raise TypeError(f"feature_map must return a torch.Tensor for {name}, got {type(phi_x).__name__}")
    if not phi_x.is_floating_point():
        raise TypeError(f"feature_map returned dtype {phi_x.dtype} for {name}; it must return floats")
    if phi_x.device != x.device:
        raise ValueError(f"feature_map returned features of {name} on {phi_x.device}, but {name} is on {x.device}")
    if phi_x.dim() != x.dim() or phi_x.shape[:-1] != x.shape[:-1] or phi_x.shape[-1] == 0:
        raise ValueError(
            f"feature_map must map {name} of shape {shape_str(x.shape)} to (..., M) keeping the "
            f"leading dimensions, got {shape_str(phi_x.shape)}"
        )


def position_dependent(phi) -> bool:
    """Whether the feature map ``phi`` depends on the position of a token (cosFormer): such a map
    has ``position_dependent = True`` and takes ``offset=`` (the position of the first token)."""
    return bool(getattr(phi, "position_dependent", False))


def check_position_dependent(phi, *, causal: bool, resumed: bool, same_length: bool, caller: str) -> None:
    """Refuse the uses of a position-dependent map that would give wrong numbers."""
    if not position_dependent(phi):
        return
    name = type(phi).__name__
    if resumed:
        raise ValueError(
            f"{caller}: the position-dependent feature_map {name} cannot continue from initial_state: the "
            "state does not record how many tokens it has seen, so the new tokens would get the features of "
            "positions 0, 1, ...; compute the features yourself with phi(x, offset=<tokens seen>) and pass "
            "feature_map=None")
    if hasattr(phi, "max_len") and phi.max_len is None and (causal or not same_length):
        why = ("in causal attention an earlier output would change with the number of tokens after it"
               if causal else "queries and keys of different lengths would get different position scales")
        raise ValueError(
            f"{caller}: the position-dependent feature_map {name} needs a fixed max_len here (it has "
            f"max_len=None, so its features depend on the length of the input and {why}); build it with "
            f"{name}(max_len=<the longest sequence>)")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_feature_map(phi, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """φ(q), φ(k) (or q, k themselves when ``phi`` is None), checked to share M (linattn's elementwise
    maps, marked ``keeps_shape``, keep shape, dtype and device by construction)."""
    if getattr(phi, "keeps_shape", False):
        return phi(q), phi(k)
    phi_q, phi_k = (q, k) if phi is None else (phi(q), phi(k))
    check_features(phi_q, q, "q")
    check_features(phi_k, k, "k")
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            "feature_map must give q and k the same number of features M, got "
            f"φ(q) {shape_str(phi_q.shape)} and φ(k) {shape_str(phi_k.shape)}"
        )
    if phi_q.dtype != q.dtype or phi_k.dtype != k.dtype:
        phi_q, phi_k = phi_q.to(q.dtype), phi_k.to(k.dtype)
    return phi_q, phi_k


def check_floating(x: Tensor, name: str) -> None:
    """``x`` is a floating-point tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_int_at_least(value, name: str, minimum: int) -> int:
    """A Python or NumPy integer >= ``minimum``, returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_strict_bool(value, name: str) -> None:
    """``value`` is a Python bool (NumPy's is refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_positive_finite(value, name: str) -> float:
    """A positive finite Python or NumPy real number, returned as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def check_non_negative_int(value, name: str) -> int:
    """``value`` is a Python or NumPy integer >= 0; returns it as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_count_in_range(value, name: str, minimum: int, maximum: "int | None" = None, why: str = "") -> None:
    """``value`` is a Python int in ``[minimum, maximum]`` (``why`` says where the maximum comes from)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum} ({why})" if maximum is not None else ""
        raise ValueError(f"{name} must be >= {minimum}{upper}, got {value}")


def check_generator(generator) -> None:
    """``generator`` is None or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
