"""The gated delta rule (Gated DeltaNet; Kimi Delta Attention with one gate per key channel).

Decay the state, then correct what it recalls for the new key (Yang, Kautz & Hatamizadeh,
2025, arXiv:2412.06464, eq. 10; with per-channel gates, Kimi Team, 2025, arXiv:2510.26692)::

    S'_t = diag(α_t) S_{t-1},      S_t = S'_t + β_t k_t (v_t − S'_tᵀ k_t)ᵀ,      o_t = S_tᵀ q_t

With one gate per head this is ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``. It is
one step of online regression: ``S_t`` is ``α_t S_{t-1}`` moved by one gradient step of size
``β_t`` on ``½‖Sᵀk_t − v_t‖²`` (weight decay ``1 − α_t``, the test-time-training view).

The recurrent form is the oracle. The chunk form generalises the WY / UT representation of the
delta rule (Yang et al., 2024b, sec. 3) to gates inside the chunk; every decay factor is an
exp of a range sum of log-gates, ``<= 0`` (never a difference of cumulative sums), except in
chunks of mild total decay, where the cumulative decays are folded into the queries and keys.
"""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor

from ... import _checks, backends
from ..._numerics import LOG_G_FLOOR, no_autocast
from ...feature_maps import FeatureMap
from .._common import Result, check_like_q, output_and_state, prepare, run, zeros_state
from .chunk import chunk_gated_delta_rule
from .naive import recurrent_gated_delta_rule

__all__ = ["gated_delta_rule", "recurrent_gated_delta_rule", "chunk_gated_delta_rule"]


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_g: Tensor,
    beta: Tensor,
    *,
    method: str = "auto",
    chunk_size: int = 64,
    feature_map: Union[str, FeatureMap, None] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
) -> Result:
    """The gated delta rule: a decaying state that each token corrects toward its value.

    Per head, with ``α_t = exp(log_g_t)`` (a scalar, or one value per key channel)::

        S'_t = diag(α_t) S_{t-1}
        S_t  = S'_t + β_t φ(k_t) (v_t − S'_tᵀ φ(k_t))ᵀ           # = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ
        o_t  = S_tᵀ φ(q_t)

    Gated DeltaNet (Yang, Kautz & Hatamizadeh, 2025, arXiv:2412.06464, eq. 10) uses one gate
    per head, ``log_g`` of shape ``(B, H, T)``; Kimi Delta Attention (Kimi Team, 2025,
    arXiv:2510.26692) one per key channel, ``(B, H, T, Dk)``. With ``log_g = 0`` this is
    :func:`linattn.delta_rule`; with ``β = 0`` the state only decays. There is no hidden
    scaling of ``q`` (the caller scales, e.g. by ``Dk^-1/2``), and keys are not normalised
    here: the models L2-normalise ``q`` and ``k`` (then ``I − β_t k_t k_tᵀ`` has eigenvalues
    ``1`` and ``1 − β_t`` in ``[−1, 1]`` for ``β_t`` in ``[0, 2]``, and the recurrence is stable).

    Chunk form (``method="chunk"``): inside a chunk with start state ``S`` and ``b_t`` the
    cumulative log-gate from the chunk's start, write ``S_t = diag(e^{b_t}) S + Σ_{s<=t}
    diag(e^{b_t − b_s}) k_s u_sᵀ``. The pseudo-values solve the unit lower-triangular system
    ``(I + diag(β) A) U = diag(β) (V − K̃ S)`` with ``A_ts = k_tᵀ diag(e^{b_t − b_s}) k_s``
    (``s < t``) and ``K̃_t = e^{b_t} ⊙ k_t``, so ``U = Ũ − W S`` with ``[W, Ũ] = (I + diag(β)
    A)⁻¹ diag(β) [K̃, V]`` (all chunks at once). Then ``O = Q̃ S + P U`` with ``P_ts = q_tᵀ
    diag(e^{b_t − b_s}) k_s`` (``s <= t``) and ``Q̃_t = e^{b_t} ⊙ q_t``, and the next chunk starts
    from ``diag(e^{b_C}) S + K̂ᵀ U`` with ``K̂_s = e^{b_C − b_s} ⊙ k_s``: only ``W S`` and ``K̂ᵀ U``
    run chunk after chunk. Every decay factor is computed over its own range (a sum of log-gates
    per head; a product of gates per key channel, :mod:`linattn.ops._decay`), ``<= 1``: a decay
    strong enough to underflow gives zeros, never ``inf``/NaN (reference code that forms
    ``e^{b_t} · e^{−b_s}`` overflows at ``log α = −3`` per token and ``C = 64``). Only a chunk
    whose decay is mild (``Σ log α >= −16`` per head or key channel, every ``log α >= −1``, inputs
    far from overflow) forms ``P = (Q ⊙ e^{b})(K ⊙ e^{−b})ᵀ`` and ``A`` likewise, one matmul each, with
    factors in ``[e^{-16}, e^{16}]`` and float32's rounding (measured at the bound, random inputs:
    at most 6.4e-7 of the largest output or gradient, against 7.2e-7 for the range sums). Nearly
    parallel keys cost the gradient of the log-gates accuracy: with ``β = 1``, unit keys ``1e-3``
    apart (``T = 256``, ``Dk = 16``), ``log α = −0.2`` and one gate per head, the float32 gradient
    of ``log α`` was off by 2.9e-4 of its largest entry (either path; 5.4e-5 for
    ``method="recurrent"``), the other gradients by about 1e-6. Forward and
    backward work for ragged ``T``; float16/bfloat16 inputs compute in float32 with a float32
    state. The backward pass is written by hand (:mod:`linattn.ops._wy`), the gradient of the
    log-gates included; for second derivatives, under ``torch.func``
    and ``torch.compile`` and with forward-mode AD autograd differentiates the same equations op
    by op. Per key channel the chunk holds ``chunk_size`` rounded up to a power of two tokens.
    With ``LINATTN_CPU_KERNEL=1`` on the CPU, ``method="chunk"`` runs the recurrence as a compiled
    loop instead (:func:`linattn.kernels.cpu.delta_rule_cpu`; see :func:`delta_rule`): in the
    run described there, forward+backward took 29.7 ms with one gate per head and 36.1 ms with one
    per key channel, where the chunk forms took 66.7 ms and 80.3 ms.

    Parameters
    ----------
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys, floating point, same dtype and device.
    v : Tensor
        ``(B, H, T, Dv)`` values.
    log_g : Tensor
        ``log α``, finite and ``<= 0``, same dtype and device as ``q``: ``(B, H, T)`` (one gate
        per head and token) or ``(B, H, T, Dk)`` (one per key channel; ``Dk`` is the key
        dimension after ``feature_map``).
    beta : Tensor
        ``(B, H, T)`` writing strengths in ``[0, 2]``, same dtype and device as ``q``.
    method : str
        ``"auto"`` (= ``"chunk"``), ``"chunk"`` or ``"recurrent"``; case-insensitive.
    chunk_size : int
        Tokens per chunk of ``method="chunk"``; ``T`` need not be a multiple of it. On a CPU,
        measure ``chunk_size=32`` against it (see :func:`linattn.delta_rule`).
    feature_map : str, callable or None
        φ applied to ``q`` and ``k`` first, as in :func:`linattn.linear_attention`; None
        (the default) uses them as given.
    initial_state : Tensor, optional
        ``(B, H, Dk, Dv)``, the state before the first token.
    return_state : bool
        Also return the state after the last token.

    Returns
    -------
    out : Tensor
        ``(B, H, T, Dv)`` in the dtype of ``q`` (computed in float32 for half inputs, float64
        for float64).
    state : Tensor
        Only if ``return_state``: ``(B, H, Dk, Dv)``, float32 (float64 for float64 inputs).
        Resuming from it with the rest of a sequence equals one run.

    Raises
    ------
    TypeError
        Non-tensor, non-floating or mixed-dtype inputs; a ``log_g`` or ``beta`` that is not a
        tensor or has another dtype than ``q``; a non-str method; a non-int chunk size; a
        non-bool flag; an ``initial_state`` that is not a floating tensor.
    ValueError
        Wrong ranks or shapes, an empty dimension; ``log_g`` not ``(B, H, T)`` or
        ``(B, H, T, Dk)``, on another device, with a positive, NaN or infinite entry; ``beta``
        of the wrong shape or device, or with an entry outside ``[0, 2]``; an unknown method;
        ``chunk_size < 1``; an ``initial_state`` of the wrong shape or device; a
        position-dependent feature map with ``initial_state`` or without a fixed ``max_len``.
        Under ``torch.compile`` the checks of tensor values run inside the graph and raise
        RuntimeError with the same message.

    Notes
    -----
    Causality holds whatever the values: a NaN or infinity at position ``t`` never changes
    an output before ``t`` (in both methods). Autocast is switched off inside.
    """
    p = prepare("gated_delta_rule", q, k, v, method, chunk_size, feature_map, initial_state, return_state)
    B, H, T, Dk = p.k.shape
    if isinstance(log_g, Tensor) and log_g.dim() == 3:
        check_like_q(log_g, "log_g", (B, H, T), "(batch, heads, seq)", q)
    else:
        mapped = "" if feature_map is None else f" (k has {k.shape[-1]} dims, {Dk} features after feature_map)"
        check_like_q(log_g, "log_g", (B, H, T, Dk), "(batch, heads, seq) or (batch, heads, seq, key features)", q,
                     extra=mapped)
    check_like_q(beta, "beta", (B, H, T), "(batch, heads, seq)", q)
    _checks.check_log_gate(log_g, "log_g", "finite and <= 0 (α = exp(log_g) in (0, 1])")
    _checks.check_values((beta >= 0) & (beta <= 2), "beta", "in [0, 2]", beta)
    with no_autocast(q.device):
        log_g = log_g.to(p.acc)                                       # (B, H, T) or (B, H, T, Dk)
        beta = beta.to(p.acc)
        out, S = run(p, lambda: recurrent_gated_delta_rule(p.q, p.k, p.v, log_g, beta, p.S0),
                     lambda q, k, v: _chunk(q, k, v, log_g, beta, p.S0, p.chunk_size))
    return output_and_state(out, S, q.dtype, p.return_state)


def _chunk(q, k, v, log_g, beta, S0, chunk_size):
    """The chunk method on the backend :mod:`linattn.backends` picks."""
    if backends.select("gated_delta_rule", q, k, v, log_g, beta, S0) == "cpu":
        from ...kernels.cpu import delta_rule_cpu

        g = (log_g if log_g.dim() == 4 else log_g.unsqueeze(-1)).clamp(min=LOG_G_FLOOR)   # see LOG_G_FLOOR
        return delta_rule_cpu(q, k, v, beta, g, zeros_state(k, v, S0), chunk_size)
    return chunk_gated_delta_rule(q, k, v, log_g, beta, S0, chunk_size)
