"""The chunkwise form of causal linear attention, organised for speed: :func:`chunkwise_linear_attention`."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._autograd import NO_SECOND_DERIVATIVE, autograd_must_see_every_op, has_forward_tangent
from ..._numerics import CausalPoison, all_finite, compiling, guarded_normaliser, no_autocast, safe_normaliser
from .naive import naive_chunk_linear_attention

__all__ = ["chunkwise_linear_attention"]


def _padded_to_chunks(phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk_size: int):
    """``(phi_q, phi_k, v, C, N)``: the inputs zero-padded to ``N`` whole chunks of ``C = min(chunk_size, T)``
    tokens (a chunk longer than the sequence only adds padding; padded tokens contribute nothing and are cut off)."""
    T = phi_q.shape[2]
    C = min(chunk_size, T)
    N = -(-T // C)
    if N * C != T:
        pad = (0, 0, 0, N * C - T)
        phi_q, phi_k, v = (F.pad(x, pad) for x in (phi_q, phi_k, v))
    return phi_q, phi_k, v, C, N


def _chunk_buffer(like: Tensor, BH: int, N: int, *rest: int) -> Tensor:
    """Room for one value per chunk of every head, plus one spare slot: (BH * N + 1, *rest)."""
    return like.new_empty((BH * N + 1, *rest))


def _exclusive_prefix_(buf: Tensor, BH: int, N: int, init: Optional[Tensor],
                       final_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """In place: per-chunk contributions -> the state before each chunk (the forward scan)."""
    x = buf[1:].view(BH, N, *buf.shape[1:])                      # (BH, N, *rest)
    if init is not None:
        x[:, 0] += init
    for c in range(1, N):                                        # inclusive prefix, per head
        x[:, c] += x[:, c - 1]
    final = x[:, N - 1].reshape(final_shape).clone()
    first = buf[0 : BH * N : N]                                  # the slots chunk 0 of each head reads
    if init is not None:
        first.copy_(init)
    else:
        first.zero_()
    return buf[: BH * N], final


def _exclusive_suffix_(buf: Tensor, BH: int, N: int, init: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """In place: per-chunk contributions -> ``init + Σ`` over the later chunks (the backward scan)."""
    x = buf[: BH * N].view(BH, N, *buf.shape[1:])                # (BH, N, *rest)
    if init is not None:
        x[:, N - 1] += init
    for c in range(N - 2, -1, -1):                               # inclusive suffix, per head
        x[:, c] += x[:, c + 1]
    total = x[:, 0].clone()
    last = buf[N::N]                                             # the slots the last chunk of each head reads
    if init is not None:
        last.copy_(init)
    else:
        last.zero_()
    return buf[1:], total


def _fold(x: Optional[Tensor], in_dim: Optional[int], V: int) -> Optional[Tensor]:
    """Fold a vmapped dimension into the leading (batch) dimension: (…V at in_dim…) -> (V·B, …)."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(V, *x.shape) if in_dim is None else x.movedim(in_dim, 0)
    return x.reshape(V * x.shape[1], *x.shape[2:]).contiguous()


def _unfold(x: Optional[Tensor], V: int) -> Optional[Tensor]:
    """The inverse of :func:`_fold` on outputs: (V·B, …) -> (V, B, …)."""
    return None if x is None else x.reshape(V, x.shape[0] // V, *x.shape[1:])


class _ChunkwiseLinearAttention(torch.autograd.Function):
    """Chunkwise causal linear attention with a hand-written backward."""

    @staticmethod
    def forward(phi_q, phi_k, v, S0, z0, normalize: bool, eps: float, chunk_size: int):
        B, H, T, M = phi_q.shape
        Dv = v.shape[-1]
        with no_autocast(phi_q.device):
            phi_q, phi_k, v, C, N = _padded_to_chunks(phi_q, phi_k, v, chunk_size)
            BH = B * H
            q_c, k_c, v_c = _chunks(phi_q, phi_k, v, BH * N, C)
            S0_ = None if S0 is None else S0.reshape(BH, M, Dv)
            z0_ = None if z0 is None else z0.reshape(BH, M)

            kv = _chunk_buffer(phi_q, BH, N, M, Dv)
            torch.bmm(k_c.transpose(1, 2), v_c, out=kv[1:])                   # per-chunk φ(K_c)ᵀV_c
            S_before, S_final = _exclusive_prefix_(kv, BH, N, S0_, (B, H, M, Dv))
            scores = torch.bmm(q_c, k_c.transpose(1, 2)).tril_()              # (BHN, C, C)
            y = phi_q.new_empty(B, H, N * C, Dv)                               # the output, filled in place
            out = torch.bmm(q_c, S_before, out=y.view(BH * N, C, Dv))          # (BHN, C, Dv): earlier chunks
            out.baddbmm_(scores, v_c)                                          # + this chunk
            z_before, z_final = _normaliser_states(k_c, BH, N, M, z0_, (B, H, M))
            den = den_ok = None
            if normalize:
                den = torch.bmm(q_c, z_before.unsqueeze(-1)).squeeze(-1)      # (BHN, C)
                den.add_(scores.sum(-1))
                den, den_ok = guarded_normaliser(den, eps)
                out.div_(den.unsqueeze(-1))
            del out
            y_all = y.detach()                          # (B, H, N*C, Dv), saved for the backward
            if N * C != T:
                y = y[:, :, :T].clone()                 # a tensor of its own, not a view
        return y, S_final, z_final, y_all, den, den_ok, scores, S_before, z_before

    @staticmethod
    def setup_context(ctx, inputs, output):
        phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size = inputs
        y, S_final, z_final, y_all, den, den_ok, scores, S_before, z_before = output
        ctx.set_materialize_grads(False)   # unused outputs' gradients stay None: no zero tensors
        ctx.mark_non_differentiable(*(t for t in output[3:] if t is not None))
        T = phi_q.shape[2]
        C = min(chunk_size, T)
        ctx.config = (normalize, eps, C, T, -(-T // C), phi_q.shape[0] * phi_q.shape[1])
        ctx.has_state = (S0 is not None, z0 is not None)
        if any(ctx.needs_input_grad[:5]):
            ctx.save_for_backward(phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before)
        # y through a detached alias: saving the differentiable output itself makes a reference
        # cycle under non-reentrant checkpointing (its recomputed tensors then wait for the gc)
        ctx.save_for_forward(phi_q, phi_k, v, S0, z0, y.detach(), den, den_ok)

    @staticmethod
    def backward(ctx, g_out, g_S, g_z, *unused):
        phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before = ctx.saved_tensors
        normalize, eps, C, T, N, BH = ctx.config
        grads = _ChunkwiseLinearAttentionBackward.apply(
            g_out, g_S, g_z, phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before, normalize, C, T)
        g_q, g_k, g_v, g_S0, g_z0 = grads
        has_S0, has_z0 = ctx.has_state
        return (g_q, g_k, g_v, g_S0 if has_S0 else None, g_z0 if has_z0 else None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size):
        V = info.batch_size
        args = [_fold(x, d, V) for x, d in zip((phi_q, phi_k, v, S0, z0), in_dims[:5])]
        out = _chunkwise_function().apply(*args, normalize, eps, chunk_size)
        return tuple(_unfold(o, V) for o in out), tuple(None if o is None else 0 for o in out)


class _ChunkwiseLinearAttentionWithJvp(_ChunkwiseLinearAttention):
    """:class:`_ChunkwiseLinearAttention` with a forward-mode rule, for ``torch.func`` transforms."""

    @staticmethod
    def jvp(ctx, t_q, t_k, t_v, t_S0, t_z0, *unused):
        phi_q, phi_k, v, S0, z0, y, den, den_ok = ctx.saved_tensors
        normalize, eps, C, T, N, BH = ctx.config
        with no_autocast(phi_q.device):
            ones = torch.ones_like(v[..., :1])
            v_aug = torch.cat([v, ones], dim=-1)                                  # (B, H, T, Dv + 1)
            S0_aug = _augmented_state(S0, z0, phi_q, v)
            zero = torch.zeros_like
            t_q, t_k = (zero(phi_q) if t_q is None else t_q), (zero(phi_k) if t_k is None else t_k)
            t_v_aug = torch.cat([zero(v) if t_v is None else t_v, zero(ones)], dim=-1)
            t_S0_aug = _augmented_state(t_S0, t_z0, phi_q, v) if (t_S0 is not None or t_z0 is not None) else None
            # out_aug(q, k, v_aug, S0_aug) is linear in q, in k and in (v_aug, S0_aug) separately.
            d_out = (naive_chunk_linear_attention(t_q, phi_k, v_aug, S0_aug, C)[0]
                     + naive_chunk_linear_attention(phi_q, t_k, v_aug, None, C)[0]
                     + naive_chunk_linear_attention(phi_q, phi_k, t_v_aug, t_S0_aug, C)[0])   # (B, H, T, Dv + 1)
            d_state = t_k.transpose(-1, -2) @ v_aug + phi_k.transpose(-1, -2) @ t_v_aug
            if t_S0_aug is not None:
                d_state = d_state + t_S0_aug                                        # (B, H, M, Dv + 1)
            d_num, d_den = d_out[..., :-1], d_out[..., -1]
            if normalize:
                B, H = phi_q.shape[:2]
                den_t = den.view(B, H, -1)[:, :, :T]
                ok_t = den_ok.view(B, H, -1)[:, :, :T]
                d_den = torch.where(ok_t, d_den, 0.0)                               # eps does not move
                d_y = (d_num - y * d_den.unsqueeze(-1)) / den_t.unsqueeze(-1)
            else:
                d_y = d_num
        return (d_y, d_state[..., :-1].contiguous(), d_state[..., -1].contiguous(),
                None, None, None, None, None, None)                          # one tangent per output


def _chunkwise_function(*tensors: Optional[Tensor]):
    """The Function to apply: with a ``jvp`` under ``torch.func`` transforms or for forward-mode duals among
    ``tensors``, without one otherwise."""
    if torch._C._are_functorch_transforms_active() or has_forward_tangent(*tensors):
        return _ChunkwiseLinearAttentionWithJvp
    return _ChunkwiseLinearAttention


def _augmented_state(S: Optional[Tensor], z: Optional[Tensor], phi_q: Tensor, v: Tensor) -> Optional[Tensor]:
    """``[S, z]`` as one (B, H, M, Dv + 1) tensor; a missing part is zeros (None if both are)."""
    if S is None and z is None:
        return None
    B, H, _, M = phi_q.shape
    S = phi_q.new_zeros(B, H, M, v.shape[-1]) if S is None else S
    z = phi_q.new_zeros(B, H, M) if z is None else z
    return torch.cat([S, z.unsqueeze(-1)], dim=-1)


class _ChunkwiseLinearAttentionBackward(torch.autograd.Function):
    """The backward pass of :class:`_ChunkwiseLinearAttention`, as a Function of its own."""

    @staticmethod
    def forward(g_out, g_S, g_z, phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before,
                normalize: bool, C: int, T: int):
        B, H, _, M = phi_q.shape
        Dv = v.shape[-1]
        N = -(-T // C)
        BH, Tp = B * H, N * C
        with no_autocast(phi_q.device):
            if Tp != T:   # the ragged tail, zero-padded as in the forward
                phi_q, phi_k, v = (F.pad(x, (0, 0, 0, Tp - T)) for x in (phi_q, phi_k, v))
            q_c, k_c, v_c = _chunks(phi_q, phi_k, v, BH * N, C)
            if g_out is None:
                g_out = y_all.new_zeros(B, H, T, Dv)
            if Tp != T:
                g_out = F.pad(g_out, (0, 0, 0, Tp - T))
            g_o = g_out.reshape(BH * N, C, Dv)
            g_den = None
            if normalize:
                # y = o / d  =>  dL/do = g / d,  dL/dd = -(g . y) / d  (zero where d was replaced by eps)
                g_den = (g_o * y_all.view(BH * N, C, Dv)).sum(-1).div_(den).neg_()   # (BHN, C)
                g_o = g_o / den.unsqueeze(-1)
                g_den = g_den.masked_fill_(~den_ok, 0.0)

            # dL/dscores within the chunk (causal part only): g_o v^T (+ g_den 1^T).
            g_scores = torch.bmm(g_o, v_c.transpose(1, 2))                     # (BHN, C, C)
            if g_den is not None:
                g_scores.add_(g_den.unsqueeze(-1))
            g_scores.tril_()

            # dφ(q): this chunk's keys, plus the states before the chunk.
            g_q = torch.bmm(g_scores, k_c)                                     # (BHN, C, M)
            g_q.baddbmm_(g_o, S_before.transpose(1, 2))
            if g_den is not None:
                g_q.baddbmm_(g_den.unsqueeze(-1), z_before.unsqueeze(1))     # outer product g_den z_beforeᵀ

            # Reverse scan: gradient of the state each chunk's keys feed, from later queries.
            gS_init = None if g_S is None else g_S.reshape(BH, M, Dv)
            qg = _chunk_buffer(phi_q, BH, N, M, Dv)
            torch.bmm(q_c.transpose(1, 2), g_o, out=qg[: BH * N])              # per-chunk φ(Q_c)ᵀdO_c
            g_S_after, g_S0 = _exclusive_suffix_(qg, BH, N, gS_init)
            g_k = torch.bmm(g_scores.transpose(1, 2), q_c)                     # (BHN, C, M)
            del g_scores
            g_k.baddbmm_(v_c, g_S_after.transpose(1, 2))
            g_v = torch.bmm(scores.transpose(1, 2), g_o)                       # (BHN, C, Dv)
            g_v.baddbmm_(k_c, g_S_after)
            del g_S_after
            qz = _chunk_buffer(phi_q, BH, N, M)
            if g_den is not None:
                torch.bmm(q_c.transpose(1, 2), g_den.unsqueeze(-1), out=qz[: BH * N].unsqueeze(-1))
            else:
                qz.zero_()
            gz_init = None if g_z is None else g_z.reshape(BH, M)
            g_z_after, g_z0 = _exclusive_suffix_(qz, BH, N, gz_init)
            g_k.add_(g_z_after.unsqueeze(1))
            del g_z_after
            return (_unchunk(g_q, B, H, T), _unchunk(g_k, B, H, T), _unchunk(g_v, B, H, T),
                    g_S0.view(B, H, M, Dv), g_z0.view(B, H, M))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        # Reached only by a second derivative (create_graph=True, torch.func.hessian, ...): refuse it
        # loudly rather than let autograd treat these gradients as constants.
        raise RuntimeError(NO_SECOND_DERIVATIVE)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(NO_SECOND_DERIVATIVE)

    @staticmethod
    def vmap(info, in_dims, g_out, g_S, g_z, phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before,
             normalize, C, T):
        V = info.batch_size
        tensors = (g_out, g_S, g_z, phi_q, phi_k, v, y_all, den, den_ok, scores, S_before, z_before)
        args = [_fold(x, d, V) for x, d in zip(tensors, in_dims[:12])]
        out = _ChunkwiseLinearAttentionBackward.apply(*args, normalize, C, T)
        return tuple(_unfold(o, V) for o in out), (0,) * len(out)


def _normaliser_states(k_c: Tensor, BH: int, N: int, M: int, z0: Optional[Tensor],
                       final_shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """z before each chunk (BH * N, M) and after the last one, from the chunks' key features."""
    zs = _chunk_buffer(k_c, BH, N, M)
    torch.sum(k_c, dim=1, out=zs[1:])                                      # per-chunk Σ φ(k)
    return _exclusive_prefix_(zs, BH, N, z0, final_shape)


def _chunks(phi_q: Tensor, phi_k: Tensor, v: Tensor, n_chunks: int, C: int):
    """(B, H, N*C, ·) -> (B*H*N, C, ·), views of contiguous inputs."""
    return (phi_q.reshape(n_chunks, C, phi_q.shape[-1]), phi_k.reshape(n_chunks, C, phi_k.shape[-1]),
            v.reshape(n_chunks, C, v.shape[-1]))


def _unchunk(x: Tensor, B: int, H: int, T: int) -> Tensor:
    """(B*H*N, C, ·) -> (B, H, T, ·), dropping the zero padding of a ragged tail."""
    x = x.view(B, H, -1, x.shape[-1])
    return x if x.shape[2] == T else x[:, :, :T].contiguous()


HEAD_BLOCK_CHUNKS = 64
"""Chunks per block of :func:`_forward_by_head`: its workspaces hold this many chunks of one head."""
BY_HEAD_MIN_CHUNKS = 128
"""From this many chunks per head on, a call that needs no gradient runs :func:`_forward_by_head` on the CPU
(below it the whole-sequence products of the Function were as fast, in fewer and larger calls)."""
BY_HEAD_MIN_SIZE = 32
"""... and only where ``chunk_size``, ``M`` and ``Dv`` are all at least this: with smaller products the Python
cost of a loop over heads outweighs them (24x slower than the Function with 1,024 heads of C = 1, M = Dv = 4)."""


def _forward_by_head(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor], z0: Optional[Tensor],
                     normalize: bool, eps: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The forward alone, for calls that need no gradient: :class:`_ChunkwiseLinearAttention`'s products, one
    head and up to :data:`HEAD_BLOCK_CHUNKS` chunks at a time.

    Its workspaces (the scores and the states before each chunk) hold one block of one head and are reused, where
    the Function's hold the whole sequence of every head (it saves them for the backward); the normalisers, ``M``
    numbers per chunk, come from the Function's own :func:`_normaliser_states`. The states are summed in the
    Function's order; the products run on fewer matrices at a time, so results may
    differ from the Function's in the last bits. Same arguments and results as :func:`chunkwise_linear_attention`.
    """
    B, H, T, M = phi_q.shape
    Dv = v.shape[-1]
    with no_autocast(phi_q.device):
        phi_q, phi_k, v, C, N = _padded_to_chunks(phi_q, phi_k, v, chunk_size)
        BH = B * H
        q4, k4, v4 = phi_q.view(BH, N, C, M), phi_k.view(BH, N, C, M), v.view(BH, N, C, Dv)
        y = phi_q.new_empty(B, H, N * C, Dv)
        y4 = y.view(BH, N, C, Dv)
        G = min(N, HEAD_BLOCK_CHUNKS)
        S = phi_q.new_empty(G + 1, M, Dv)      # row 0: the state before the block; row c + 1: after its chunk c
        scores = phi_q.new_empty(G, C, C)
        den = phi_q.new_empty(G, C, 1)
        S_final = phi_q.new_empty(B, H, M, Dv)
        S_last = S_final.view(BH, M, Dv)
        S0_ = None if S0 is None else S0.reshape(BH, M, Dv)
        z_before, z_final = _normaliser_states(phi_k.view(BH * N, C, M), BH, N, M,
                                               None if z0 is None else z0.reshape(BH, M), (B, H, M))
        z_before = z_before.view(BH, N, M)                                  # M numbers per chunk: kept whole
        for h in range(BH):
            for g0 in range(0, N, G):
                n = min(G, N - g0)
                if g0:                               # the state after the previous block (n was G there)
                    S[0].copy_(S[G])
                elif S0_ is None:                    # the state before the first chunk
                    S[0].zero_()
                else:
                    S[0].copy_(S0_[h])
                q_c, k_c, v_c = q4[h, g0 : g0 + n], k4[h, g0 : g0 + n], v4[h, g0 : g0 + n]
                torch.bmm(k_c.transpose(1, 2), v_c, out=S[1 : n + 1])          # per-chunk φ(K_c)ᵀV_c
                for c in range(1, n + 1):                                      # S[c]: the state before chunk c,
                    S[c] += S[c - 1]                                           # summed in the Function's order
                a = torch.bmm(q_c, k_c.transpose(1, 2), out=scores[:n]).tril_()   # (n, C, C)
                out = torch.bmm(q_c, S[:n], out=y4[h, g0 : g0 + n])            # earlier chunks
                out.baddbmm_(a, v_c)                                           # + this chunk
                if normalize:
                    d = torch.bmm(q_c, z_before[h, g0 : g0 + n].unsqueeze(-1), out=den[:n])   # (n, C, 1)
                    d.add_(a.sum(-1, keepdim=True))
                    out.div_(safe_normaliser(d, eps))
            S_last[h].copy_(S[n])
        if N * C != T:
            y = y[:, :, :T].clone()                 # a tensor of its own, not a view
    return y, S_final, z_final


def _by_head(chunk_size: int, phi_q: Tensor, *tensors: Optional[Tensor]) -> bool:
    """Whether :func:`chunkwise_linear_attention` runs :func:`_forward_by_head`: on the CPU, with at least
    :data:`BY_HEAD_MIN_CHUNKS` chunks per head and chunks, features and values of at least
    :data:`BY_HEAD_MIN_SIZE`, when no gradient is needed (grad mode off, or no tensor
    requiring one) and autograd need not see every op (``torch.compile``, ``torch.func``, forward-mode AD)."""
    if phi_q.device.type != "cpu" or -(-phi_q.shape[2] // chunk_size) < BY_HEAD_MIN_CHUNKS:
        return False
    if min(chunk_size, phi_q.shape[3], tensors[1].shape[3]) < BY_HEAD_MIN_SIZE:         # tensors: k, v, S0, z0
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (phi_q, *tensors)):
        return False
    return not autograd_must_see_every_op(phi_q, *tensors)


def chunkwise_linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Optional[Tensor] = None,
                               z0: Optional[Tensor] = None, *, normalize: bool = True, eps: float = 1e-6,
                               chunk_size: int = 64) -> tuple[Tensor, Tensor, Tensor]:
    """Fast chunkwise causal linear attention on features (what ``method="chunk"`` runs).

    Parameters
    ----------
    phi_q, phi_k : Tensor
        ``(B, H, T, M)`` features, float32 or float64.
    v : Tensor
        ``(B, H, T, Dv)`` values, same dtype.
    S0, z0 : Tensor, optional
        ``(B, H, M, Dv)`` and ``(B, H, M)``: the state before the first token (zeros if None).
    normalize : bool
        Divide by the normaliser ``φ(q_i)ᵀz_i`` (see :func:`linattn._numerics.guarded_normaliser` for a zero,
        negative or non-finite one).
    eps : float
        What a zero, negative or non-finite normaliser is replaced by.
    chunk_size : int
        Tokens per chunk; ``T`` need not be a multiple.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)``.
    S, z : Tensor
        The state after the last token, ``(B, H, M, Dv)`` and ``(B, H, M)``, contiguous
        tensors of their own.

    Notes
    -----
    A call on the CPU that needs no gradient, with at least :data:`BY_HEAD_MIN_CHUNKS` chunks per head (and
    ``chunk_size``, ``M``, ``Dv`` of at least :data:`BY_HEAD_MIN_SIZE`), runs
    :func:`_forward_by_head`: the same products one head at a time, in workspaces of one block of chunks
    instead of tensors of the whole sequence kept for a backward pass.
    """
    phi_q, phi_k, v = phi_q.contiguous(), phi_k.contiguous(), v.contiguous()
    run = (_forward_by_head if _by_head(chunk_size, phi_q, phi_k, v, S0, z0)
           else _chunkwise_function(phi_q, phi_k, v, S0, z0).apply)
    if not compiling():
        out = run(phi_q, phi_k, v, S0, z0, normalize, eps, chunk_size)
        if all_finite(out[1], out[2]):
            return out[0], out[1], out[2]
    # A NaN/inf somewhere (or torch.compile, which cannot branch on that): keep it causal.
    poison = CausalPoison(phi_q, phi_k, v)
    out = run(poison.q, poison.k, poison.v, S0, z0, normalize, eps, chunk_size)
    return poison.outputs(out[0]), poison.state(out[1]), poison.normaliser(out[2])
