"""Sequence parallelism over ``torch.distributed``: each rank holds a contiguous slice of the sequence.

Linear attention needs only a fixed-size state from the tokens before a slice, so ranks
exchange ``B·H·M·(Dv + 1)`` numbers each, whatever the sequence length (Sun et al., 2024,
"Linear Attention Sequence Parallelism", sec. 3). Softmax attention needs every earlier key
and value: the ring-attention baseline passes ``K, V`` blocks from rank to rank (Liu, Zaharia
& Abbeel, 2023, "Ring Attention with Blockwise Transformers", sec. 3).

Everything communicates through PyTorch's own collectives (``all_gather``, ``all_reduce``,
``send``/``recv``, ``isend``/``irecv``); there is no communication layer of our own. What
this module adds:

- :func:`sequence_parallel_linear_attention`: causal (an exclusive prefix of the per-rank
  states over ranks) and non-causal (one all-reduce), differentiable: the backward pass
  communicates too.
- :func:`ring_softmax_attention`: the softmax baseline, forward only.
- :func:`count_bytes`: counts the bytes each rank hands to ``torch.distributed``.
- :func:`run_on_ranks` and :func:`measure_sequence_parallel`: start a process group of
  ``P`` CPU processes (gloo on 127.0.0.1), run a module-level function on every rank and
  return the results; the tests and chapter 12 use them.

Every rank must make the same calls in the same order (as with any collective code), and
when training, every rank must call ``backward`` on a loss that uses the output.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import math
import numbers
import os
import pickle
import socket
import statistics
import struct
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from . import _checks
from .attention import _resolve_method, linear_attention
from .feature_maps import FeatureMap, resolve_feature_map
from .state import LinearAttentionState

__all__ = [
    "STATE_EXCHANGES",
    "AUTO_STATE_EXCHANGE",
    "sequence_parallel_linear_attention",
    "local_state",
    "ring_softmax_attention",
    "ByteCounter",
    "count_bytes",
    "RankError",
    "run_on_ranks",
    "measure_sequence_parallel",
]

STATE_EXCHANGES = ("allgather", "ring", "scan")
#: What ``state_exchange="auto"`` (the default) becomes, by backend: NCCL's one all-gather per pass
#: (LASP-2, Sun et al., 2025, measured on GPUs); elsewhere (gloo) the chain, which chapter 12's
#: sp_exchange study measured faster than gloo's all-gather for the exchange at P = 2 and 4.
AUTO_STATE_EXCHANGE = {"nccl": "allgather"}
AUTO_STATE_EXCHANGE_DEFAULT = "ring"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------
# Counting the bytes a rank sends
# ---------------------------------------------------------------------------------------


class ByteCounter:
    """Bytes this process handed to ``torch.distributed`` while the counter was active.

    Each communication call of this module appends ``(op, nbytes)`` to :attr:`records`:

    - ``send`` / ``isend``: the tensor's size in bytes (exact);
    - ``all_gather`` of an ``s``-byte tensor over ``P`` ranks: ``(P - 1)·s``, what each rank
      sends in the ring all-gather algorithm;
    - ``all_reduce`` of ``s`` bytes: ``2·(P - 1)·s // P``, the ring (reduce-scatter then
      all-gather) algorithm's count.

    For the collectives these are the textbook algorithms' counts, not gloo's or NCCL's
    wire traffic (their algorithm choice depends on the message size); for point-to-point
    calls they are the payload exactly. Labels: ``"handshake"`` (the check of shapes and options),
    ``"state"`` / ``"state_grad"`` (linear attention's forward / backward), ``"kv"`` (ring
    attention's key-value blocks).
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []

    @property
    def bytes_sent(self) -> int:
        """Total bytes over all recorded calls."""
        return sum(n for _, n in self.records)

    def by_op(self) -> dict[str, int]:
        """Bytes per label, e.g. ``{"handshake": 120, "state": 2176}`` (two ranks)."""
        totals: dict[str, int] = {}
        for op, n in self.records:
            totals[op] = totals.get(op, 0) + n
        return totals


_ACTIVE_COUNTERS: list[ByteCounter] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Count the bytes this rank sends inside the ``with`` block.

    Example::

        with count_bytes() as counter:
            out = sequence_parallel_linear_attention(q, k, v, causal=True)
        counter.bytes_sent, counter.by_op()

    Yields
    ------
    ByteCounter
        Filled in while the block runs (nested counters all record).
    """
    counter = ByteCounter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


def _record(op: str, nbytes: int) -> None:
    for counter in _ACTIVE_COUNTERS:
        counter.records.append((op, int(nbytes)))


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


# ---------------------------------------------------------------------------------------
# The process group and thin wrappers around its collectives
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ranks:
    group: Optional[Any]   # a torch.distributed ProcessGroup, or None for the default group
    rank: int
    world: int

    def global_rank(self, r: int) -> int:
        """Rank ``r`` of the group as a global rank (what ``send``/``recv`` take as peer)."""
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def device(self) -> torch.device:
        """Where small control tensors must live: the current GPU for NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _ranks(group, caller: str) -> _Ranks:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller} needs an initialised torch.distributed process group; call "
            "torch.distributed.init_process_group(...) first (torchrun sets it up), or use "
            + ("linattn.softmax_attention" if "softmax" in caller else "linattn.linear_attention")
            + " in a single process"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member of group")
    return _Ranks(group, rank, dist.get_world_size(group))


def _all_gather(x: Tensor, ranks: _Ranks, op: str) -> list[Tensor]:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ranks.world)]
    dist.all_gather(parts, x, group=ranks.group)
    _record(op, (ranks.world - 1) * _nbytes(x))
    return parts


def _all_reduce_sum(x: Tensor, ranks: _Ranks, op: str) -> Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=ranks.group)
    _record(op, 2 * (ranks.world - 1) * _nbytes(x) // ranks.world)
    return x


def _send(x: Tensor, peer: int, ranks: _Ranks, op: str) -> None:
    x = x.contiguous()
    dist.send(x, dst=ranks.global_rank(peer), group=ranks.group)
    _record(op, _nbytes(x))


def _isend(x: Tensor, peer: int, ranks: _Ranks, op: str):
    """Start sending ``x`` (keep it unchanged until the returned request has been waited on)."""
    x = x.contiguous()
    request = dist.isend(x, dst=ranks.global_rank(peer), group=ranks.group)
    _record(op, _nbytes(x))
    return request


def _recv(like: Tensor, peer: int, ranks: _Ranks) -> Tensor:
    buf = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.recv(buf, src=ranks.global_rank(peer), group=ranks.group)
    return buf


# Columns of the handshake table: one row of int64 per rank. Floats travel as their float64
# bit pattern (compared exactly), the feature map as a 64-bit hash of its name.
_FIELDS = ("failed", "batch", "heads", "head_dim", "value_dim", "features M", "causal", "normalize", "eps",
           "feature_map", "scale", "state_exchange", "dtype", "seq_q", "seq_k")
# The columns each function fills in; all of them must agree across ranks (the lengths may differ).
_LINEAR_FIELDS = ("batch", "heads", "head_dim", "value_dim", "features M", "causal", "normalize", "eps",
                  "feature_map", "state_exchange", "dtype")
_SOFTMAX_FIELDS = ("batch", "heads", "head_dim", "value_dim", "causal", "scale", "dtype")
_UNUSED = -1            # state_exchange when causal=False: not used, so not compared
_NAME_BYTES = 200       # a feature map's name, as sent when the ranks disagree on it


def _float_bits(x: float) -> int:
    """The float64 bit pattern of ``x`` as a signed int64 (equal bits = equal floats)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _feature_map_name(phi: Optional[FeatureMap]) -> str:
    """What identifies a resolved feature map across processes (hashed by the handshake).

    Only what is the same in every process that runs the same code can identify a map, so:

    - a function, builtin or class: its module and qualified name (``"elu+1"`` resolves to
      :func:`linattn.elu_plus_one`, so the name and the function agree);
    - a lambda or anything defined inside a function (``<locals>`` in its qualified name):
      refused. Every lambda is ``<lambda>``, and a nested function may close over values
      that differ between ranks, so its name says nothing about what it computes;
    - ``functools.partial``: its function's identity plus its arguments, when those are
      plain values (numbers, strings, bools, None, and tuples or lists of them, compared by
      ``repr``); refused with any other argument (a tensor, a module), which could differ
      unseen;
    - a bound method: its function's identity plus that of the object it is bound to;
    - an ``nn.Module``: its class plus its ``repr`` (the configuration its ``extra_repr``
      prints, such as a cosFormer ``max_len`` or a Performer ``seed``); its parameters and
      buffers are *not* compared;
    - any other object whose class defines ``__call__`` in Python: its class only (its
      attributes are not compared); a callable implemented in C (a NumPy ufunc, a
      TorchScript function) is refused, since its class says nothing about what it computes.

    Raises
    ------
    TypeError
        For the refused kinds above, saying to use a module-level function or an ``nn.Module``.
    """
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
               caller: str, shown: tuple[str, ...], feature_map_name: str = "") -> list[list[int]]:
    """All-gather every rank's shapes and options (or a failure flag) before any real communication.

    ``fields`` maps column names of ``_FIELDS`` to ints (None if this rank's own checks
    failed); the columns ``shown`` must agree across ranks. A rank whose checks failed
    re-raises its error; the others raise a ValueError naming it; ranks that disagree all
    raise the same ValueError (every rank sees the same table, so they all take the same
    branch, including the second all-gather of feature-map names when those differ). No
    rank is left waiting in a collective that another rank never entered.
    """
    row = [1] + [0] * (len(_FIELDS) - 1) if fields is None else [0] + [fields.get(n, 0) for n in _FIELDS[1:]]
    parts = _all_gather(torch.tensor(row, dtype=torch.int64, device=ranks.device()), ranks, "handshake")
    table = [part.tolist() for part in parts]
    _raise_failures([values[0] for values in table], error, caller)
    columns = [_FIELDS.index(name) for name in shown]
    differ = [_FIELDS[i] for i in columns if len({values[i] for values in table}) > 1]
    if "causal" in differ and "state_exchange" in differ:
        differ.remove("state_exchange")          # unused on the non-causal ranks: a consequence
    if differ:
        names = [feature_map_name] * ranks.world
        if "feature_map" in differ:              # every rank is here: the table is the same on all
            names = _gather_names(feature_map_name, ranks)

        def describe(r: int) -> str:
            shown_r = ", ".join(f"{_FIELDS[i]}={_decode(_FIELDS[i], table[r][i], names[r])}" for i in columns)
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
    if name in ("causal", "normalize"):
        return bool(value)
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
    """``state_exchange`` as one of ``STATE_EXCHANGES`` (case and surrounding spaces ignored).

    ``"auto"`` is resolved by the backend of ``ranks``' group (:data:`AUTO_STATE_EXCHANGE`); without
    ``ranks`` it is returned as ``"auto"``.
    """
    choices = ("auto",) + STATE_EXCHANGES
    if not isinstance(state_exchange, str):
        raise TypeError(f"state_exchange must be a str, one of {choices}, "
                        f"got {type(state_exchange).__name__}")
    key = state_exchange.strip().lower()
    if key not in choices:
        raise ValueError(f"state_exchange must be one of {choices} (any case), got {state_exchange!r}")
    if key == "auto" and ranks is not None:
        key = AUTO_STATE_EXCHANGE.get(dist.get_backend(ranks.group), AUTO_STATE_EXCHANGE_DEFAULT)
    return key


# ---------------------------------------------------------------------------------------
# Sequence-parallel linear attention
# ---------------------------------------------------------------------------------------


def _no_autocast(x) -> contextlib.AbstractContextManager:
    """Autocast off on ``x``'s device: linattn picks its own dtypes (float32 accumulation, float64
    kept), which an autocast region would override with low-precision matmuls (and then ``S``
    and ``z``, or a score block and its running sums, would not even share a dtype)."""
    device_type = x.device.type if isinstance(x, Tensor) else "cpu"
    available = getattr(torch.amp, "is_autocast_available", None)     # torch >= 2.4
    if not (available(device_type) if available else device_type in ("cpu", "cuda")):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _position_dependent(phi: Optional[FeatureMap]) -> bool:
    """True for a map whose features depend on the position (``position_dependent = True``,
    e.g. :class:`linattn.feature_maps.CosFormerFeatures`): it takes ``offset=``."""
    return bool(getattr(phi, "position_dependent", False))


def _length_free_error(phi: FeatureMap, what: str) -> ValueError:
    """Why a position-dependent map without ``max_len`` cannot be used on a slice."""
    return ValueError(
        f"{what}: feature_map {phi!r} depends on the position and has max_len=None, so it would divide "
        "the positions by L = offset + T, the length of the slice it is given, instead of one length "
        "shared by the whole sequence; give the map max_len, e.g. CosFormerFeatures(max_len=N) with N at "
        "least the whole sequence's length (N equal to it gives the numbers of max_len=None in one "
        "process, non-causal)"
    )


def _features(phi: Optional[FeatureMap], x: Tensor, offset: int, name: str) -> Tensor:
    """``φ(x)`` in the accumulation dtype; a position-dependent map is told that ``x`` starts at ``offset``."""
    x_acc = x.to(_checks.accumulation_dtype(x.dtype))
    if phi is None:
        return x_acc
    phi_x = phi(x_acc, offset=offset) if _position_dependent(phi) else phi(x_acc)
    _checks.check_features(phi_x, x_acc, name)
    return phi_x.to(x_acc.dtype)


def _check_offset(offset) -> int:
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int (the position of the slice's first token), got "
                        f"{_checks.type_name(offset)}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (the position of the slice's first token), got {offset}")
    return int(offset)


def _slice_state(phi_k: Tensor, v: Tensor, attention_mask: Optional[Tensor]) -> LinearAttentionState:
    """``S = φ(K)ᵀV`` and ``z = Σ_j φ(k_j)`` of features ``(B, H, T, M)``; padded keys masked out."""
    v = v.to(phi_k.dtype)
    if attention_mask is not None:
        keep = attention_mask[:, None, :, None]
        phi_k, v = torch.where(keep, phi_k, 0.0), torch.where(keep, v, 0.0)
    return LinearAttentionState(phi_k.transpose(-1, -2) @ v,       # (B, H, M, Dv)
                                phi_k.sum(dim=-2))                 # (B, H, M)


@_checks.reject_key_padding_mask
def local_state(k: Tensor, v: Tensor, *, feature_map: Union[str, FeatureMap, None] = "elu+1",
                attention_mask: Optional[Tensor] = None, offset: int = 0) -> LinearAttentionState:
    """The state contributed by one slice of keys and values: ``S = Σ_j φ(k_j) v_jᵀ``, ``z = Σ_j φ(k_j)``.

    Katharopoulos et al. (2020), eq. 18, summed over the slice instead of a prefix. The
    state of a whole sequence is the sum of its slices' states, in any grouping: that
    associativity is what lets ranks exchange states instead of keys and values.

    Parameters
    ----------
    k : Tensor
        ``(B, H, T, D)`` keys of the slice, floating point.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype and device.
    feature_map : str, callable or None
        φ, as in :func:`linattn.linear_attention`.
    attention_mask : Tensor, optional
        ``(B, T)`` bool, or integer holding 0/1: True (1) for real tokens, False (0) for
        padding, as Hugging Face's ``attention_mask`` (PyTorch's ``key_padding_mask`` means the
        opposite and is refused by name). Padded keys contribute nothing.
    offset : int
        Position of the slice's first key in the whole sequence (``Σ`` of the earlier slices'
        lengths), passed to a position-dependent feature map (one with ``position_dependent =
        True``, such as :class:`linattn.feature_maps.CosFormerFeatures`) as ``φ(k, offset=offset)``,
        so that the slices' states add up to the whole sequence's. Other maps do not depend on
        the position and ignore it. Default 0.

    Returns
    -------
    LinearAttentionState
        ``S`` ``(B, H, M, Dv)`` and ``z`` ``(B, H, M)`` in float32 (float64 for float64
        inputs), contiguous, differentiable with respect to ``k``, ``v`` and φ's parameters.
        Inside a ``torch.autocast`` region the same numbers: autocast is turned off here (φ
        included), since it would round the sums to bfloat16/float16.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a non-bool mask; a bad feature map;
        a non-int ``offset``.
    ValueError
        Wrong ranks, ``k`` and ``v`` that disagree on batch, heads or length, a mask of the
        wrong shape; a negative ``offset``; ``offset > 0`` with a position-dependent map whose
        ``max_len`` is None (its features would use the length ``offset + T``, right only for
        the slice that ends the sequence); what the map raises (cosFormer: ``offset + T > max_len``).
    """
    layout = "(batch, heads, seq, dim)"
    _checks.check_tensor(k, "k", 4, layout)
    _checks.check_tensor(v, "v", 4, layout)
    _checks.check_same_kind({"k": k, "v": v})
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must share batch, heads and seq (dims 0-2), got k {_checks.shape_str(k.shape)} "
            f"and v {_checks.shape_str(v.shape)}"
        )
    attention_mask = _checks.check_attention_mask(attention_mask, k)
    offset = _check_offset(offset)
    phi = resolve_feature_map(feature_map)
    if offset > 0 and _position_dependent(phi) and getattr(phi, "max_len", None) is None:
        raise _length_free_error(phi, f"local_state with offset={offset}")
    with _no_autocast(k):
        return _slice_state(_features(phi, k, offset, "k"), v, attention_mask)


def _exclusive_prefix(local: Tensor, ranks: _Ranks, exchange: str, op: str) -> Tensor:
    """``Σ_{s < rank} local_s``: all-gather every state, receive the running sum from the left, or scan."""
    if exchange == "allgather":
        incoming = torch.zeros_like(local)
        for part in _all_gather(local, ranks, op)[: ranks.rank]:
            incoming += part
        return incoming
    if exchange == "scan":
        return _exclusive_scan(local, ranks, op, reverse=False)
    incoming = torch.zeros_like(local) if ranks.rank == 0 else _recv(local, ranks.rank - 1, ranks)
    if ranks.rank < ranks.world - 1:
        _send(incoming + local, ranks.rank + 1, ranks, op)
    return incoming


def _exclusive_suffix(grad: Tensor, ranks: _Ranks, exchange: str, op: str) -> Tensor:
    """``Σ_{s > rank} grad_s``, added from the last rank down (all-gather and chain alike; the scan by its tree)."""
    if exchange == "allgather":
        later = torch.zeros_like(grad)
        for part in reversed(_all_gather(grad, ranks, op)[ranks.rank + 1:]):
            later += part
        return later
    if exchange == "scan":
        return _exclusive_scan(grad, ranks, op, reverse=True)
    last = ranks.world - 1
    later = torch.zeros_like(grad) if ranks.rank == last else _recv(grad, ranks.rank + 1, ranks)
    if ranks.rank > 0:
        _send(later + grad, ranks.rank - 1, ranks, op)
    return later


def _exclusive_scan(x: Tensor, ranks: _Ranks, op: str, *, reverse: bool) -> Tensor:
    """The exclusive prefix sum over ranks in ``⌈log2 P⌉`` rounds of one message (MPI_Exscan's result).

    Hillis & Steele's scan (1986): in the round of distance ``d = 1, 2, 4, ...`` the rank at
    position ``i`` of the scan sends what it holds for ``(i − d, i]`` to position ``i + d`` and
    receives ``(i − 2d, i − d]`` from position ``i − d``; after the last round position ``i``
    holds ``Σ_{j < i}``. Each message is one state, each rank sends at most one per round, and
    the rounds, not ``P − 1`` hops, are the critical path. ``reverse`` scans from the last
    rank down (the backward pass). The sums are added in the tree's order, so the result
    equals the all-gather's and the chain's up to rounding, not bit for bit.
    """
    P = ranks.world
    pos = P - 1 - ranks.rank if reverse else ranks.rank                   # position along the scan

    def rank_at(i: int) -> int:
        return P - 1 - i if reverse else i

    inclusive, exclusive = x.contiguous(), torch.zeros_like(x)           # Σ over (pos − d, pos] and (pos − d, pos)
    d = 1
    while d < P:
        request = _isend(inclusive, rank_at(pos + d), ranks, op) if pos + d < P else None
        if pos - d >= 0:
            got = _recv(x, rank_at(pos - d), ranks)                       # Σ over (pos − 2d, pos − d]
            exclusive, received = got + exclusive, got
        if request is not None:
            request.wait()                                                # inclusive may be replaced now
        if pos - d >= 0:
            inclusive = received + inclusive
        d *= 2
    return exclusive


class _PrefixOverRanks(torch.autograd.Function):
    """Forward: the state of all earlier ranks. Backward: the incoming-state gradients of all later ranks.

    Rank ``r`` returns ``X_r = Σ_{s<r} L_s``. Since ``L_r`` enters ``X_s`` for every ``s > r``,
    ``∂loss/∂L_r = Σ_{s>r} ∂loss/∂X_s``: the backward is the same exchange run the other way.
    """

    @staticmethod
    def forward(ctx, local: Tensor, ranks: _Ranks, exchange: str) -> Tensor:
        ctx.ranks, ctx.exchange = ranks, exchange
        return _exclusive_prefix(local, ranks, exchange, "state")

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exclusive_suffix(grad.contiguous(), ctx.ranks, ctx.exchange, "state_grad"), None, None


class _SumOverRanks(torch.autograd.Function):
    """Forward: ``Σ_s L_s`` (all-reduce). Backward: every rank's output gradient summed (all-reduce)."""

    @staticmethod
    def forward(ctx, local: Tensor, ranks: _Ranks) -> Tensor:
        ctx.ranks = ranks
        return _all_reduce_sum(local, ranks, "state")

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce_sum(grad, ctx.ranks, "state_grad"), None


@_checks.reject_key_padding_mask
def sequence_parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group=None,
    *,
    feature_map: Union[str, FeatureMap, None] = "elu+1",
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
    method: str = "auto",
    chunk_size: int = 64,
    attention_mask: Optional[Tensor] = None,
    state_exchange: str = "auto",
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Linear attention over a sequence split across the ranks of a process group.

    Rank ``r`` of ``P`` holds the ``r``-th contiguous slice of the sequence (slices may have
    different lengths, down to one token). With ``L_r = local_state(k_r, v_r)`` (an
    ``M × (Dv + 1)`` state per head, normaliser included):

    - causal: rank ``r`` starts its local chunkwise pass from ``Σ_{s<r} L_s``, an exclusive
      prefix over ranks (Sun et al., 2024, LASP, sec. 3.2; Katharopoulos et al., 2020,
      eq. 9 split at slice boundaries);
    - non-causal: every query reads ``Σ_s L_s``, one all-reduce (eq. 5).

    The output equals :func:`linattn.linear_attention` on the concatenated sequence, sliced
    to this rank, and so do the gradients: the exchange is a ``torch.autograd.Function``
    whose backward sends the gradients of the incoming states back to the earlier ranks
    (causal) or all-reduces them (non-causal). When training, every rank must call
    ``backward`` on a loss that uses the output.

    What the ranks must agree on. Before any state moves, the ranks all-gather one row of
    15 int64 each and compare: batch, heads, ``D``, ``Dv``, ``M``, dtype, ``causal``,
    ``normalize``, ``eps`` (exactly, as float64 bits), the feature map and, when causal,
    ``state_exchange``. If any of them differs, every rank raises the same ValueError.
    The feature map is compared by identity, not by value: a function by its module and
    qualified name (a name such as ``"elu+1"`` counts as the function it names, so
    ``"elu+1"`` on one rank and :func:`linattn.elu_plus_one` on another agree); a
    ``functools.partial`` by its function and its arguments, which must be plain values
    (numbers, strings, bools, None, tuples of them); an ``nn.Module`` by its class and its
    ``repr`` (so ``CosFormerFeatures(max_len=64)`` and ``CosFormerFeatures(max_len=128)``
    disagree); another callable object by its class (its attributes are not compared). What
    has no name that identifies it is refused with a TypeError: a lambda (every lambda is
    ``<lambda>``), a function or class defined inside a function (it may close over values
    that differ between ranks), a partial with a tensor or other non-plain argument, a
    callable implemented in C (a NumPy ufunc). A feature map's parameters and buffers (a
    Performer projection, Hedgehog weights) are *not* compared: they must be equal on every
    rank (same seed, or broadcast them). Free to
    differ between ranks: the sequence lengths (the table gives every rank all of them, hence
    its position offset for a position-dependent map), ``attention_mask`` and ``return_state``
    (local to each rank), ``method`` and ``chunk_size`` (they only choose how a rank
    computes its own slice; the results agree up to rounding), and ``state_exchange`` when
    ``causal=False``.

    Parameters
    ----------
    q : Tensor
        ``(B, H, Tq, D)``, this rank's queries.
    k : Tensor
        ``(B, H, Tk, D)``, this rank's keys (``Tk == Tq`` when causal).
    v : Tensor
        ``(B, H, Tk, Dv)``, this rank's values.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the sequence, in sequence order; the default group if None.
    feature_map, causal, normalize, eps, method, chunk_size, attention_mask
        As in :func:`linattn.linear_attention`, applied to this rank's slice (``method``
        and ``chunk_size`` choose the local algorithm; the mask is ``(B, Tk)`` for the slice).
        There is no ``initial_state``: rank 0 starts from zero. A position-dependent feature
        map (``position_dependent = True``, such as
        :class:`linattn.feature_maps.CosFormerFeatures`) is told where the slice starts: rank
        ``r`` computes ``φ(q, offset=Σ_{s<r} Tq_s)`` and ``φ(k, offset=Σ_{s<r} Tk_s)`` (the
        lengths come from the handshake) and uses those features for its state and its local
        pass. Such a map must have a ``max_len`` (at least the whole sequence's length): with
        ``max_len=None`` cosFormer divides positions by the length of its input, which on a
        slice is not the whole sequence's. (Non-causal attention could in principle give it the
        whole length, but the map's interface takes only ``offset``, and
        ``max_len`` = the whole length gives exactly the numbers of ``max_len=None`` in one
        process, so that is what to pass.)
    state_exchange : str
        Causal only: how rank ``r`` obtains ``Σ_{s<r} L_s`` (a state of ``n`` bytes):

        - ``"allgather"``: each rank gathers every rank's state and sums those to its left;
          one collective call, ``(P-1)·n`` bytes sent per rank in a ring all-gather;
        - ``"ring"``: a chain, rank ``r`` receives the running sum from ``r - 1`` and sends it on:
          ``n`` bytes per rank, but ``P - 1`` messages one after the other;
        - ``"scan"``: an exclusive scan in ``⌈log2 P⌉`` rounds of one state each (Hillis &
          Steele's recursive doubling): at most ``⌈log2 P⌉·n`` bytes per rank and ``⌈log2 P⌉``
          messages on the critical path; its sums are added in another order, so its outputs
          equal the other two's up to rounding (the all-gather and the chain agree bit for bit);
        - ``"auto"`` (default): ``"allgather"`` with NCCL (one collective per pass, as LASP-2,
          Sun et al., 2025, chose and measured on GPUs), ``"ring"`` with any other backend
          (chapter 12's ``sp_exchange`` study: with gloo on CPU the chain and the scan passed
          the state faster than the all-gather in every block at ``P = 2`` and ``4``, the chain
          most often). See :data:`AUTO_STATE_EXCHANGE`.

        Case and surrounding spaces are ignored, as for ``method``. When ``causal=False`` it is
        not used: it must still be one of the names, but the ranks need not agree on it.
    return_state : bool
        Also return a state: causal, the state after this rank's last token (on the last
        rank, the state of the whole sequence); non-causal, the state of the whole sequence.

    Returns
    -------
    out : Tensor
        ``(B, H, Tq, Dv)`` in the dtype of ``q``. Inside a ``torch.autocast`` region the same
        numbers as outside: autocast is turned off for the whole call (the feature map
        included), which computes in float32 (float64 for float64 inputs) as everywhere.
    state : LinearAttentionState
        Only if ``return_state``: float32 (float64 for float64 inputs), ``S`` and ``z``
        contiguous, each in memory of its own (not views of one buffer, nor of an input),
        whatever ``method`` computed them. States are also exchanged in this dtype, so half
        inputs send float32 states.

    Raises
    ------
    RuntimeError
        If torch.distributed is not initialised.
    TypeError
        As :func:`linattn.linear_attention`; a ``group`` that is not a ProcessGroup; a dtype
        other than float16, bfloat16, float32 and float64 (e.g. a float8 type); a
        feature map that cannot be compared across ranks (see above; raised on the ranks
        that pass one, and the others raise a ValueError naming them, so no rank hangs).
    ValueError
        As :func:`linattn.linear_attention`; an unknown ``state_exchange``; ranks that
        disagree on any of the values listed above under "What the ranks must agree on"
        (raised on every rank, after one small all-gather, so no rank hangs; the message
        shows every rank's values); on the other ranks, when one rank's inputs are invalid;
        a position-dependent feature map with ``max_len=None``, or one whose positions run
        past ``max_len`` on some rank (raised there; the other ranks name it).

    Notes
    -----
    Communication per call and rank: one all-gather of ``P`` rows of 15 int64 (the check
    above; a second small all-gather of names only when the feature maps differ; for a
    position-dependent map, one more all-gather of one int64 per rank after its features at
    the rank's offset are computed, so that a failure there reaches every rank), then the
    state, ``B·H·M·(Dv + 1)`` numbers, independent of the sequence length; the backward
    sends as much again.
    """
    caller = "sequence_parallel_linear_attention"
    ranks = _ranks(group, caller)
    with _no_autocast(q):         # linattn's own dtypes, also inside an autocast region
        fields, error, feature_map_name, positional = None, None, "", False
        try:
            _checks.check_qkv(q, k, v, causal=causal)
            dtype_code = _dtype_code(q.dtype)
            causal = _checks.check_bool(causal, "causal")
            normalize = _checks.check_bool(normalize, "normalize")
            return_state = _checks.check_bool(return_state, "return_state")
            _checks.check_eps(eps, _checks.accumulation_dtype(q.dtype))
            _checks.check_chunk_size(chunk_size)
            _resolve_method(method, causal)
            state_exchange = _check_state_exchange(state_exchange, ranks)
            attention_mask = _checks.check_attention_mask(attention_mask, k)
            phi = resolve_feature_map(feature_map)
            feature_map_name = _feature_map_name(phi)
            positional = _position_dependent(phi)
            if positional and getattr(phi, "max_len", None) is None:
                raise _length_free_error(phi, caller)
            # A position-dependent map needs this rank's offset, known after the handshake: until
            # then, one token tells M (and checks the map's output).
            probe = slice(0, 1) if positional else slice(None)
            phi_q, phi_k = _features(phi, q[:, :, probe], 0, "q"), _features(phi, k[:, :, probe], 0, "k")
            _check_same_features(phi_q, phi_k)
            B, H, Tq, D = q.shape
            M, Dv = phi_k.shape[-1], v.shape[-1]
            fields = {"batch": B, "heads": H, "head_dim": D, "value_dim": Dv, "features M": M,
                      "causal": int(causal), "normalize": int(normalize), "eps": _float_bits(eps),
                      "feature_map": _name_hash(feature_map_name),
                      "state_exchange": STATE_EXCHANGES.index(state_exchange) if causal else _UNUSED,
                      "dtype": dtype_code, "seq_q": Tq, "seq_k": k.shape[2]}
        except Exception as err:  # reported to the other ranks by the handshake, raised here after it
            error = err
        table = _handshake(ranks, fields, error, caller, _LINEAR_FIELDS, feature_map_name)
        if positional:            # rank r's slice starts at Σ_{s<r} T_s, of queries and of keys
            q_offset = sum(row[_FIELDS.index("seq_q")] for row in table[:ranks.rank])
            k_offset = sum(row[_FIELDS.index("seq_k")] for row in table[:ranks.rank])
            try:
                phi_q, phi_k = _features(phi, q, q_offset, "q"), _features(phi, k, k_offset, "k")
                _check_same_features(phi_q, phi_k, M)
            except Exception as err:  # e.g. offset + T > max_len on the last ranks: all ranks raise
                error = err
            _confirm(ranks, error, caller)

        v_acc = v.to(phi_k.dtype)
        local_aug = _slice_state(phi_k, v_acc, attention_mask).augmented()         # (B, H, M, Dv + 1)
        if causal:
            incoming = _PrefixOverRanks.apply(local_aug, ranks, state_exchange)    # Σ_{s<r} L_s
        else:
            incoming = _SumOverRanks.apply(local_aug, ranks) - local_aug           # Σ_{s≠r} L_s
        result = linear_attention(
            phi_q, phi_k, v_acc, feature_map=None, causal=causal, normalize=normalize, eps=eps, method=method,
            chunk_size=chunk_size, attention_mask=attention_mask,
            initial_state=LinearAttentionState.from_augmented(incoming), return_state=return_state)
        if not return_state:
            return result.to(q.dtype)
        out, state = result
        return out.to(q.dtype), LinearAttentionState(_owned(state.S), _owned(state.z))


def _owned(x: Tensor) -> Tensor:
    """``x`` if it is contiguous and fills its own storage, else a contiguous copy (still differentiable):
    a returned state must not be a view into a bigger buffer (``S`` and ``z`` sliced from one
    ``(B, H, M, Dv + 1)`` tensor), which would keep that alive and change if it changed."""
    whole = x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    return x if x.is_contiguous() and whole else x.clone(memory_format=torch.contiguous_format)


def _check_same_features(phi_q: Tensor, phi_k: Tensor, M: Optional[int] = None) -> None:
    """φ gave queries and keys the same number of features (and ``M``, when given)."""
    if phi_q.shape[-1] != phi_k.shape[-1] or (M is not None and phi_k.shape[-1] != M):
        raise ValueError(
            "feature_map must give q and k the same number of features M at every position, got "
            f"φ(q) {_checks.shape_str(phi_q.shape)} and φ(k) {_checks.shape_str(phi_k.shape)}"
            + ("" if M is None else f" (and M = {M} at position 0)")
        )


# ---------------------------------------------------------------------------------------
# Ring attention: the softmax baseline
# ---------------------------------------------------------------------------------------


def _circulate(block: Tensor, ranks: _Ranks, sizes: list[int]) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(source rank, block)`` for every rank's block, passing blocks around the ring.

    At step ``t`` rank ``r`` holds the block of rank ``r - t`` (mod P); while the caller works
    on it, the block is sent to ``r + 1`` and the next one received from ``r - 1``
    (``isend``/``irecv``, so the transfer overlaps the work). ``sizes`` are the ranks'
    sequence lengths (dim 2). The generator must be run to the end.
    """
    rank, world = ranks.rank, ranks.world
    for step in range(world):
        src = (rank - step) % world
        requests, incoming = [], None
        if step < world - 1:
            shape = list(block.shape)
            shape[2] = sizes[(rank - step - 1) % world]
            incoming = block.new_empty(shape)
            requests = [dist.isend(block, dst=ranks.global_rank((rank + 1) % world), group=ranks.group),
                        dist.irecv(incoming, src=ranks.global_rank((rank - 1) % world), group=ranks.group)]
            _record("kv", _nbytes(block))
        yield src, block
        for request in requests:
            request.wait()
        block = incoming


def _visible_weighted_sum(p: Tensor, v: Tensor, visible: Tensor) -> Tensor:
    """``Σ_j p_ij v_j`` over the visible pairs ``(i, j)`` only: ``(B, H, Tq, Tk) × (B, H, Tk, Dv) -> (B, H, Tq, Dv)``.

    ``p @ v`` alone is wrong in one case: a masked weight is 0, and ``0 · NaN`` and ``0 · inf``
    are NaN, so a NaN or inf value at a later position would reach every earlier query.
    Tokens whose values are all finite go through the matmul; the others (rare, and only
    when present: one ``isfinite`` check otherwise) are added where ``visible`` (``(Tq, Tk)``
    bool) allows, a few tokens at a time so the temporary stays within the size of ``p``.
    """
    finite = torch.isfinite(v).all(dim=-1)                                # (B, H, Tk)
    if bool(finite.all()):
        return p @ v
    out = p @ torch.where(finite[..., None], v, 0.0)                      # the finite tokens
    bad = (~finite).any(dim=1).any(dim=0).nonzero().flatten()            # tokens non-finite somewhere
    step = max(1, v.shape[-2] // v.shape[-1])
    for start in range(0, len(bad), step):
        j = bad[start:start + step]
        pick = visible[:, j] & ~finite[:, :, None, j]                    # (B, H, Tq, n)
        terms = torch.where(pick[..., None], p[..., j, None] * v[:, :, None, j], 0.0)   # (B, H, Tq, n, Dv)
        out = out + terms.sum(dim=-2)
    return out


def ring_softmax_attention(q: Tensor, k: Tensor, v: Tensor, group=None, *, causal: bool = False,
                           scale: Optional[float] = None) -> Tensor:
    """Softmax attention over a sequence split across ranks, by passing key/value blocks around a ring.

    Ring attention (Liu, Zaharia & Abbeel, 2023, sec. 3): in ``P`` steps every rank sees the
    ``K, V`` block of every rank and folds it into its output with the online softmax
    (Milakov & Gimelshein, 2018): a running row maximum ``m``, normaliser ``l`` and
    unnormalised output ``o``, rescaled by ``exp(m_old - m_new)`` as blocks arrive. When
    causal, blocks of later ranks are skipped (but still passed on) and a rank's own block
    is masked with ``tril``; a NaN or inf in a later key or value reaches no earlier query
    (the query at its position and later ones see it, as in one process), since masked pairs
    are left out of the weighted sum rather than multiplied by a zero weight. Each rank sends
    ``P - 1`` blocks: ``(P-1)·(T/P)·B·H·(D + Dv)`` numbers for equal slices, linear in ``T``.

    This is the baseline for chapter 12: forward only (no backward pass), and each step
    forms the full ``(B, H, Tq, T_block)`` score block.

    Parameters
    ----------
    q : Tensor
        ``(B, H, Tq, D)``, this rank's queries.
    k : Tensor
        ``(B, H, Tk, D)``, this rank's keys (``Tk == Tq`` when causal).
    v : Tensor
        ``(B, H, Tk, Dv)``, this rank's values.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the sequence, in sequence order; the default group if None.
    causal : bool
        Query ``i`` sees keys ``j <= i`` of the whole sequence.
    scale : float, optional
        Multiplies the scores; default ``1/sqrt(D)``.

    Returns
    -------
    Tensor
        ``(B, H, Tq, Dv)`` in the dtype of ``q`` (float32 arithmetic for half inputs, also
        inside a ``torch.autocast`` region, which is turned off here), equal to
        :func:`linattn.softmax_attention` on the concatenated sequence, sliced.
        It does not require grad.

    Raises
    ------
    RuntimeError
        If torch.distributed is not initialised; if an input requires grad while grad mode
        is on (there is no backward pass; wrap the call in ``torch.no_grad()``).
    TypeError, ValueError
        As :func:`linattn.softmax_attention`; (TypeError) a dtype other than float16,
        bfloat16, float32 and float64; ranks that disagree on batch, heads, dims,
        dtype, ``causal`` or ``scale`` (compared exactly, as float64 bits, after the default
        ``1/sqrt(D)`` is filled in); raised on every rank. Only the sequence lengths may differ.
    """
    caller = "ring_softmax_attention"
    ranks = _ranks(group, caller)
    fields, error = None, None
    try:
        _checks.check_qkv(q, k, v, causal=causal)
        dtype_code = _dtype_code(q.dtype)
        causal = _checks.check_bool(causal, "causal")
        acc = _checks.accumulation_dtype(q.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _checks.check_positive_float(scale, "scale", acc)
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            raise RuntimeError(f"{caller} has no backward pass: call it under torch.no_grad()")
        B, H, Tq, D = q.shape
        fields = {"batch": B, "heads": H, "head_dim": D, "value_dim": v.shape[-1], "causal": int(causal),
                  "scale": _float_bits(scale), "dtype": dtype_code, "seq_q": Tq, "seq_k": k.shape[2]}
    except Exception as err:
        error = err
    table = _handshake(ranks, fields, error, caller, _SOFTMAX_FIELDS)
    sizes = [row[_FIELDS.index("seq_k")] for row in table]
    with _no_autocast(q):
        return _ring_pass(q, k, v, ranks, sizes, causal, scale, acc)


def _ring_pass(q: Tensor, k: Tensor, v: Tensor, ranks: _Ranks, sizes: list[int], causal: bool, scale: float,
               acc: torch.dtype) -> Tensor:
    """The online-softmax loop of :func:`ring_softmax_attention`, after the handshake."""
    D = q.shape[-1]
    q_acc = q.to(acc) * scale                                     # (B, H, Tq, D)
    m = q_acc.new_full((*q.shape[:3], 1), -math.inf)              # running row maximum
    l = q_acc.new_zeros((*q.shape[:3], 1))                        # running normaliser
    o = q_acc.new_zeros((*q.shape[:3], v.shape[-1]))              # running unnormalised output
    kv = torch.cat([k, v], dim=-1).contiguous()                   # (B, H, Tk, D + Dv): what travels
    for src, block in _circulate(kv, ranks, sizes):
        if causal and src > ranks.rank:
            continue                                              # later tokens: invisible
        k_b, v_b = block[..., :D].to(acc), block[..., D:].to(acc)
        scores = q_acc @ k_b.transpose(-1, -2)                    # (B, H, Tq, T_src)
        diagonal = causal and src == ranks.rank
        if diagonal:
            visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()  # (Tq, Tk)
            scores = scores.masked_fill(~visible, -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        rescale = torch.exp(m - m_new)
        l = l * rescale + p.sum(dim=-1, keepdim=True)
        o = o * rescale + (_visible_weighted_sum(p, v_b, visible) if diagonal else p @ v_b)
        m = m_new
    return (o / l).to(q.dtype)


# ---------------------------------------------------------------------------------------
# Running a function on P local processes
# ---------------------------------------------------------------------------------------


class RankError(RuntimeError):
    """A function run by :func:`run_on_ranks` raised on one or more ranks.

    Attributes
    ----------
    failures : dict
        ``rank -> (exception type name, message, formatted traceback)``. A rank whose process
        exited without reporting has the type name ``"ProcessExit"``, a message with its exit
        code and an empty traceback.
    """

    def __init__(self, failures: dict[int, tuple[str, str, str]]):
        self.failures = failures
        lines = [f"rank {r}: {message}" if name == "ProcessExit" else f"rank {r} raised {name}: {message}"
                 for r, (name, message, _) in sorted(failures.items())]
        text = "\n".join(lines)
        with_tb = [r for r in sorted(failures) if failures[r][2]]
        if with_tb:
            text += f"\n\ntraceback on rank {with_tb[0]}:\n{failures[with_tb[0]][2]}"
        super().__init__(text)


def _loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return names[0] if names else "lo"


def _child(rank: int, world_size: int, port: int, result_dir: str, fn: Callable, args: tuple,
           timeout: float, threads: int, backend: str) -> None:
    """Entry point of one spawned rank: join the process group, run ``fn``, write the result to a file."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(threads)
    delta = datetime.timedelta(seconds=timeout)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=delta)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=delta)
        try:
            record = ("ok", fn(*args))
        finally:
            dist.destroy_process_group()
        payload = pickle.dumps(record)
    except BaseException as err:  # reported to the parent, which raises RankError
        payload = pickle.dumps(("error", (type(err).__name__, str(err), traceback.format_exc())))
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        f.write(payload)
    os.replace(path + ".part", path)   # the parent only ever sees complete files


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, threads: int = 1,
                 backend: str = "gloo") -> list:
    """Run ``fn(*args)`` on ``world_size`` new processes that form one process group; return their results.

    The parent starts a ``torch.distributed.TCPStore`` on 127.0.0.1, port 0 (the OS picks a
    free port and the store keeps it bound, so no other program can take it), spawns the
    ranks with ``torch.multiprocessing`` (start method "spawn"), and each rank calls
    ``init_process_group(backend, store=..., rank=r, world_size=P)`` with ``timeout``, so a
    collective that cannot complete raises instead of hanging. Gloo uses the loopback
    interface (``GLOO_SOCKET_IFNAME``, unless already set). Every rank destroys its process
    group when ``fn`` returns or raises; the parent terminates ranks still running at the
    deadline, or a few seconds after another rank failed.

    Parameters
    ----------
    fn : callable
        A module-level function of an importable module (spawned processes import it by
        name: functions defined in a notebook or a lambda cannot be used). Inside it,
        ``torch.distributed.get_rank()`` tells the rank. Its result must be picklable.
    world_size : int
        Number of processes ``P >= 1``.
    *args
        Passed to ``fn`` on every rank (picklable).
    timeout : float
        Seconds for the whole run, start-up included, and for each collective.
    threads : int
        ``torch.set_num_threads`` in each rank.
    backend : str
        ``"gloo"`` (CPU) or ``"nccl"`` (case-insensitive). NCCL needs at least ``world_size``
        visible CUDA GPUs (checked here) and ``fn`` choosing its device.

    Returns
    -------
    list
        ``[result of rank 0, ..., result of rank P-1]``.

    Raises
    ------
    TypeError
        ``fn`` not an importable module-level function; non-int ``world_size`` or
        ``threads``; a non-number ``timeout``; a non-str ``backend``.
    ValueError
        ``world_size < 1``, ``threads < 1``, a non-positive or infinite ``timeout``, a
        ``backend`` other than gloo or nccl, nccl with fewer GPUs than ranks, or the
        backend not built into this torch. All checked before any process starts.
    RankError
        ``fn`` raised on some rank (message, type name and traceback of every failed rank),
        or a rank's process exited before reporting a result (the message gives the exit
        code and the usual causes: a script without an ``if __name__ == "__main__":``
        guard, which every spawned process re-runs; ``fn`` not importable in a fresh
        process; the process killed, e.g. for memory).
    TimeoutError
        Some rank did not finish within ``timeout`` seconds.
    """
    qualname = getattr(fn, "__qualname__", "")
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if not callable(fn) or "<" in qualname or module is None or (
            module.__name__ == "__main__" and not getattr(module, "__file__", None)):
        raise TypeError(
            f"fn must be a module-level function of an importable module (the spawned ranks import it "
            f"by name), got {fn!r}; move it into a .py file"
        )
    world_size = _checks.check_positive_int(world_size, "world_size")
    threads = _checks.check_positive_int(threads, "threads")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    backend = _check_backend(backend, world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="linattn_ranks_") as result_dir:
        procs = [ctx.Process(target=_child, daemon=True,
                             args=(r, world_size, store.port, result_dir, fn, args, float(timeout), threads, backend))
                 for r in range(world_size)]
        results: dict[int, tuple] = {}
        stopped: set[int] = set()   # ranks this function had to terminate
        started = []
        try:
            for p in procs:
                p.start()
                started.append(p)
            _collect(procs, result_dir, results, time.monotonic() + timeout)
        finally:
            for r, p in enumerate(started):
                if p.is_alive():
                    stopped.add(r)
                    p.terminate()
            for p in started:
                p.join(5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
        _read_results(result_dir, len(procs), results)     # any file written after the last look
    del store
    failures = {r: payload for r, (status, payload) in results.items() if status == "error"}
    for r, p in enumerate(procs):
        if r not in results and r not in stopped:
            failures[r] = ("ProcessExit", _exit_message(p.exitcode), "")
    if failures:
        raise RankError(failures)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise TimeoutError(f"run_on_ranks: rank(s) {missing} of {world_size} did not finish within {timeout} s")
    return [results[r][1] for r in range(world_size)]


_BACKENDS = ("gloo", "nccl")


def _check_backend(backend, world_size: int) -> str:
    """``backend`` as "gloo" or "nccl", usable here with ``world_size`` ranks."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, 'gloo' or 'nccl', got {type(backend).__name__}")
    key = backend.strip().lower()
    if key not in _BACKENDS:
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if not dist.is_available() or not (dist.is_gloo_available() if key == "gloo" else dist.is_nccl_available()):
        raise ValueError(f"backend={backend!r}: this build of torch has no {key} support")
    if key == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: world_size={world_size}, but "
                         f"{torch.cuda.device_count()} GPU(s) are visible")
    return key


def _exit_message(code: Optional[int]) -> str:
    """Why a rank has no result although its process ended."""
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return (f"the spawned process exited ({how}) before reporting a result; its own error, if any, went to "
            "its stderr. Common causes: the script that calls run_on_ranks has no "
            "`if __name__ == \"__main__\":` guard, so every spawned process re-runs it; fn cannot be "
            "imported in a fresh process; the process was killed (e.g. out of memory)")


def _read_results(result_dir: str, n: int, results: dict) -> list[int]:
    """Load the result files not yet in ``results``; return the ranks just loaded."""
    new = []
    for r in range(n):
        path = os.path.join(result_dir, f"rank{r}.pkl")
        if r not in results and os.path.exists(path):
            with open(path, "rb") as f:
                results[r] = pickle.loads(f.read())
            new.append(r)
    return new


def _collect(procs: list, result_dir: str, results: dict, deadline: float, grace: float = 3.0) -> None:
    """Read the ranks' result files until every rank has reported or exited, the deadline
    passes, or ``grace`` s after a failure (peers may be waiting on the failed rank)."""
    stop_at = deadline
    while time.monotonic() < stop_at:
        exited = [p.exitcode is not None for p in procs]   # before reading: a rank writes, then exits
        for r in _read_results(result_dir, len(procs), results):
            if results[r][0] == "error":
                stop_at = min(stop_at, time.monotonic() + grace)
        silent = [r for r in range(len(procs)) if exited[r] and r not in results]   # exited without a result
        if silent:
            stop_at = min(stop_at, time.monotonic() + grace)
        if all(r in results or exited[r] for r in range(len(procs))):
            return
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------
# Measuring time and bytes (chapter 12)
# ---------------------------------------------------------------------------------------

_CASE_DEFAULTS = dict(batch=1, heads=2, head_dim=16, causal=True, state_exchange="allgather",
                      dtype="float32", backward=False, communication_only=False, repeats=None, block=None)


def measure_sequence_parallel(world_size: int, cases: list[dict], *, repeats: int = 3,
                              timeout: float = 300.0, threads: int = 1) -> list[dict]:
    """Time sequence-parallel attention on ``world_size`` CPU processes (gloo) and count the bytes sent.

    Each case is a dict with ``kind`` (``"linear"``: :func:`sequence_parallel_linear_attention`
    with ``feature_map="elu+1"``; ``"softmax"``: :func:`ring_softmax_attention`) and ``T``
    (the whole sequence, split into contiguous slices whose lengths differ by at most one),
    plus optional ``batch`` (1), ``heads`` (2), ``head_dim`` (16, also ``Dv``), ``causal``
    (True), ``state_exchange`` ("allgather"), ``dtype`` ("float32"), ``backward`` (False;
    linear only: time forward + backward of ``out.sum()``) and ``communication_only``
    (False: time only the exchange, the state's for linear or the ring pass of the K, V
    blocks for softmax, with no attention arithmetic), ``repeats`` (this case's number of
    timed calls; default the ``repeats`` argument) and ``block`` (None; a label copied into
    the record and not used otherwise, to tell apart repeated, interleaved copies of a
    case). All cases run in one process group, so the start-up (several seconds) is paid once.

    Parameters
    ----------
    world_size : int
        Number of processes ``P``.
    cases : list of dict
        The configurations, run in order.
    repeats : int
        Timed calls per case after one warm-up call.
    timeout : float
        Seconds for the whole measurement.
    threads : int
        Intra-op threads per process.

    Returns
    -------
    list of dict
        One per case: the case's settings, ``world_size``, ``seconds`` (median over the
        repeats of the slowest rank's time, in seconds) and ``bytes_sent`` and
        ``handshake_bytes`` (lists, one int per rank: bytes of one call, all operations /
        the check of shapes and options only, as :class:`ByteCounter` counts them) and
        ``input_seeds`` (list, one int per rank: the seed of the generator that drew that
        rank's q, k, v, ``1000 * case index + rank``).

    Raises
    ------
    TypeError, ValueError
        Bad cases (unknown keys or kinds, non-positive sizes) or arguments.
    RankError, TimeoutError
        As :func:`run_on_ranks`.
    """
    full = []
    for case in cases:
        unknown = set(case) - set(_CASE_DEFAULTS) - {"kind", "T"}
        if unknown or "kind" not in case or "T" not in case:
            raise ValueError(f"each case needs 'kind' and 'T' and may set {sorted(_CASE_DEFAULTS)}, got {case}")
        if case["kind"] not in ("linear", "softmax"):
            raise ValueError(f"case kind must be 'linear' or 'softmax', got {case['kind']!r}")
        if case["kind"] == "softmax" and case.get("backward"):
            raise ValueError("ring_softmax_attention has no backward pass: backward=True needs kind 'linear'")
        if _checks.check_positive_int(case["T"], "T") < world_size:
            raise ValueError(f"T={case['T']} must be at least world_size={world_size} (one token per rank)")
        full.append({**_CASE_DEFAULTS, **case})
    repeats = _checks.check_positive_int(repeats, "repeats")
    for case in full:
        case["repeats"] = _checks.check_positive_int(case["repeats"] or repeats, "repeats")
        case["state_exchange"] = _check_state_exchange(case["state_exchange"])
    return run_on_ranks(_measure_worker, world_size, full, timeout=timeout, threads=threads)[0]


def _slice_lengths(T: int, world: int) -> list[int]:
    """Contiguous slices whose lengths differ by at most one (the first ``T mod P`` are longer)."""
    return [T // world + (r < T % world) for r in range(world)]


def _measure_worker(cases: list[dict]) -> list[dict]:
    """Run on every rank by :func:`measure_sequence_parallel`; rank 0's return value is the result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = _Ranks(None, rank, world)
    records = []
    for i, case in enumerate(cases):
        call = _measured_call(case, rank, world, ranks, seed=1000 * i + rank)
        with count_bytes() as counter:
            call()                                                     # warm-up, and the byte count
        times = []
        for _ in range(case["repeats"]):
            dist.barrier()
            start = time.perf_counter()
            call()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)             # the slowest rank sets the pace
            times.append(elapsed.item())
        counts = torch.tensor([counter.bytes_sent, counter.by_op().get("handshake", 0)], dtype=torch.int64)
        parts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(parts, counts)
        records.append({**case, "world_size": world, "seconds": statistics.median(times),
                        "bytes_sent": [int(p[0]) for p in parts], "handshake_bytes": [int(p[1]) for p in parts],
                        "input_seeds": [1000 * i + r for r in range(world)]})
    return records


def _measured_call(case: dict, rank: int, world: int, ranks: _Ranks, seed: int) -> Callable[[], object]:
    """The call that :func:`_measure_worker` times for one case, on this rank's slice."""
    T_local = _slice_lengths(case["T"], world)[rank]
    B, H, D = case["batch"], case["heads"], case["head_dim"]
    dtype = getattr(torch, case["dtype"])
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T_local, D, generator=g).to(dtype) for _ in range(3))
    if case["kind"] == "linear" and case["communication_only"]:
        state = local_state(k, v).augmented()                          # (B, H, M, Dv + 1)
        exchange = _check_state_exchange(case["state_exchange"], ranks)   # "auto" by this group's backend
        if case["causal"]:
            return lambda: _exclusive_prefix(state, ranks, exchange, "state")
        return lambda: _all_reduce_sum(state, ranks, "state")
    if case["kind"] == "linear":
        def linear():
            with torch.set_grad_enabled(case["backward"]):
                qq, kk, vv = (x.detach().requires_grad_(case["backward"]) for x in (q, k, v))
                out = sequence_parallel_linear_attention(qq, kk, vv, causal=case["causal"],
                                                         state_exchange=case["state_exchange"])
                if case["backward"]:
                    out.sum().backward()
        return linear
    if case["communication_only"]:
        sizes = _slice_lengths(case["T"], world)
        kv = torch.cat([k, v], dim=-1)
        return lambda: [block for _, block in _circulate(kv, ranks, sizes)]
    return lambda: ring_softmax_attention(q, k, v, causal=case["causal"])
