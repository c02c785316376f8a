"""Ring attention: softmax attention over ranks by passing key-value blocks around a ring (the baseline)."""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks
from .._numerics import no_autocast
from .agreement import _FIELDS, _SOFTMAX_FIELDS, _dtype_code, _float_bits, _handshake
from .comm import _nbytes, _ranks, _Ranks, _record

__all__ = ['ring_softmax_attention']


# ---------------------------------------------------------------------------------------
# Ring attention: the softmax baseline
# ---------------------------------------------------------------------------------------


def _circulate(block: Tensor, ranks: _Ranks, sizes: list[int]) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(source rank, block)`` for every rank's block, passing blocks around the ring."""
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
    """``Σ_j p_ij v_j`` over the visible pairs ``(i, j)`` only: ``(B, H, Tq, Tk) × (B, H, Tk, Dv) -> (B, H, Tq, Dv)``."""
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
        Differentiable: the backward passes the key-value blocks around the ring once more,
        each with the gradients of its keys and values, which the last hop brings home
        (``(P-1)·T/P·B·H·2(D+Dv)`` numbers sent per rank, plus one block's gradients).

    Raises
    ------
    RuntimeError
        If torch.distributed is not initialised.
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
        B, H, Tq, D = q.shape
        fields = {"batch": B, "heads": H, "head_dim": D, "value_dim": v.shape[-1], "causal": int(causal),
                  "scale": _float_bits(scale), "dtype": dtype_code, "seq_q": Tq, "seq_k": k.shape[2]}
    except Exception as err:
        error = err
    table = _handshake(ranks, fields, error, caller, _SOFTMAX_FIELDS)
    sizes = [row[_FIELDS.index("seq_k")] for row in table]
    with no_autocast(q):
        return _RingSoftmax.apply(q, k, v, ranks, sizes, causal, scale)


class _RingSoftmax(torch.autograd.Function):
    """Forward: the online softmax over the blocks as they pass. Backward: FlashAttention's backward per
    block, ``p = exp(s − lse)``, with the gradients of each block's keys and values travelling with it."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ranks: _Ranks, sizes: list[int], causal: bool,
                scale: float) -> Tensor:
        out, lse = _ring_pass(q, k, v, ranks, sizes, causal, scale, _checks.accumulation_dtype(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = ranks, sizes, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ranks, sizes, causal, scale = ctx.meta
        rank, world, D = ranks.rank, ranks.world, q.shape[-1]
        d_out = grad_out.to(out.dtype)                                       # (B, H, Tq, Dv)
        delta = (d_out * out).sum(dim=-1, keepdim=True)                      # (B, H, Tq, 1)
        q_acc = q.to(out.dtype)
        dq = torch.zeros_like(q_acc)
        kv = torch.cat([k, v], dim=-1).contiguous()                          # (B, H, Tk, D + Dv)
        grads = q_acc.new_zeros(kv.shape)                                    # what travels with it
        for step in range(world):
            src = (rank - step) % world
            if not (causal and src > rank):
                k_b, v_b = kv[..., :D].to(out.dtype), kv[..., D:].to(out.dtype)
                scores = scale * q_acc @ k_b.transpose(-1, -2)              # (B, H, Tq, T_src)
                if causal and src == rank:
                    visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
                    scores = scores.masked_fill(~visible, -math.inf)
                p = torch.exp(scores - lse)                                  # the forward's weights
                ds = p * (d_out @ v_b.transpose(-1, -2) - delta)             # (B, H, Tq, T_src)
                dq = dq + scale * ds @ k_b
                grads = grads + torch.cat([scale * ds.transpose(-1, -2) @ q_acc, p.transpose(-1, -2) @ d_out], -1)
            if world > 1:
                kv, grads = _pass_on(kv if step < world - 1 else None, grads, ranks,
                                     sizes[(rank - step - 1) % world])
        dk, dv = grads[..., :D], grads[..., D:]                              # this rank's own block, home
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _pass_on(kv: Optional[Tensor], grads: Tensor, ranks: _Ranks, incoming_len: int) -> tuple:
    """Send a block (or, on the last hop, only its gradients) to the next rank; receive the previous rank's."""
    nxt = ranks.global_rank((ranks.rank + 1) % ranks.world)
    prv = ranks.global_rank((ranks.rank - 1) % ranks.world)
    shape = list(grads.shape)
    shape[2] = incoming_len
    grads_in = grads.new_empty(shape)
    requests = [dist.isend(grads, dst=nxt, group=ranks.group), dist.irecv(grads_in, src=prv, group=ranks.group)]
    kv_in = None
    if kv is not None:
        kv_in = kv.new_empty(shape[:3] + [kv.shape[-1]])
        requests += [dist.isend(kv, dst=nxt, group=ranks.group), dist.irecv(kv_in, src=prv, group=ranks.group)]
    _record("kv_grad", _nbytes(grads) + (0 if kv is None else _nbytes(kv)))
    for request in requests:
        request.wait()
    return kv_in, grads_in


def _ring_pass(q: Tensor, k: Tensor, v: Tensor, ranks: _Ranks, sizes: list[int], causal: bool, scale: float,
               acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """The online-softmax loop of :func:`ring_softmax_attention`: the output and each row's log-sum-exp, in ``acc``."""
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
    return o / l, m + torch.log(l)
