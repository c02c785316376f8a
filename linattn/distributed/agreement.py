"""The handshake: before any state moves, the ranks check that they hold slices of one problem."""
from __future__ import annotations

import functools
import hashlib
import numbers
import struct
import types
from typing import Optional

import torch
import torch.distributed as dist

from .. import _checks
from ..feature_maps import FeatureMap
from .comm import _all_gather, _Ranks

__all__ = ['STATE_EXCHANGES', 'STATE_EXCHANGE_ALIASES', 'AUTO_STATE_EXCHANGE', 'AUTO_STATE_EXCHANGE_DEFAULT']


#: The distinct ways to pass the state, as the functions return them and results files record them.
STATE_EXCHANGES = ("allgather", "ring", "scan")
#: Other accepted names: ``"chain"`` is exactly ``"ring"`` (the state passes along a chain of
#: ranks, not around a ring); the functions accept it and treat it as ``"ring"``.
STATE_EXCHANGE_ALIASES = {"chain": "ring"}
#: What ``state_exchange="auto"`` (the default) becomes, by backend: NCCL's one all-gather per pass
#: (LASP-2, Sun et al., 2025, measured on GPUs); elsewhere (gloo) the chain, which chapter 12's
#: sp_exchange study measured faster than gloo's all-gather for the exchange at P = 2 and 4.
AUTO_STATE_EXCHANGE = {"nccl": "allgather"}
AUTO_STATE_EXCHANGE_DEFAULT = "ring"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Columns of the handshake table: one row of int64 per rank. Floats travel as their float64
# bit pattern (compared exactly), the feature map as a 64-bit hash of its name.
_FIELDS = ("failed", "batch", "heads", "head_dim", "value_dim", "features M", "causal", "normalize", "eps",
           "feature_map", "scale", "state_exchange", "dtype", "seq_q", "seq_k")
# The columns each function fills in; all of them must agree across ranks (the lengths may differ).
_LINEAR_FIELDS = ("batch", "heads", "head_dim", "value_dim", "features M", "causal", "normalize", "eps",
                  "feature_map", "state_exchange", "dtype")
_SOFTMAX_FIELDS = ("batch", "heads", "head_dim", "value_dim", "causal", "scale", "dtype")
# The decay and delta rules' row: which rule, the state's shape, the gates, and the options.
_RULE_FIELDS = ("failed", "rule", "batch", "heads", "value_heads", "key_dim", "value_dim", "gate", "feature_map",
                "gamma", "scale", "state_exchange", "dtype", "grad", "seq")
_RULES = ("retention", "gated_linear_attention", "delta_rule", "gated_delta_rule")
_GATES = ("none", "fixed gamma per head", "one per head and token", "one per key channel and token")
_UNUSED = -1            # state_exchange when causal=False: not used, so not compared
_NAME_BYTES = 200       # a feature map's name, as sent when the ranks disagree on it


def _float_bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as a signed int64 (equal bits = equal floats)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _feature_map_name(phi: Optional[FeatureMap]) -> str:
    """What identifies a resolved feature map across processes (hashed by the handshake)."""
    if phi is None:
        return "None (q and k are features)"
    return _callable_identity(phi)


_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                   types.WrapperDescriptorType, types.ClassMethodDescriptorType, type)
_PLAIN_TYPES = (bool, numbers.Number, str, type(None))


def _refuse(phi, why: str) -> TypeError:
    return TypeError(
        f"feature_map={phi!r} cannot be compared across processes: {why}. The ranks check that they "
        "all use the same feature map, and only a name every process shares identifies one: use a "
        "module-level function (def at the top level of a module or notebook), a functools.partial "
        "of one with plain arguments, or an nn.Module instance"
    )


def _callable_identity(fn) -> str:
    """The identity of one callable, by the rules of :func:`_feature_map_name`."""
    if isinstance(fn, functools.partial):
        args = [_plain_repr(fn, a) for a in fn.args]
        args += [f"{key}={_plain_repr(fn, value)}" for key, value in sorted(fn.keywords.items())]
        return f"functools.partial({', '.join([_callable_identity(fn.func), *args])})"
    if isinstance(fn, types.MethodType):
        return f"{_callable_identity(fn.__func__)} bound to {_object_identity(fn.__self__)}"
    if isinstance(fn, types.BuiltinFunctionType) and not isinstance(fn.__self__, (types.ModuleType, type, type(None))):
        raise _refuse(fn, f"it is bound to a {_checks.type_name(fn.__self__)}, whose value is not compared")
    if isinstance(fn, _FUNCTION_TYPES):
        return _qualified_name(fn)
    if isinstance(fn, torch.nn.Module) or isinstance(getattr(type(fn), "__call__", None), types.FunctionType):
        return _object_identity(fn)
    raise _refuse(fn, f"it is a {_checks.type_name(fn)} implemented in C, whose type says nothing about "
                      "what it computes")


def _object_identity(obj) -> str:
    """A module by class and configuration (``repr``), a class by name, anything else by its class."""
    if isinstance(obj, type):
        return _qualified_name(obj)
    name = f"{_qualified_name(type(obj))} instance"
    return f"{name}: {' '.join(repr(obj).split())}" if isinstance(obj, torch.nn.Module) else name


def _qualified_name(fn) -> str:
    """``module.qualname`` of a function or class; refused for lambdas and local definitions."""
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "?")
    if "<lambda>" in qualname:
        raise _refuse(fn, "every lambda has the same name, <lambda>")
    if "<locals>" in qualname:
        raise _refuse(fn, f"{qualname} is defined inside a function, so its name does not say what it "
                          "computes (it may use values local to that call, which can differ between ranks)")
    module = getattr(fn, "__module__", None) or getattr(getattr(fn, "__objclass__", None), "__module__", None)
    return f"{module or '?'}.{qualname}"


def _plain_repr(fn, value) -> str:
    """``repr`` of a partial's argument that is a plain value (or a tuple or list of them)."""
    items = value if isinstance(value, (tuple, list)) else [value]
    for x in items:
        if isinstance(x, (tuple, list)):
            _plain_repr(fn, x)
        elif not isinstance(x, _PLAIN_TYPES):
            raise _refuse(fn, f"its argument of type {_checks.type_name(x)} is not a plain value (a number, "
                              "str, bool, None, or a tuple of them), so the ranks cannot check it is the same")
    return repr(value)


def _name_hash(name: str) -> int:
    """A 64-bit hash of ``name`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


def _gather_names(name: str, ranks: _Ranks) -> list[str]:
    """Every rank's ``name`` (UTF-8, cut to ``_NAME_BYTES`` bytes), by one all-gather."""
    raw = name.encode()[:_NAME_BYTES]
    buf = torch.zeros(_NAME_BYTES + 1, dtype=torch.uint8)
    buf[0] = len(raw)
    buf[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    parts = _all_gather(buf.to(ranks.device()), ranks, "handshake")
    return [bytes(part[1:1 + int(part[0])].tolist()).decode(errors="replace") for part in parts]


def _handshake(ranks: _Ranks, fields: Optional[dict[str, int]], error: Optional[BaseException],
               caller: str, shown: tuple[str, ...], feature_map_name: str = "",
               names: tuple[str, ...] = _FIELDS) -> list[list[int]]:
    """All-gather every rank's shapes and options (or a failure flag) before any real communication;
    ``names`` are the columns of the row (the first is the failure flag)."""
    row = [1] + [0] * (len(names) - 1) if fields is None else [0] + [fields.get(n, 0) for n in names[1:]]
    parts = _all_gather(torch.tensor(row, dtype=torch.int64, device=ranks.device()), ranks, "handshake")
    table = [part.tolist() for part in parts]
    _raise_failures([values[0] for values in table], error, caller)
    columns = [names.index(name) for name in shown]
    differ = [names[i] for i in columns if len({values[i] for values in table}) > 1]
    if "causal" in differ and "state_exchange" in differ:
        differ.remove("state_exchange")          # unused on the non-causal ranks: a consequence
    if differ:
        maps = [feature_map_name] * ranks.world
        if "feature_map" in differ:              # every rank is here: the table is the same on all
            maps = _gather_names(feature_map_name, ranks)

        def describe(r: int) -> str:
            shown_r = ", ".join(f"{names[i]}={_decode(names[i], table[r][i], maps[r])}" for i in columns)
            return f"rank {r}: {shown_r}"

        raise ValueError(
            f"{caller}: every rank must hold a slice of the same batch, heads and dims and pass the same "
            f"options; the ranks disagree on {', '.join(differ)} (only the sequence length may differ): "
            + "; ".join(describe(r) for r in range(ranks.world))
        )
    return table


def _raise_failures(flags: list[int], error: Optional[BaseException], caller: str) -> None:
    """Re-raise this rank's own ``error``; else a ValueError naming the ranks whose flag is set."""
    if error is not None:
        raise error
    failed = [r for r, flag in enumerate(flags) if flag]
    if failed:
        raise ValueError(
            f"{caller}: rank(s) {failed} rejected their inputs (the error is raised on those ranks); "
            "nothing was computed on this rank"
        )


def _confirm(ranks: _Ranks, error: Optional[BaseException], caller: str) -> None:
    """A second, one-int64 round after the handshake, for checks that needed its table: every
    rank learns whether any rank failed, and all raise (as in :func:`_handshake`) or none does."""
    flag = torch.tensor([int(error is not None)], dtype=torch.int64, device=ranks.device())
    _raise_failures([int(part) for part in _all_gather(flag, ranks, "handshake")], error, caller)


def _decode(name: str, value: int, feature_map_name: str = ""):
    if name == "dtype":
        return _DTYPES[value]
    if name == "state_exchange":
        return "unused (causal=False)" if value == _UNUSED else repr(STATE_EXCHANGES[value])
    if name in ("causal", "normalize", "grad"):
        return bool(value)
    if name == "rule":
        return _RULES[value]
    if name == "gate":
        return repr(_GATES[value])
    if name == "gamma":
        return f"<hash {value & 0xFFFFFFFF:08x} of its values>"
    if name in ("eps", "scale"):
        return repr(_bits_float(value))
    if name == "feature_map":
        return feature_map_name
    return value


def _dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s column value in the handshake; TypeError for a dtype linattn does not compute in."""
    if dtype not in _DTYPES:
        raise TypeError(f"q, k and v must be one of {', '.join(map(str, _DTYPES))} for sequence parallelism, "
                        f"got {dtype}")
    return _DTYPES.index(dtype)


def _check_state_exchange(state_exchange, ranks: Optional[_Ranks] = None) -> str:
    """``state_exchange`` as one of ``STATE_EXCHANGES`` (case and surrounding spaces ignored;
    an alias such as ``"chain"`` becomes its name there, ``"ring"``)."""
    choices = ("auto",) + tuple(sorted(STATE_EXCHANGES + tuple(STATE_EXCHANGE_ALIASES)))
    if not isinstance(state_exchange, str):
        raise TypeError(f"state_exchange must be a str, one of {choices}, "
                        f"got {type(state_exchange).__name__}")
    key = state_exchange.strip().lower()
    if key not in choices:
        raise ValueError(f"state_exchange must be one of {choices} (any case), got {state_exchange!r}")
    key = STATE_EXCHANGE_ALIASES.get(key, key)
    if key == "auto" and ranks is not None:
        key = AUTO_STATE_EXCHANGE.get(dist.get_backend(ranks.group), AUTO_STATE_EXCHANGE_DEFAULT)
    return key
