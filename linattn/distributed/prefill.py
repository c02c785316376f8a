"""Prefill across ranks, decoding in one process: the last rank's state is all that leaves the process group."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks
from ..layers import LinearMixer
from ..state import MixerState
from .agreement import _check_state_exchange
from .comm import count_bytes
from .launch import run_on_ranks
from .layers import sequence_parallel_mixer

__all__ = ['Prefill', 'prefill_on_ranks']


class Prefill(NamedTuple):
    """What :func:`prefill_on_ranks` returns.

    Attributes
    ----------
    y : Tensor
        ``(B, T, d_model)``: the ranks' outputs, concatenated in sequence order.
    state : MixerState
        The last rank's state: the layer's state after the whole sequence.
    bytes_sent : list of int
        Per rank, the bytes it handed to ``torch.distributed`` (as :class:`ByteCounter` counts them).
    """

    y: Tensor
    state: MixerState
    bytes_sent: list


def _prefill_worker(mixer: LinearMixer, x: Tensor, lengths: list[int], exchange: str):
    """One rank: its slice through :func:`sequence_parallel_mixer`, without gradients."""
    rank = dist.get_rank()
    start = sum(lengths[:rank])
    with torch.no_grad(), count_bytes() as counter:
        y, state = sequence_parallel_mixer(mixer, x[:, start:start + lengths[rank]], state_exchange=exchange,
                                           return_state=True)
    return y, state, counter.bytes_sent


def prefill_on_ranks(mixer: LinearMixer, x: Tensor, world_size: int, *, lengths: Optional[list[int]] = None,
                     state_exchange: str = "auto", timeout: float = 120.0) -> Prefill:
    """Run a :class:`linattn.LinearMixer` on ``x`` cut into contiguous slices on ``world_size`` new local processes.

    Each process (gloo, one thread, started by :func:`run_on_ranks`) runs its slice through
    :func:`sequence_parallel_mixer`; the last rank's :class:`linattn.MixerState` is the state
    after the whole sequence, so this process can decode on with ``mixer(x_next, state=state)``
    as if it had read the whole sequence itself.

    Parameters
    ----------
    mixer : LinearMixer
        The layer, with a causal rule (copied to every process).
    x : Tensor
        ``(B, T, d_model)`` on the CPU, ``T >= world_size``.
    world_size : int
        Number of processes ``P >= 1``.
    lengths : list of int, optional
        The slices' lengths (each ``>= 1``, summing to ``T``); by default they differ by at most one.
    state_exchange : str
        As in :func:`sequence_parallel_retention`.
    timeout : float
        As in :func:`run_on_ranks`.

    Returns
    -------
    Prefill
        ``(y, state, bytes_sent)``.

    Raises
    ------
    TypeError
        ``mixer`` not a LinearMixer; ``x`` not a 3-D tensor; ``lengths`` not a list of ints.
    ValueError
        ``lengths`` of the wrong count, a slice shorter than one token, or a sum other than ``T``;
        an unknown ``state_exchange``; as :func:`run_on_ranks`.
    RankError
        As :func:`run_on_ranks` (e.g. a layer whose rule has no sequence-parallel twin).
    """
    if not isinstance(mixer, LinearMixer):
        raise TypeError(f"mixer must be a linattn.LinearMixer, got {_checks.type_name(mixer)}")
    _checks.check_tensor(x, "x", 3, "(batch, seq, d_model)")
    P = _checks.check_positive_int(world_size, "world_size")
    T = x.shape[1]
    if lengths is None:
        lengths = [T // P + (r < T % P) for r in range(P)]
    if not isinstance(lengths, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                          for n in lengths):
        raise TypeError(f"lengths must be a list of ints, got {lengths!r}")
    if len(lengths) != P or min(lengths) < 1 or sum(lengths) != T:
        raise ValueError(f"lengths must be {P} slices of at least one token summing to T={T}, got {list(lengths)}")
    exchange = _check_state_exchange(state_exchange)
    results = run_on_ranks(_prefill_worker, P, mixer, x.detach(), list(lengths), exchange, timeout=timeout)
    return Prefill(torch.cat([y for y, _, _ in results], dim=1), results[-1][1], [n for _, _, n in results])
