"""Measuring sequence parallelism: time and bytes per case on ``P`` local processes (chapter 12)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from .. import _checks
from .agreement import _check_state_exchange
from .comm import _all_reduce_sum, _Ranks, count_bytes
from .launch import run_on_ranks
from .ring import _circulate, ring_softmax_attention
from .affine import _exclusive
from .delta_rules import sequence_parallel_gated_delta_rule
from .sequence_parallel import _exclusive_prefix, local_state, sequence_parallel_linear_attention

__all__ = ['measure_sequence_parallel']


# ---------------------------------------------------------------------------------------
# Measuring time and bytes (chapter 12)
# ---------------------------------------------------------------------------------------

_KINDS = ("linear", "softmax", "gated_delta")
_CASE_DEFAULTS = dict(batch=1, heads=2, head_dim=16, causal=True, state_exchange="allgather",
                      dtype="float32", backward=False, communication_only=False, repeats=None, block=None)


def measure_sequence_parallel(world_size: int, cases: list[dict], *, repeats: int = 3,
                              timeout: float = 300.0, threads: int = 1) -> list[dict]:
    """Time sequence-parallel attention on ``world_size`` CPU processes (gloo) and count the bytes sent.

    Parameters
    ----------
    world_size : int
        Number of processes ``P``.
    cases : list of dict
        The configurations, run in order: ``kind`` (``"linear"``:
        :func:`sequence_parallel_linear_attention` with elu+1; ``"softmax"``:
        :func:`ring_softmax_attention`; ``"gated_delta"``:
        :func:`sequence_parallel_gated_delta_rule` with L2-normalised keys), ``T`` (the
        whole sequence, cut into slices whose lengths differ by at most one), and optionally
        ``batch``, ``heads``, ``head_dim``, ``causal``, ``state_exchange``, ``dtype``,
        ``backward`` (time forward and backward), ``communication_only`` (time the exchange
        alone: the state, the map of the gated delta rule, or the ring pass of the blocks),
        ``repeats`` and ``block`` (a label).
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
    RankError
        As :func:`run_on_ranks`.
    """
    full = []
    for case in cases:
        unknown = set(case) - set(_CASE_DEFAULTS) - {"kind", "T"}
        if unknown or "kind" not in case or "T" not in case:
            raise ValueError(f"each case needs 'kind' and 'T' and may set {sorted(_CASE_DEFAULTS)}, got {case}")
        if case["kind"] not in _KINDS:
            raise ValueError(f"case kind must be one of {_KINDS}, got {case['kind']!r}")
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
    exchange = _check_state_exchange(case["state_exchange"], ranks)       # "auto" by this group's backend
    if case["communication_only"]:
        if case["kind"] == "linear":
            state = local_state(k, v).augmented()                          # (B, H, M, Dv + 1)
            if case["causal"]:
                return lambda: _exclusive_prefix(state, ranks, exchange, "state")
            return lambda: _all_reduce_sum(state, ranks, "state")
        if case["kind"] == "gated_delta":                                  # a Dk x Dk transition and a state
            A, S = torch.randn(B, H, D, D, generator=g), torch.randn(B, H, D, D, generator=g)
            return lambda: _exclusive(A, S, ranks, exchange, "state", reverse=False)
        sizes = _slice_lengths(case["T"], world)
        kv = torch.cat([k, v], dim=-1)
        return lambda: [block for _, block in _circulate(kv, ranks, sizes)]
    if case["kind"] == "gated_delta":
        k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
        log_g = -torch.rand(B, H, T_local, generator=g).to(dtype)
        beta = torch.rand(B, H, T_local, generator=g).to(dtype)

    def call():
        with torch.set_grad_enabled(case["backward"]):
            qq, kk, vv = (x.detach().requires_grad_(case["backward"]) for x in (q, k, v))
            if case["kind"] == "linear":
                out = sequence_parallel_linear_attention(qq, kk, vv, causal=case["causal"], state_exchange=exchange)
            elif case["kind"] == "gated_delta":
                out = sequence_parallel_gated_delta_rule(qq, kk, vv, log_g, beta, state_exchange=exchange)
            else:
                out = ring_softmax_attention(qq, kk, vv, causal=case["causal"])
            if case["backward"]:
                out.sum().backward()
    return call
