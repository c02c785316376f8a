"""The pieces the operator families share (private): validation, chunking, the scan, range sums.

See :mod:`linattn.ops` for the families and the ideas their chunk forms share.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._numerics import CausalPoison, all_finite, compiling, no_autocast
from ..feature_maps import resolve_feature_map

METHODS = ("auto", "chunk", "recurrent")

Result = Union[Tensor, tuple[Tensor, Tensor]]


# --------------------------------------------------------------------------- validation


class Prepared:
    """Checked arguments: features φ(q), φ(k) and v in the accumulation dtype, and the rest."""

    __slots__ = ("q", "k", "v", "S0", "acc", "method", "chunk_size", "return_state")


def prepare(name, q, k, v, method, chunk_size, feature_map, initial_state, return_state) -> Prepared:
    _checks.check_qkv(q, k, v, causal=True, causal_only=name)
    p = Prepared()
    p.return_state = _checks.check_bool(return_state, "return_state")
    p.chunk_size = _checks.check_chunk_size(chunk_size)
    p.method = resolve_method(method)
    p.acc = _checks.accumulation_dtype(q.dtype)
    phi = resolve_feature_map(feature_map)
    _checks.check_position_dependent(phi, causal=True, resumed=initial_state is not None, same_length=True,
                                     caller=name)
    with no_autocast(q.device):
        p.q, p.k = _checks.apply_feature_map(phi, q.to(p.acc), k.to(p.acc))  # (B, H, T, Dk)
    p.v = v.to(p.acc)                                                       # (B, H, T, Dv)
    B, H, _, Dk = p.k.shape
    p.S0 = check_state(initial_state, (B, H, Dk, v.shape[-1]), p.acc, q.device)
    return p


def resolve_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {_checks.type_name(method)}")
    name = method.strip().lower()
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(map(repr, METHODS))}")
    return "chunk" if name == "auto" else name


def check_state(state, expected: tuple[int, ...], acc: torch.dtype, device) -> Optional[Tensor]:
    """``initial_state`` is None or a floating (B, H, Dk, Dv) tensor on the inputs' device."""
    if state is None:
        return None
    if not isinstance(state, Tensor):
        raise TypeError(
            f"initial_state must be a torch.Tensor S of shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"or None, got {_checks.type_name(state)} (a LinearAttentionState belongs to linear_attention)"
        )
    if not state.is_floating_point():
        raise TypeError(f"initial_state must be a floating-point tensor, got dtype {state.dtype}")
    if tuple(state.shape) != expected:
        raise ValueError(
            f"initial_state must have shape (B, H, Dk, Dv) = {_checks.shape_str(expected)} "
            f"(Dk: key features after feature_map), got {_checks.shape_str(state.shape)}"
        )
    if state.device != device:
        raise ValueError(f"initial_state is on {state.device} but the inputs are on {device}")
    return state.to(acc)


def check_like_q(x, name: str, expected: tuple[int, ...], layout: str, q: Tensor, extra: str = "") -> None:
    """``x`` is a tensor of shape ``expected`` with q's dtype and device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout} = {_checks.shape_str(expected)}, "
                        f"got {_checks.type_name(x)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}; they must match")
    if tuple(x.shape) != expected:
        raise ValueError(
            f"{name} must have shape {layout} = {_checks.shape_str(expected)}{extra}, "
            f"got {_checks.shape_str(x.shape)}"
        )
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}")


def run(p: "Prepared", recurrent: Callable[[], tuple[Tensor, Tensor]],
        chunk: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """The chosen algorithm; the chunk form ``chunk(q, k, v) -> (out, S)`` keeps non-finite values causal.

    A NaN or infinity in a later value or key of a chunk would reach the earlier rows through
    the zeros of the chunk's causal masks (``0 · NaN = NaN``); it also makes the final state
    non-finite. So the chunk form runs as usual, and only if its final state is not finite
    again on sanitised inputs, whose outputs and state then get NaN exactly where they depend on
    a non-finite input (:class:`linattn._numerics.CausalPoison`): the positions before the first
    non-finite input get bit for bit the outputs of finite inputs. Under ``torch.compile``, which
    cannot branch on the check, the sanitised computation always runs.
    """
    if p.method == "recurrent":
        return recurrent()
    if not compiling():
        out, S = chunk(p.q, p.k, p.v)
        if all_finite(S):
            return out, S
    poison = CausalPoison(p.q, p.k, p.v)
    out, S = chunk(poison.q, poison.k, poison.v)
    return poison.outputs(out), poison.state(S)


def finish(out: Tensor, S: Tensor, dtype: torch.dtype, return_state: bool) -> Result:
    """The output in the input dtype, and the state (contiguous, memory of its own) if asked for."""
    out = out.to(dtype)
    return (out, S.contiguous()) if return_state else out



# --------------------------------------------------------------------------- recurrent forms


def zeros_state(k: Tensor, v: Tensor, S0: Optional[Tensor]) -> Tensor:
    B, H, _, Dk = k.shape
    return S0 if S0 is not None else k.new_zeros(B, H, Dk, v.shape[-1])


def read(q_t: Tensor, S: Tensor) -> Tensor:
    """``S_tᵀ q_t``: (B, H, Dk) and (B, H, Dk, Dv) -> (B, H, Dv)."""
    return (q_t.unsqueeze(-2) @ S).squeeze(-2)


# --------------------------------------------------------------------------- chunking


def to_chunks(x: Tensor, N: int, C: int) -> Tensor:
    """(B, H, T, ·) -> (B, H, N, C, ·), zero-padding the tail of a ragged last chunk."""
    T = x.shape[2]
    if N * C != T:
        x = F.pad(x, (0, 0, 0, N * C - T))
    return x.reshape(*x.shape[:2], N, C, x.shape[-1])


def from_chunks(x: Tensor, T: int) -> Tensor:
    """(B, H, N, C, ·) -> (B, H, T, ·), dropping the padding."""
    x = x.reshape(x.shape[0], x.shape[1], -1, x.shape[-1])
    return x if x.shape[2] == T else x[:, :, :T]


def scan(S0: Tensor, step: Callable[..., Tensor], *per_chunk: Tensor) -> tuple[Tensor, Tensor]:
    """States before each chunk (B, H, N, Dk, Dv) and after the last, by ``S <- step(S, *x[:, :, n])``.

    The per-chunk tensors ``(B, H, N, ...)`` are split with ``unbind`` once: indexing
    ``x[:, :, n]`` inside the loop would make autograd write a zero tensor of ``x``'s full
    size for every chunk in the backward pass (``T/C`` times the size of ``x``).
    """
    S, before = S0, []
    for xs in zip(*(x.unbind(2) for x in per_chunk)):
        before.append(S)
        S = step(S, *xs)
    return torch.stack(before, dim=2), S


def num_chunks(T: int, chunk_size: int) -> tuple[int, int]:
    C = min(chunk_size, T)           # a chunk longer than the sequence would only add padding
    return C, -(-T // C)


class SegmentSums:
    """0/1 matrices that sum log-gates over index ranges, by matmul along the token axis.

    A matmul with a 0/1 matrix adds exactly the terms of each range (the zeros add
    nothing), so every range sum is computed from its own terms: exact to rounding, with
    no difference of two cumulative sums, and an empty range is a constant 0 that does
    not depend on the gates (so no gradient flows through a factor of exactly 1). This is
    the "segsum" of Mamba-2 (Dao & Gu, 2024), written as matmuls, which on the CPU run
    several times faster than a cumulative sum along a strided axis.

    With ``L`` tokens per sub-chunk, ``n`` sub-chunks and ``Cp = n·L`` tokens per chunk:

    - ``inclusive`` ``(L, L)``: ``r <= t``; ``after`` ``(L, L)``: ``r > s`` (to the sub-chunk's end);
    - ``between`` ``(n·n, n)``: row ``(i, j)`` sums the sub-chunks ``m`` with ``j < m < i``;
    - ``earlier`` ``(n, n, 1, 1)`` 0/1: ``j < i``;
    - ``earlier_total`` ``(n, n)``: sub-chunks ``m < i``; ``later_total`` ``(n, n)``: ``m > j``;
    - ``earlier_tokens`` ``(n·L, n·L)`` 0/1: the sub-chunk of ``s`` is before that of ``t``.
    """

    def __init__(self, L: int, n: int, dtype: torch.dtype, device) -> None:
        def tri(size: int, diagonal: int, upper: bool = False) -> Tensor:
            ones = torch.ones(size, size, dtype=dtype, device=device)
            return ones.triu(diagonal) if upper else ones.tril(diagonal)

        self.inclusive = tri(L, 0)
        self.after = tri(L, 1, upper=True)
        i, j, m = (torch.arange(n, device=device).view(*shape) for shape in ((n, 1, 1), (1, n, 1), (1, 1, n)))
        self.between = ((j < m) & (m < i)).to(dtype).view(n * n, n)
        self.earlier = (j < i).to(dtype).view(n, n, 1, 1)
        self.earlier_total = tri(n, -1)
        self.later_total = tri(n, 1, upper=True)
        # (n·L, n·L) 0/1: token s lies in an earlier sub-chunk than token t (the off-diagonal blocks)
        self.earlier_tokens = self.earlier.view(n, n).repeat_interleave(L, 0).repeat_interleave(L, 1)


def subchunk_length(C: int) -> int:
    """Sub-chunk length ``L`` of the per-channel gated chunk forms (GLA, gated delta): ``min(C, 16)``.

    Each sub-chunk builds its ``(L, L)`` scores row by row (``~L/2 · Dk`` products per
    token), pairs of sub-chunks of a chunk a ``(C/L, C, Dk)`` tensor per chunk (``(C/L) · Dk``
    per token). Measured for GLA on CPU (1 thread, T = 4096, H = 4, D = 64) at ``C = 64``:
    ``L = 16`` forward 40 ms, ``8`` 45 ms, ``32`` 50 ms, ``4`` 98 ms; forward+backward 155, 196,
    206 and 274 ms.
    """
    return min(C, 16)


# The per-channel chunk forms clamp log-gates from below at this value before summing them
# over ranges. Without the clamp, float32 sums of accepted log-gates such as -1e38 overflow
# to -inf, and the 0/1 range-sum matmuls (SegmentSums) then form -inf · 0 = NaN. Why -1000:
# - exp(-1000) is exactly 0 in float32 (exp underflows to 0 below about -103.97, subnormals
#   included) and in float64 (below about -745.13), the two dtypes the chunk forms compute in.
#   Every exponent is a sum of non-positive log-gates, and rounding is monotone, so a range
#   that holds a clamped entry sums to <= -1000 with or without the clamp: its factor is
#   exactly 0 either way. The result is bit-identical to the unclamped computation whenever
#   that one did not overflow, i.e. for every realistic input.
# - A sum of C entries >= -1000 is >= -1000·C, finite in float32 for any C < 3.4e35: no
#   chunk length can overflow it.
# - Below the clamp the gradient of log_g is exactly 0 (clamp passes none), as it is in the
#   recurrent form, where d exp(log_g)/d log_g = exp(log_g) underflows to 0 as well.
LOG_G_FLOOR = -1000.0


class ChunkDecay:
    """The decay factors of a chunk with per-channel log-gates, every one an exp of a range sum <= 0.

    ``g`` is ``(B, H, N, Cp, Dk)``: log-gates of ``N`` chunks of ``Cp = n·L`` tokens (``n``
    sub-chunks of ``L``), or ``(…, Cp, 1)`` for one gate per head (broadcast over channels).
    With ``b`` the cumulative log-gate, the attributes are (``t``, ``s`` tokens of a chunk):

    - ``from_start`` ``(…, Cp, Dk)``: ``exp(b_t − b_start)``, the decay from the chunk's start
      to ``t`` (inclusive of ``t``): what a query reading the chunk's start state carries;
    - ``to_end`` ``(…, Cp, Dk)``: ``exp(b_end − b_s)``, from ``s`` (exclusive) to the chunk's end:
      what a key entering the next state carries;
    - ``total`` ``(…, Dk)``: ``exp(b_end − b_start)``, the decay of the whole chunk;

    and :meth:`scores` forms ``A[t, s] = Σ_d x_td y_sd exp(b_td − b_sd)`` for ``s <= t``.
    Each factor is a product of exps of sums over disjoint ranges (from the query's sub-chunk
    start, the totals of the sub-chunks in between, to the key's sub-chunk end), each sum
    computed from its own terms by :class:`SegmentSums`; inside a sub-chunk the factors are
    products of the gates ``exp(g_r) <= 1``, built row by row.
    """

    def __init__(self, g: Tensor, L: int) -> None:
        *lead, Cp, Dk = g.shape
        self.L, self.n = L, Cp // L
        self.sums = sums = SegmentSums(L, self.n, g.dtype, g.device)
        self.g_s = g_s = g.reshape(*lead, self.n, L, Dk)                          # (…, n, L, Dk)
        self.incl = (sums.inclusive @ g_s).exp()                                  # (…, n, L, Dk): from sub-chunk start
        self.after = (sums.after @ g_s).exp()                                     # (…, n, L, Dk): to sub-chunk end
        self.totals = totals = g_s.sum(-2)                                        # (…, n, Dk)
        start = (sums.earlier_total @ totals).exp().unsqueeze(-2)                 # (…, n, 1, Dk)
        end = (sums.later_total @ totals).exp().unsqueeze(-2)                     # (…, n, 1, Dk)
        self.from_start = (self.incl * start).reshape(*lead, Cp, Dk)
        self.to_end = (self.after * end).reshape(*lead, Cp, Dk)
        self.total = totals.sum(-2).exp()                                         # (…, Dk)
        self.pair = None
        if self.n > 1:                                # [i, j]: exp(Σ of the sub-chunks strictly between)
            between = (sums.between @ totals).reshape(*lead, self.n, self.n, 1, Dk)
            self.pair = between.exp() * sums.earlier                              # (…, n(i), n(j), 1, Dk)

    def scores(self, x: Tensor, y: Tensor, *, strict: bool = False) -> Tensor:
        """``(…, Cp, Cp)``: ``Σ_d x_td y_sd exp(b_td − b_sd)`` for ``s <= t`` (``s < t`` if ``strict``), else 0.

        ``x``, ``y`` are ``(…, Cp, Dk)``, finite. The entries above the diagonal are exact zeros,
        never products with later tokens' values (which could overflow).
        """
        *lead, Cp, Dk = x.shape
        n, L = self.n, self.L
        x_s, y_s = x.reshape(*lead, n, L, Dk), y.reshape(*lead, n, L, Dk)
        # Diagonal sub-chunk blocks, row by row: W_t = [W_{t-1} ⊙ g_t ; y_t] holds the keys s <= t
        # of the sub-chunk decayed to t, y_s ⊙ Π_{s<r<=t} exp(g_r) (a product of the gates in the
        # range, each <= 1: no exp of a positive number, no difference of sums). Row t is W_t x_t.
        # (The tokens are split with unbind once: slicing inside the loop would make autograd
        # write a zero tensor of the full size for every slice in the backward pass.)
        gates, y_t, x_t = (z.unsqueeze(-2).unbind(-3) for z in (self.g_s.exp(), y_s, x_s))
        W = y_t[0]                                                                # (…, n, 1, Dk)
        rows = [F.pad((W * x_t[0]).sum(-1), (0, L - 1))]                          # (…, n, L)
        for t in range(1, L):
            W = torch.cat([W * gates[t], y_t[t]], dim=-2)                         # (…, n, t+1, Dk)
            rows.append(F.pad((W * x_t[t]).sum(-1), (0, L - 1 - t)))
        diag = torch.stack(rows, dim=-2)                                          # (…, n, L(t), L(s))
        if strict:
            diag = diag.masked_fill(torch.eye(L, dtype=torch.bool, device=x.device), 0.0)
        eye_n = torch.eye(n, dtype=torch.bool, device=x.device).view(n, 1, n, 1)
        A = torch.where(eye_n, diag.unsqueeze(-2), 0.0)                           # (…, n, L, n, L) block diagonal
        if n > 1:
            # Blocks between sub-chunks (key in sub-chunk j < i): x ⊙ from-sub-chunk-start times
            # y ⊙ to-sub-chunk-end times the sub-chunks in between.
            x_rel = x_s * self.incl                                               # (…, n, L, Dk)
            y_rel = ((y_s * self.after).unsqueeze(-4) * self.pair)                # (…, n(i), n(j), L, Dk)
            off = x_rel @ y_rel.reshape(*lead, n, n * L, Dk).transpose(-1, -2)    # (…, n(i), L, n·L)
            A = A + off.reshape(*lead, n, L, n, L)
        return A.reshape(*lead, Cp, Cp)
