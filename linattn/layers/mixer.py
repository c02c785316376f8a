"""The modern linear token mixer: decay, gates and the delta rule with the pieces today's models use."""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .. import _checks
from .._checks import shape_str
from .._numerics import LOG_G_FLOOR, no_autocast
from ..ops.delta import delta_rule
from ..ops.gated_delta import gated_delta_rule
from ..ops.gla import gated_linear_attention
from ..ops.retention import retention
from ..ops.varlen import check_cu_seqlens
from ..state import MixerState
from .projections import GroupedHeads, check_head_sizes
from .short_conv import ShortConvolution

__all__ = ["RULES", "DELTA_RULES", "LinearMixer", "retnet_log_gammas"]

RULES = ("retention", "gla", "delta", "gated_delta", "kda")
_OPS = {"retention": retention, "gated_linear_attention": gated_linear_attention, "delta_rule": delta_rule,
        "gated_delta_rule": gated_delta_rule}
DELTA_RULES = ("delta", "gated_delta", "kda")          # the rules with a writing strength β

GLA_GATE_RANK = 16          # GLA's low-rank gate projection (Yang et al., 2024)
GLA_GATE_NORMALIZER = 16.0  # ... and its temperature τ: log α = logsigmoid(·) / τ
NORM_EPS = 1e-5             # the output RMSNorm's ε
L2_EPS = 1e-6               # F.normalize's ε for q and k


def retnet_log_gammas(n_heads: int, *, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """``log γ_h`` of RetNet's decays ``γ_h = 1 − 2^(−5−h)``, ``h = 0 .. n_heads − 1``.

    Parameters
    ----------
    n_heads : int
        Number of heads, ``>= 1``.
    dtype, device
        Of the result (floating ``dtype``).

    Returns
    -------
    Tensor
        ``(n_heads,)``, ``log1p(−2^(−5−h))`` (accurate where ``γ`` itself rounds to 1).

    Raises
    ------
    TypeError
        A non-int ``n_heads``.
    ValueError
        ``n_heads < 1``.
    """
    h = torch.arange(_checks.check_positive_int(n_heads, "n_heads"), dtype=dtype, device=device)
    return torch.log1p(-torch.exp2(-5.0 - h))


def _mamba2_dt_bias(n: int) -> Tensor:
    """Mamba-2's ``dt_bias``: the inverse softplus of ``dt`` drawn log-uniformly from [0.001, 0.1]."""
    dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))                              # softplus(dt_bias) = dt


def _mamba2_a_log(n: int) -> Tensor:
    """Mamba-2's ``A_log``: ``log A`` with ``A`` drawn from U(1, 16)."""
    return torch.empty(n).uniform_(1.0, 16.0).log()


class LinearMixer(GroupedHeads, nn.Module):
    """A multi-head causal token mixer with a matrix-valued state: the modern linear layer.

    Per token ``x_t`` (``(B, T, d_model)`` in, ``(B, T, d_model)`` out)::

        q, k, v = W_q x, W_k x, W_v x                       # H, H_k, H_v heads of Dk, Dk, Dv
        q, k, v = silu(conv(q, k, v))                                 # short_conv, one conv over all three
        q, k = q / ‖q‖, k / ‖k‖                                       # qk_norm (per head)
        q = q · Dk^(-1/2)
        S_t = rule(S_{t-1}; k_t, v_t, α_t, β_t),   o_t = S_tᵀ q_t    # S: (Dk, Dv) per value head
        o_t = RMSNorm(o_t) ⊙ act(W_g x_t)                             # output_norm, output_gate
        y_t = W_o o_t

    Two groupings of heads: ``n_kv_heads < n_heads`` (grouped-query: query head ``h`` reads
    key-value head ``h // (H / H_kv)``) or ``n_v_heads > n_heads`` (grouped value heads, Qwen3-Next:
    value head ``j`` reads query/key head ``j // (H_v / H)``, and ``α``, ``β``, the state, the norm
    and the gate are per value head). Each value head keeps one state, ``(Dk, Dv)``.

    Parameters
    ----------
    d_model, n_heads : int
        Model width and query heads ``H``.
    rule : str
        One of :data:`RULES`.
    n_kv_heads : int, optional
        Key-value heads ``H_kv`` dividing ``n_heads`` (default ``n_heads``).
    n_v_heads : int, optional
        Value heads ``H_v``, a multiple of ``n_heads`` (default ``n_heads``); not with
        ``n_kv_heads != n_heads``.
    head_dim : int, optional
        Query/key head size ``Dk`` (default ``d_model // n_heads``, which must then divide).
    v_head_dim : int, optional
        Value head size ``Dv`` (default ``head_dim``).
    short_conv : bool
        Short convolution and SiLU on ``q``, ``k``, ``v`` (default True).
    conv_size : int
        Its kernel size ``K >= 2`` (default 4).
    qk_norm : bool or str
        L2-normalise ``q`` and ``k`` per head (default True: ``x / max(‖x‖, 1e-6)``, as
        ``F.normalize``); ``"fla"``: ``x / sqrt(‖x‖² + 1e-6)``, flash-linear-attention's and
        transformers' ``l2norm``. Without it the delta rules can be unstable (``I − β k kᵀ`` may
        grow the state).
    negative_eigenvalues : bool
        ``β ∈ (0, 2)`` instead of ``(0, 1)`` (default False); only for the delta rules.
    output_norm : bool
        Per-head RMSNorm of ``o`` (learned weight of ``Dv``, shared by the heads).
    output_gate : bool or str
        Multiply by ``act(W_g x)``: True or ``"silu"`` (Gated DeltaNet), ``"sigmoid"`` (Kimi
        Linear), False for none.
    gate_rank : int, optional
        A low-rank gate ``W_g = W_up W_down`` of this rank (Kimi Linear: ``Dk``); default full rank.
    norm_eps : float
        The output RMSNorm's ε (default 1e-5; Qwen3-Next's configs use 1e-6).
    chunk_size : int
        Chunk length of the chunkwise forms (a call of one token runs the recurrence).
    bias : bool
        Biases in the ``q``, ``k``, ``v``, gate and output projections.

    Raises
    ------
    TypeError
        A size that is not an int, a flag that is not a bool, a ``rule`` that is not a str, a
        ``qk_norm`` or ``output_gate`` of another type, a ``norm_eps`` that is not a number.
    ValueError
        A size < 1, ``conv_size < 2``, ``d_model`` not divisible by ``n_heads`` without
        ``head_dim``, ``n_heads`` not divisible by ``n_kv_heads``, ``n_v_heads`` not a multiple
        of ``n_heads`` or given with ``n_kv_heads``, an unknown ``rule``, ``qk_norm`` or
        ``output_gate`` string, ``negative_eigenvalues=True`` with a rule that has no ``β``,
        ``gate_rank`` without an output gate, ``norm_eps`` not a normal positive float32 number.
    """

    def __init__(self, d_model: int, n_heads: int, *, rule: str = "gated_delta", n_kv_heads: Optional[int] = None,
                 n_v_heads: Optional[int] = None, head_dim: Optional[int] = None, v_head_dim: Optional[int] = None,
                 short_conv: bool = True, conv_size: int = 4, qk_norm: Union[bool, str] = True,
                 negative_eigenvalues: bool = False, output_norm: bool = True, output_gate: Union[bool, str] = True,
                 gate_rank: Optional[int] = None, norm_eps: float = NORM_EPS, chunk_size: int = 64,
                 bias: bool = False) -> None:
        super().__init__()
        d_model, n_heads, n_kv_heads, n_v_heads, Dk, Dv = _mixer_heads(d_model, n_heads, n_kv_heads, n_v_heads,
                                                                       head_dim, v_head_dim)
        if not isinstance(rule, str):
            raise TypeError(f"rule must be a str, one of {RULES}, got {_checks.type_name(rule)}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r} (chapter 8's normalised φ layer is "
                             "LinearAttention)")
        flags = {name: _checks.check_bool(value, name) for name, value in (
            ("short_conv", short_conv), ("negative_eigenvalues", negative_eigenvalues),
            ("output_norm", output_norm), ("bias", bias))}
        self.qk_norm = _choice(qk_norm, "qk_norm", {True: True, False: False, "fla": "fla"})
        self.gate_activation = _choice(output_gate, "output_gate",
                                       {True: "silu", False: None, "silu": "silu", "sigmoid": "sigmoid"})
        conv_size = _checks.check_positive_int(conv_size, "conv_size")
        if conv_size < 2:
            raise ValueError(f"conv_size must be >= 2 (a kernel of 1 mixes no tokens), got {conv_size}")
        if flags["negative_eigenvalues"] and rule not in DELTA_RULES:
            raise ValueError(f"negative_eigenvalues=True sets β in (0, 2), but rule={rule!r} has no β; it applies "
                             f"to the delta rules {DELTA_RULES}")
        if gate_rank is not None:
            gate_rank = _checks.check_positive_int(gate_rank, "gate_rank")
            if self.gate_activation is None:
                raise ValueError(f"gate_rank={gate_rank} sizes the output gate, but output_gate=False")
        self.norm_eps = _checks.check_positive_float(norm_eps, "norm_eps", torch.float32)
        self.d_model, self.n_heads, self.n_kv_heads, self.n_v_heads, self.rule = (d_model, n_heads, n_kv_heads,
                                                                                n_v_heads, rule)
        self.head_dim, self.v_head_dim, self.gate_rank = Dk, Dv, gate_rank
        self.group_size = n_heads // n_kv_heads                  # query heads per key-value head
        self.n_out_heads = max(n_heads, n_v_heads)               # heads of o: one per query or value head
        self.chunk_size = _checks.check_chunk_size(chunk_size)
        self.negative_eigenvalues = flags["negative_eigenvalues"]
        self.conv_size = conv_size
        Hk = n_kv_heads if n_v_heads <= n_heads else n_heads     # key heads
        self.q_proj = nn.Linear(d_model, n_heads * Dk, bias=flags["bias"])
        self.k_proj = nn.Linear(d_model, Hk * Dk, bias=flags["bias"])
        self.v_proj = nn.Linear(d_model, n_v_heads * Dv, bias=flags["bias"])
        channels = (n_heads + Hk) * Dk + n_v_heads * Dv
        self.conv = ShortConvolution(channels, conv_size) if flags["short_conv"] else None
        self.a_proj = self.b_proj = self.A_log = self.dt_bias = None     # the rule's gates, below
        Hv, per_channel = n_v_heads, n_v_heads * Dk
        if rule in DELTA_RULES:
            self.b_proj = nn.Linear(d_model, Hv, bias=False)                     # β per value head
        if rule == "gla":
            self.a_proj = nn.Sequential(nn.Linear(d_model, GLA_GATE_RANK, bias=False),
                                        nn.Linear(GLA_GATE_RANK, per_channel, bias=True))
        elif rule == "gated_delta":
            self.a_proj = nn.Linear(d_model, Hv, bias=False)
            self.A_log = nn.Parameter(_mamba2_a_log(Hv))
            self.dt_bias = nn.Parameter(_mamba2_dt_bias(Hv))
        elif rule == "kda":
            self.a_proj = nn.Sequential(nn.Linear(d_model, Dk, bias=False), nn.Linear(Dk, per_channel, bias=False))
            self.A_log = nn.Parameter(_mamba2_a_log(Hv))
            self.dt_bias = nn.Parameter(_mamba2_dt_bias(per_channel))
        self.o_norm = nn.Parameter(torch.ones(Dv)) if flags["output_norm"] else None
        width = self.n_out_heads * Dv
        self.g_proj = None
        if self.gate_activation is not None:
            self.g_proj = (nn.Linear(d_model, width, bias=flags["bias"]) if gate_rank is None else
                           nn.Sequential(nn.Linear(d_model, gate_rank, bias=False),
                                         nn.Linear(gate_rank, width, bias=flags["bias"])))
        self.out_proj = nn.Linear(width, d_model, bias=flags["bias"])

    def extra_repr(self) -> str:
        heads = (f"n_v_heads={self.n_v_heads}, " if self.n_v_heads > self.n_heads else "")
        sizes = f"head_dim={self.head_dim}" + (f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim
                                               else "")
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, {heads}{sizes}, "
                f"rule={self.rule!r}, qk_norm={self.qk_norm!r}, negative_eigenvalues={self.negative_eigenvalues}")

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[MixerState] = None, return_state: bool = False,
                conv_history: Optional[Tensor] = None, rule_ops: Optional[Mapping[str, Callable]] = None,
                cu_seqlens: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, MixerState]]:
        """Mix the tokens of ``x`` (after the tokens summarised by ``state``).

        Parameters
        ----------
        x, attention_mask : Tensor
            As in :meth:`linattn.LinearAttention.forward`.
            Padded tokens are removed: the real tokens' outputs and the returned state are
            those of the sequence without them (their own outputs are meaningless).
        state : MixerState, optional
            The state after earlier tokens, as returned by this layer: ``S`` ``(B, H_v, Dk, Dv)``
            (``H_v`` = ``n_kv_heads`` with grouped queries) and ``conv`` ``(B, C, conv_size − 1)``
            (None without short convolution), in float32 (float64 for float64 ``x``), on the
            device of ``x``; checked at every call.
        return_state : bool
            Also return the state after the last real token of ``x``.
        conv_history, rule_ops
            The hook of :mod:`linattn.distributed` (sequence parallelism): ``conv_history``
            ``(B, C, conv_size − 1)``, the convolution's inputs before ``x`` (another rank's last
            :meth:`conv_inputs`), in place of ``state.conv``; ``rule_ops``, functions called in
            place of :mod:`linattn.ops`' ``retention``, ``gated_linear_attention``, ``delta_rule``
            and ``gated_delta_rule`` (keyed by those names, with their arguments).
        cu_seqlens : Tensor, optional
            A packed batch (flash-linear-attention's meaning): ``x`` is ``(1, T, d_model)``, ``N``
            sequences end to end, ``cu_seqlens`` their ``N + 1`` offsets (1-D int32 or int64,
            from 0 to ``T``, empty sequences allowed); not with ``attention_mask``. Each
            sequence is mixed alone (the short convolution restarts at its first token), and
            ``state`` and the returned state hold one sequence each (leading ``N`` in place of
            ``B``; an empty sequence returns its initial state).

        Returns
        -------
        y : Tensor
            ``(B, T, d_model)``, dtype of ``x`` (under autocast, the autocast dtype of the
            output projection).
        state : MixerState
            Only if ``return_state``: float32 (float64 for float64 ``x``), sharing no memory
            with the inputs.

        Raises
        ------
        TypeError
            ``x`` not a floating tensor or not in the parameters' dtype; a non-bool mask or
            flag; a ``state`` that is not a ``MixerState`` or whose tensors are not in the
            state dtype above.
        ValueError
            ``x`` not ``(B, T, d_model)`` or empty; ``x`` not on the parameters' device; a
            mask that is not ``(B, T)``; a state whose shapes do not match the layer (or with
            ``conv`` None where the layer has a short convolution, or the reverse), or not on
            the device of ``x``; a NaN in ``x`` that reaches ``α`` or ``β`` (the functions of
            :mod:`linattn.ops` refuse a NaN gate; RuntimeError under ``torch.compile``);
            ``cu_seqlens`` with ``B != 1`` or with ``attention_mask``, not 1-D, or not offsets
            from 0 to ``T`` that never decrease (TypeError if not an int32/int64 tensor).
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        packing = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1], attention_mask)
        self._check_state(state, x, x.shape[0] if packing is None else packing.N)
        B, T, _ = x.shape
        Dk, Dv = self.head_dim, self.v_head_dim
        acc = _checks.accumulation_dtype(x.dtype)
        qkv = self.conv_inputs(x)                                         # (B, T, C), matmuls under autocast if on
        raw_a = self.a_proj(x) if self.a_proj is not None else None      # (B, T, H_v or H_v·Dk)
        raw_b = self.b_proj(x) if self.b_proj is not None else None      # (B, T, H_v)
        raw_g = self.g_proj(x) if self.g_proj is not None else None      # (B, T, H_o·Dv)
        with no_autocast(x.device):                                       # our own arithmetic: acc dtype
            conv_state = None
            if self.conv is not None:
                history = conv_history if conv_history is not None else None if state is None else state.conv
                qkv, conv_state = self.conv(qkv, attention_mask, history, cu_seqlens)
                qkv = F.silu(qkv)
            q, k, v = qkv.split([p.out_features for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
            q, k, v = _split_heads(q, Dk), _split_heads(k, Dk), _split_heads(v, Dv)   # (B, ·, T, Dk or Dv)
            if self.qk_norm:
                q, k = self._l2_normalize(q), self._l2_normalize(k)
            q = q * Dk ** -0.5
            log_g, beta = self._gates(raw_a, raw_b, acc)                  # (B, H_v, T[, Dk]), (B, H_v, T)
            if attention_mask is not None:                               # padded tokens change nothing
                real = attention_mask[:, None, :]                        # (B, 1, T)
                k, v = k.masked_fill(~real[..., None], 0.0), v.masked_fill(~real[..., None], 0.0)
                beta = None if beta is None else beta.masked_fill(~real, 0.0)
                if log_g is not None:
                    log_g = log_g.masked_fill(~(real if log_g.dim() == 3 else real[..., None]), 0.0)
            S0 = None if state is None else state.S.to(acc)               # (B, H_v, Dk, Dv)
            o, S = self._apply_rule(q, k, v, log_g, beta, S0, attention_mask, cu_seqlens,
                                    {**_OPS, **(rule_ops or {})})   # (B, H_o, T, Dv), (B or N, H_v, Dk, Dv)
            if self.o_norm is not None:
                o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + self.norm_eps) * self.o_norm.to(acc)
            if raw_g is not None:
                gate = _split_heads(raw_g.to(acc), Dv)                    # (B, H_o, T, Dv)
                o = o * (F.silu(gate) if self.gate_activation == "silu" else torch.sigmoid(gate))
            o = o.transpose(1, 2).reshape(B, T, self.n_out_heads * Dv).to(x.dtype)   # (B, T, H_o·Dv)
        y = self.out_proj(o)                                              # (B, T, d_model)
        if not return_state:
            return y
        return y, MixerState(S, conv_state)

    def conv_inputs(self, x: Tensor) -> Tensor:
        """What the short convolution reads: the ``q``, ``k``, ``v`` projections of ``x`` side by side,
        ``(B, T, C)`` (``C`` the convolution's channels) in float32 (float64 for float64 ``x``)."""
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]     # matmuls under autocast if on
        with no_autocast(x.device):
            return torch.cat([p.to(_checks.accumulation_dtype(x.dtype)) for p in projected], dim=-1)

    def _l2_normalize(self, t: Tensor) -> Tensor:
        """``t / max(‖t‖, ε)`` (``qk_norm=True``) or ``t / sqrt(‖t‖² + ε)`` (``"fla"``), per head."""
        if self.qk_norm == "fla":
            return t * torch.rsqrt(t.pow(2).sum(dim=-1, keepdim=True) + L2_EPS)
        return F.normalize(t, dim=-1, eps=L2_EPS)

    # ---- the rule ----------------------------------------------------------------------

    def _gates(self, raw_a, raw_b, acc) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """``log α`` ``(B, H_v, T)`` or ``(B, H_v, T, Dk)`` (None for delta and retention) and
        ``β`` ``(B, H_v, T)`` (None for retention and GLA), in ``acc``."""
        beta = None
        if raw_b is not None:
            beta = torch.sigmoid(raw_b.to(acc)).transpose(1, 2)          # (B, H_v, T) in (0, 1)
            if self.negative_eigenvalues:
                beta = 2.0 * beta                                        # (0, 2): Grazzi et al., 2025
        if self.rule == "gla":
            log_g = F.logsigmoid(_split_heads(raw_a.to(acc), self.head_dim)) / GLA_GATE_NORMALIZER  # (B, H_v, T, Dk)
        elif self.rule == "gated_delta":
            dt = F.softplus(raw_a.to(acc) + self.dt_bias.to(acc))        # (B, T, H_v)
            log_g = (-self.A_log.to(acc).exp() * dt).transpose(1, 2)     # (B, H_v, T)
        elif self.rule == "kda":
            dt = F.softplus(raw_a.to(acc) + self.dt_bias.to(acc))        # (B, T, H_v·Dk)
            A = self.A_log.to(acc).exp().repeat_interleave(self.head_dim)  # (H_v·Dk,): one A per head
            log_g = _split_heads(-A * dt, self.head_dim)                 # (B, H_v, T, Dk)
        else:
            return None, beta
        # exp(-1000) is 0 in float32 and float64 alike: an overflow to -inf gives the same α = 0
        return log_g.clamp(min=LOG_G_FLOOR), beta

    def _apply_rule(self, q, k, v, log_g, beta, S0, attention_mask, cu_seqlens, ops) -> tuple[Tensor, Tensor]:
        """``o = S_tᵀ q_t`` for every token ``(B, H_o, T, Dv)`` and the last ``S`` ``(B, H_v, Dk, Dv)``,
        through ``ops`` (:mod:`linattn.ops`' by default)."""
        G = self.group_size        # grouped values need nothing here: the ops read q/k head j // r themselves
        if G > 1:                  # grouped queries: each query head runs its key-value head's recurrence
            k, v, log_g, beta, S0 = (None if t is None else t.repeat_interleave(G, dim=1)
                                     for t in (k, v, log_g, beta, S0))
        o, S = self._run_op(q, k, v, log_g, beta, S0, attention_mask, cu_seqlens, ops)
        return o, (S if G == 1 else S[:, ::G].contiguous())          # one state per key-value head

    def _run_op(self, q, k, v, log_g, beta, S0, attention_mask, cu_seqlens, ops) -> tuple[Tensor, Tensor]:
        retention, gated_linear_attention, delta_rule, gated_delta_rule = (ops[name] for name in _OPS)
        options = dict(method="recurrent" if q.shape[2] == 1 else "chunk", chunk_size=self.chunk_size,
                       initial_state=S0, return_state=True)
        if cu_seqlens is not None:                                        # only then: a hook's ops need not know it
            options["cu_seqlens"] = cu_seqlens
        if self.rule == "retention":
            log_gamma = retnet_log_gammas(self.n_v_heads, dtype=q.dtype, device=q.device)
            log_gamma = log_gamma.repeat_interleave(self.group_size)     # (H,) per head the op runs
            if attention_mask is None:
                return retention(q, k, v, log_gamma.exp(), **options)
            # A fixed γ would still decay the state at a padded token: GLA with log α = 0 there.
            real = attention_mask[:, None, :, None]                       # (B, 1, T, 1)
            log_g = torch.where(real, log_gamma[:, None, None], 0.0)      # (B, H_v, T, 1)
            log_g = log_g.expand(*log_g.shape[:3], k.shape[-1])           # (B, H_v, T, Dk)
            return gated_linear_attention(q, k, v, log_g.contiguous(), **options)
        if self.rule == "gla":
            return gated_linear_attention(q, k, v, log_g, **options)
        if self.rule == "delta":
            return delta_rule(q, k, v, beta, **options)
        return gated_delta_rule(q, k, v, log_g, beta, **options)         # gated_delta and kda

    # ---- shapes, checks, sizes ---------------------------------------------------------

    def _check_state(self, state, x: Tensor, B: int) -> None:
        """Checked at every use (not only when the state was built: its attributes may have been replaced);
        ``B``: the sequences (of a packed batch, ``N``)."""
        if state is None:
            return
        if not isinstance(state, MixerState):
            raise TypeError(f"state must be a MixerState (or None) for LinearMixer, got {type(state).__name__}")
        state.validate()
        expected = (B, self.n_v_heads, self.head_dim, self.v_head_dim)
        if tuple(state.S.shape) != expected:
            heads = "n_v_heads" if self.n_v_heads > self.n_heads else "n_kv_heads"
            raise ValueError(f"state.S must have shape (batch, {heads}, head_dim, v_head_dim) = "
                             f"{shape_str(expected)}, got {shape_str(state.S.shape)}")
        if self.conv is None and state.conv is not None:
            raise ValueError("state.conv must be None: this layer has no short convolution (short_conv=False)")
        if self.conv is not None:
            conv_shape = (B, self.conv.channels, self.conv_size - 1)
            if state.conv is None:
                raise ValueError(f"state.conv is None but this layer's short convolution needs its last inputs, "
                                 f"(batch, channels, conv_size - 1) = {shape_str(conv_shape)}")
            if tuple(state.conv.shape) != conv_shape:
                raise ValueError(f"state.conv must have shape (batch, channels, conv_size - 1) = "
                                 f"{shape_str(conv_shape)}, got {shape_str(state.conv.shape)}")
        acc = _checks.accumulation_dtype(x.dtype)
        if state.S.dtype != acc:
            raise TypeError(f"state.S is {state.S.dtype} but a layer fed {x.dtype} keeps its state in {acc} "
                            "(the dtype of the states it returns)")
        if state.S.device != x.device:
            raise ValueError(f"state.S is on {state.S.device} but x is on {x.device}")

    def decoding_state_nbytes(self, seq_len: int = 0, batch: int = 1) -> int:
        """Bytes of the :class:`MixerState` after any number of tokens (``seq_len`` is not used:
        the size is fixed), for ``x`` in the parameters' dtype: ``S`` and the convolution's inputs."""
        acc = _checks.accumulation_dtype(self.q_proj.weight.dtype)
        numbers = self.n_v_heads * self.head_dim * self.v_head_dim
        if self.conv is not None:
            numbers += self.conv.channels * (self.conv_size - 1)
        return batch * numbers * torch.empty((), dtype=acc).element_size()


def _split_heads(t: Tensor, size: int) -> Tensor:
    """(B, T, n·size) -> (B, n, T, size)."""
    B, T, _ = t.shape
    return t.view(B, T, -1, size).transpose(1, 2)


def _choice(value, name: str, allowed: dict):
    """``allowed[value]`` for a bool or str ``value`` that is a key of ``allowed``."""
    if not isinstance(value, (bool, str)):
        raise TypeError(f"{name} must be a bool or one of {[k for k in allowed if isinstance(k, str)]}, "
                        f"got {_checks.type_name(value)}")
    if value not in allowed:
        raise ValueError(f"{name} must be True, False or one of {[k for k in allowed if isinstance(k, str)]}, "
                         f"got {value!r}")
    return allowed[value]


def _mixer_heads(d_model, n_heads, n_kv_heads, n_v_heads, head_dim, v_head_dim) -> tuple[int, ...]:
    """``d_model, H, H_kv, H_v, Dk, Dv`` as ints that divide as the heads need (defaults filled in)."""
    d_model = _checks.check_positive_int(d_model, "d_model")
    n_heads = _checks.check_positive_int(n_heads, "n_heads")
    if head_dim is None:
        d_model, n_heads, _ = check_head_sizes(d_model, n_heads, None)
        head_dim = d_model // n_heads
    head_dim = _checks.check_positive_int(head_dim, "head_dim")
    v_head_dim = head_dim if v_head_dim is None else _checks.check_positive_int(v_head_dim, "v_head_dim")
    kv = n_heads if n_kv_heads is None else _checks.check_positive_int(n_kv_heads, "n_kv_heads")
    if n_heads % kv:
        raise ValueError(f"n_heads must be divisible by n_kv_heads, got n_heads={n_heads} and n_kv_heads={kv}")
    if n_v_heads is None:
        return d_model, n_heads, kv, kv, head_dim, v_head_dim
    n_v_heads = _checks.check_positive_int(n_v_heads, "n_v_heads")
    if kv != n_heads:
        raise ValueError(f"n_v_heads (grouped value heads) and n_kv_heads (grouped queries) cannot both be set, "
                         f"got n_kv_heads={kv} and n_v_heads={n_v_heads} with n_heads={n_heads}")
    if n_v_heads % n_heads:
        raise ValueError(f"n_v_heads must be a multiple of n_heads (value head j reads query/key head "
                         f"j // (n_v_heads / n_heads)), got n_heads={n_heads} and n_v_heads={n_v_heads}")
    return d_model, n_heads, kv, n_v_heads, head_dim, v_head_dim
