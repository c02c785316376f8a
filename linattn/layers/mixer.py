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

        q, k, v = W_q x, W_k x, W_v x                       # n_heads, n_kv_heads, n_kv_heads heads
        q, k, v = silu(conv(q)), silu(conv(k)), silu(conv(v))        # short_conv
        q, k = q / ‖q‖, k / ‖k‖                                       # qk_norm (per head)
        q = q · head_dim^(-1/2)
        S_t = rule(S_{t-1}; k_t, v_t, α_t, β_t),   o_t = S_tᵀ q_t
        o_t = RMSNorm(o_t) ⊙ silu(W_g x_t)                            # output_norm, output_gate
        y_t = W_o o_t

    Parameters
    ----------
    d_model, n_heads : int
        As in :class:`linattn.LinearAttention`.
    rule : str
        One of :data:`RULES`.
    n_kv_heads : int, optional
        Key-value heads ``H_kv`` dividing ``n_heads`` (default ``n_heads``).
    short_conv : bool
        Short convolution and SiLU on ``q``, ``k``, ``v`` (default True).
    conv_size : int
        Its kernel size ``K >= 2`` (default 4).
    qk_norm : bool
        L2-normalise ``q`` and ``k`` per head (default True). Without it the delta rules can be
        unstable (``I − β k kᵀ`` may grow the state).
    negative_eigenvalues : bool
        ``β ∈ (0, 2)`` instead of ``(0, 1)`` (default False); only for the delta rules.
    output_norm : bool
        Per-head RMSNorm of ``o`` (learned weight of ``head_dim``, shared by the heads; ε = 1e-5).
    output_gate : bool
        Multiply by ``silu(W_g x)``.
    chunk_size : int
        Chunk length of the chunkwise forms (a call of one token runs the recurrence).
    bias : bool
        Biases in the ``q``, ``k``, ``v``, gate and output projections.

    Raises
    ------
    TypeError
        A size that is not an int, a flag that is not a bool, a ``rule`` that is not a str.
    ValueError
        A size < 1, ``conv_size < 2``, ``d_model`` not divisible by ``n_heads``, ``n_heads``
        not divisible by ``n_kv_heads``, an unknown ``rule``, ``negative_eigenvalues=True``
        with a rule that has no ``β``.
    """

    def __init__(self, d_model: int, n_heads: int, *, rule: str = "gated_delta", n_kv_heads: Optional[int] = None,
                 short_conv: bool = True, conv_size: int = 4, qk_norm: bool = True,
                 negative_eigenvalues: bool = False, output_norm: bool = True, output_gate: bool = True,
                 chunk_size: int = 64, bias: bool = False) -> None:
        super().__init__()
        d_model, n_heads, n_kv_heads = check_head_sizes(d_model, n_heads, n_kv_heads)
        if not isinstance(rule, str):
            raise TypeError(f"rule must be a str, one of {RULES}, got {_checks.type_name(rule)}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r} (chapter 8's normalised φ layer is "
                             "LinearAttention)")
        flags = {name: _checks.check_bool(value, name) for name, value in (
            ("short_conv", short_conv), ("qk_norm", qk_norm), ("negative_eigenvalues", negative_eigenvalues),
            ("output_norm", output_norm), ("output_gate", output_gate), ("bias", bias))}
        conv_size = _checks.check_positive_int(conv_size, "conv_size")
        if conv_size < 2:
            raise ValueError(f"conv_size must be >= 2 (a kernel of 1 mixes no tokens), got {conv_size}")
        if flags["negative_eigenvalues"] and rule not in DELTA_RULES:
            raise ValueError(f"negative_eigenvalues=True sets β in (0, 2), but rule={rule!r} has no β; it applies "
                             f"to the delta rules {DELTA_RULES}")
        self.d_model, self.n_heads, self.n_kv_heads, self.rule = d_model, n_heads, n_kv_heads, rule
        self.head_dim = D = d_model // n_heads
        self.group_size = n_heads // n_kv_heads
        self.chunk_size = _checks.check_chunk_size(chunk_size)
        self.qk_norm, self.negative_eigenvalues = flags["qk_norm"], flags["negative_eigenvalues"]
        self.conv_size = conv_size
        kv = n_kv_heads * D
        self.q_proj = nn.Linear(d_model, n_heads * D, bias=flags["bias"])
        self.k_proj = nn.Linear(d_model, kv, bias=flags["bias"])
        self.v_proj = nn.Linear(d_model, kv, bias=flags["bias"])
        self.conv = ShortConvolution(n_heads * D + 2 * kv, conv_size) if flags["short_conv"] else None
        self.a_proj = self.b_proj = self.A_log = self.dt_bias = None     # the rule's gates, below
        if rule in DELTA_RULES:
            self.b_proj = nn.Linear(d_model, n_kv_heads, bias=False)             # β per key-value head
        if rule == "gla":
            self.a_proj = nn.Sequential(nn.Linear(d_model, GLA_GATE_RANK, bias=False),
                                        nn.Linear(GLA_GATE_RANK, kv, bias=True))
        elif rule == "gated_delta":
            self.a_proj = nn.Linear(d_model, n_kv_heads, bias=False)
            self.A_log = nn.Parameter(_mamba2_a_log(n_kv_heads))
            self.dt_bias = nn.Parameter(_mamba2_dt_bias(n_kv_heads))
        elif rule == "kda":
            self.a_proj = nn.Sequential(nn.Linear(d_model, D, bias=False), nn.Linear(D, kv, bias=False))
            self.A_log = nn.Parameter(_mamba2_a_log(n_kv_heads))
            self.dt_bias = nn.Parameter(_mamba2_dt_bias(kv))
        self.o_norm = nn.Parameter(torch.ones(D)) if flags["output_norm"] else None
        self.g_proj = nn.Linear(d_model, n_heads * D, bias=flags["bias"]) if flags["output_gate"] else None
        self.out_proj = nn.Linear(n_heads * D, d_model, bias=flags["bias"])

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, rule={self.rule!r}, qk_norm={self.qk_norm}, "
                f"negative_eigenvalues={self.negative_eigenvalues}")

    @_checks.reject_key_padding_mask
    def forward(self, x: Tensor, *, attention_mask: Optional[Tensor] = None,
                state: Optional[MixerState] = None, return_state: bool = False,
                conv_history: Optional[Tensor] = None, rule_ops: Optional[Mapping[str, Callable]] = None
                ) -> Union[Tensor, tuple[Tensor, MixerState]]:
        """Mix the tokens of ``x`` (after the tokens summarised by ``state``).

        Parameters
        ----------
        x, attention_mask : Tensor
            As in :meth:`linattn.LinearAttention.forward`.
            Padded tokens are removed: the real tokens' outputs and the returned state are
            those of the sequence without them (their own outputs are meaningless).
        state : MixerState, optional
            The state after earlier tokens, as returned by this layer: ``S`` ``(B, n_kv_heads,
            head_dim, head_dim)`` and ``conv`` ``(B, C, conv_size − 1)`` (None without short
            convolution), in float32 (float64 for float64 ``x``), on the device of ``x``;
            checked at every call.
        return_state : bool
            Also return the state after the last real token of ``x``.
        conv_history, rule_ops
            The hook of :mod:`linattn.distributed` (sequence parallelism): ``conv_history``
            ``(B, C, conv_size − 1)``, the convolution's inputs before ``x`` (another rank's last
            :meth:`conv_inputs`), in place of ``state.conv``; ``rule_ops``, functions called in
            place of :mod:`linattn.ops`' ``retention``, ``gated_linear_attention``, ``delta_rule``
            and ``gated_delta_rule`` (keyed by those names, with their arguments).

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
            :mod:`linattn.ops` refuse a NaN gate; RuntimeError under ``torch.compile``).
        """
        attention_mask, return_state = self._check_inputs(x, attention_mask, return_state)
        self._check_state(state, x)
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        acc = _checks.accumulation_dtype(x.dtype)
        qkv = self.conv_inputs(x)                                         # (B, T, (H + 2 H_kv)·D)
        raw_a = self.a_proj(x) if self.a_proj is not None else None      # (B, T, H_kv or H_kv·D)
        raw_b = self.b_proj(x) if self.b_proj is not None else None      # (B, T, H_kv)
        raw_g = self.g_proj(x) if self.g_proj is not None else None      # (B, T, H·D)
        with no_autocast(x.device):                                       # our own arithmetic: acc dtype
            conv_state = None
            if self.conv is not None:
                history = conv_history if conv_history is not None else None if state is None else state.conv
                qkv, conv_state = self.conv(qkv, attention_mask, history)
                qkv = F.silu(qkv)
            q, k, v = (self._heads(t) for t in qkv.split([H * D, Hkv * D, Hkv * D], dim=-1))
            if self.qk_norm:
                q, k = F.normalize(q, dim=-1, eps=L2_EPS), F.normalize(k, dim=-1, eps=L2_EPS)
            q = q * D ** -0.5                                             # (B, H, T, D)
            log_g, beta = self._gates(raw_a, raw_b, acc, B, T)            # (B, H_kv, T[, D]), (B, H_kv, T)
            if attention_mask is not None:                               # padded tokens change nothing
                real = attention_mask[:, None, :]                        # (B, 1, T)
                k, v = k.masked_fill(~real[..., None], 0.0), v.masked_fill(~real[..., None], 0.0)
                beta = None if beta is None else beta.masked_fill(~real, 0.0)
                if log_g is not None:
                    log_g = log_g.masked_fill(~(real if log_g.dim() == 3 else real[..., None]), 0.0)
            S0 = None if state is None else self._repeat_kv(state.S.to(acc))   # (B, H, D, D)
            o, S = self._apply_rule(q, self._repeat_kv(k), self._repeat_kv(v), self._repeat_kv(log_g), self._repeat_kv(beta),
                                    S0, attention_mask, {**_OPS, **(rule_ops or {})})   # (B, H, T, D), (B, H, D, D)
            if self.o_norm is not None:
                o = o * torch.rsqrt(o.pow(2).mean(dim=-1, keepdim=True) + NORM_EPS) * self.o_norm.to(acc)
            if raw_g is not None:
                o = o * F.silu(self._heads(raw_g.to(acc)))
            o = o.transpose(1, 2).reshape(B, T, H * D).to(x.dtype)        # (B, T, H·D)
        y = self.out_proj(o)                                              # (B, T, d_model)
        if not return_state:
            return y
        S = S if self.group_size == 1 else S[:, ::self.group_size].contiguous()   # one copy per group
        return y, MixerState(S, conv_state)

    def conv_inputs(self, x: Tensor) -> Tensor:
        """What the short convolution reads: the ``q``, ``k``, ``v`` projections of ``x`` side by side,
        ``(B, T, (H + 2 H_kv)·head_dim)`` in float32 (float64 for float64 ``x``)."""
        projected = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]     # matmuls under autocast if on
        with no_autocast(x.device):
            return torch.cat([p.to(_checks.accumulation_dtype(x.dtype)) for p in projected], dim=-1)

    # ---- the rule ----------------------------------------------------------------------

    def _gates(self, raw_a, raw_b, acc, B: int, T: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """``log α`` ``(B, H_kv, T)`` or ``(B, H_kv, T, D)`` (None for delta and retention) and
        ``β`` ``(B, H_kv, T)`` (None for retention and GLA), in ``acc``."""
        beta = None
        if raw_b is not None:
            beta = torch.sigmoid(raw_b.to(acc)).transpose(1, 2)          # (B, H_kv, T) in (0, 1)
            if self.negative_eigenvalues:
                beta = 2.0 * beta                                        # (0, 2): Grazzi et al., 2025
        if self.rule == "gla":
            log_g = F.logsigmoid(self._heads(raw_a.to(acc))) / GLA_GATE_NORMALIZER   # (B, H_kv, T, D)
        elif self.rule == "gated_delta":
            dt = F.softplus(raw_a.to(acc) + self.dt_bias.to(acc))        # (B, T, H_kv)
            log_g = (-self.A_log.to(acc).exp() * dt).transpose(1, 2)     # (B, H_kv, T)
        elif self.rule == "kda":
            dt = F.softplus(raw_a.to(acc) + self.dt_bias.to(acc))        # (B, T, H_kv·D)
            A = self.A_log.to(acc).exp().repeat_interleave(self.head_dim)  # (H_kv·D,): one A per head
            log_g = self._heads(-A * dt)                                 # (B, H_kv, T, D)
        else:
            return None, beta
        # exp(-1000) is 0 in float32 and float64 alike: an overflow to -inf gives the same α = 0
        return log_g.clamp(min=LOG_G_FLOOR), beta

    def _apply_rule(self, q, k, v, log_g, beta, S0, attention_mask, ops) -> tuple[Tensor, Tensor]:
        """``o = S_tᵀ q_t`` for every token and the last ``S``, through ``ops`` (:mod:`linattn.ops`' by default)."""
        retention, gated_linear_attention, delta_rule, gated_delta_rule = (ops[name] for name in _OPS)
        options = dict(method="recurrent" if q.shape[2] == 1 else "chunk", chunk_size=self.chunk_size,
                       initial_state=S0, return_state=True)
        if self.rule == "retention":
            log_gamma = self._repeat_heads(retnet_log_gammas(self.n_kv_heads, dtype=q.dtype, device=q.device))
            if attention_mask is None:
                return retention(q, k, v, log_gamma.exp(), **options)
            # A fixed γ would still decay the state at a padded token: GLA with log α = 0 there.
            real = attention_mask[:, None, :, None]                       # (B, 1, T, 1)
            log_g = torch.where(real, log_gamma[:, None, None], 0.0).expand_as(k)   # (B, H, T, D)
            return gated_linear_attention(q, k, v, log_g.contiguous(), **options)
        if self.rule == "gla":
            return gated_linear_attention(q, k, v, log_g, **options)
        if self.rule == "delta":
            return delta_rule(q, k, v, beta, **options)
        return gated_delta_rule(q, k, v, log_g, beta, **options)         # gated_delta and kda

    # ---- shapes, checks, sizes ---------------------------------------------------------

    def _repeat_heads(self, t: Tensor) -> Tensor:
        """(H_kv,) -> (H,)."""
        return t if self.group_size == 1 else t.repeat_interleave(self.group_size)

    def _check_state(self, state, x: Tensor) -> None:
        """Checked at every use (not only when the state was built: its attributes may have been replaced)."""
        if state is None:
            return
        if not isinstance(state, MixerState):
            raise TypeError(f"state must be a MixerState (or None) for LinearMixer, got {type(state).__name__}")
        state.validate()
        B, D = x.shape[0], self.head_dim
        expected = (B, self.n_kv_heads, D, D)
        if tuple(state.S.shape) != expected:
            raise ValueError(f"state.S must have shape (batch, n_kv_heads, head_dim, head_dim) = "
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
        numbers = self.n_kv_heads * self.head_dim ** 2
        if self.conv is not None:
            numbers += self.conv.channels * (self.conv_size - 1)
        return batch * numbers * torch.empty((), dtype=acc).element_size()
