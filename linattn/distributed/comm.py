"""Thin wrappers around ``torch.distributed``'s collectives that count the bytes each rank sends."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor


__all__ = ['ByteCounter', 'count_bytes']


# ---------------------------------------------------------------------------------------
# Counting the bytes a rank sends
# ---------------------------------------------------------------------------------------


class ByteCounter:
    """Bytes this process handed to ``torch.distributed`` while the counter was active."""

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
