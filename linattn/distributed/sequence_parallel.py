"""Sequence-parallel linear attention: each rank holds a contiguous slice and exchanges one fixed-size state."""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch
from torch import Tensor

from .. import _checks
from .._checks import position_dependent
from .._numerics import no_autocast
from ..attention import linear_attention, resolve_linear_attention_method
from ..feature_maps import FeatureMap, resolve_feature_map
from ..state import LinearAttentionState
from .agreement import (_FIELDS, _LINEAR_FIELDS, _UNUSED, STATE_EXCHANGES, _check_state_exchange, _confirm, _dtype_code,
                        _feature_map_name, _float_bits, _handshake, _name_hash)
from .comm import _all_gather, _all_reduce_sum, _ranks, _Ranks, _recv, _send, _isend

__all__ = ['local_state', 'sequence_parallel_linear_attention']


def _length_free_error(phi: FeatureMap, what: str) -> ValueError:
    """Why a position-dependent map without ``max_len`` cannot be used on a slice."""
    return ValueError(
        f"{what}: feature_map {phi!r} depends on the position and has max_len=None, so it would divide "
        "the positions by L = offset + T, the length of the slice it is given, instead of one length "
        "shared by the whole sequence; give the map max_len, e.g. CosFormerFeatures(max_len=N) with N at "
        "least the whole sequence's length (N equal to it gives the numbers of max_len=None in one "
        "process, non-causal)"
    )


def _slice_features(phi: Optional[FeatureMap], x: Tensor, offset: int, name: str) -> Tensor:
    """``φ(x)`` in the accumulation dtype; a position-dependent map is told that ``x`` starts at ``offset``."""
    x_acc = x.to(_checks.accumulation_dtype(x.dtype))
    if phi is None:
        return x_acc
    phi_x = phi(x_acc, offset=offset) if position_dependent(phi) else phi(x_acc)
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
    if offset > 0 and position_dependent(phi) and getattr(phi, "max_len", None) is None:
        raise _length_free_error(phi, f"local_state with offset={offset}")
    with no_autocast(k):
        return _slice_state(_slice_features(phi, k, offset, "k"), v, attention_mask)


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
    """The exclusive prefix sum over ranks in ``⌈log2 P⌉`` rounds of one message (MPI_Exscan's result)."""
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
    """Forward: the state of all earlier ranks. Backward: the incoming-state gradients of all later ranks."""

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
        - ``"chain"`` (also accepted as ``"ring"``, the same exchange, the name results files
          use): rank ``r`` receives the running sum from ``r - 1`` and sends it on:
          ``n`` bytes per rank, but ``P - 1`` messages one after the other;
        - ``"scan"``: an exclusive scan in ``⌈log2 P⌉`` rounds of one state each (Hillis &
          Steele's recursive doubling): at most ``⌈log2 P⌉·n`` bytes per rank and ``⌈log2 P⌉``
          messages on the critical path; its sums are added in another order, so its outputs
          equal the other two's up to rounding (the all-gather and the chain agree bit for bit);
        - ``"auto"`` (default): ``"allgather"`` with NCCL (one collective per pass, as LASP-2,
          Sun et al., 2025, chose and measured on GPUs), the chain with any other backend
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
    with no_autocast(q):         # linattn's own dtypes, also inside an autocast region
        fields, error, feature_map_name, positional = None, None, "", False
        try:
            _checks.check_qkv(q, k, v, causal=causal)
            dtype_code = _dtype_code(q.dtype)
            causal = _checks.check_bool(causal, "causal")
            normalize = _checks.check_bool(normalize, "normalize")
            return_state = _checks.check_bool(return_state, "return_state")
            _checks.check_eps(eps, _checks.accumulation_dtype(q.dtype))
            _checks.check_chunk_size(chunk_size)
            resolve_linear_attention_method(method, causal)
            state_exchange = _check_state_exchange(state_exchange, ranks)
            attention_mask = _checks.check_attention_mask(attention_mask, k)
            phi = resolve_feature_map(feature_map)
            feature_map_name = _feature_map_name(phi)
            positional = position_dependent(phi)
            if positional and getattr(phi, "max_len", None) is None:
                raise _length_free_error(phi, caller)
            # A position-dependent map needs this rank's offset, known after the handshake: until
            # then, one token tells M (and checks the map's output).
            probe = slice(0, 1) if positional else slice(None)
            phi_q, phi_k = _slice_features(phi, q[:, :, probe], 0, "q"), _slice_features(phi, k[:, :, probe], 0, "k")
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
                phi_q, phi_k = _slice_features(phi, q, q_offset, "q"), _slice_features(phi, k, k_offset, "k")
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
