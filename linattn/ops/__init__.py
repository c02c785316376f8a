"""The operator families of linattn, one module each (the layout of flash-linear-attention's
``fla/ops/<family>/``: the slow, obvious form next to the fast one).

Causal linear attention keeps a state ``S_t = S_{t-1} + k_t v_tᵀ`` and reads it with
``o_t = S_tᵀ q_t``. Changes to the *update* give the families, each module holding its
recurrent form (the token loop, the test oracle) beside its chunk form:

- :mod:`linattn.ops.linear`: :func:`~linattn.linear_attention`, ``S_t = S_{t-1} + φ(k_t) v_tᵀ``
  with the normaliser ``z_t = z_{t-1} + φ(k_t)`` (Katharopoulos et al., 2020);
- :mod:`linattn.ops.retention`: :func:`~linattn.retention`, ``S_t = γ S_{t-1} + k_t v_tᵀ``, one
  fixed ``γ`` per head (RetNet, Sun et al., 2023);
- :mod:`linattn.ops.gla`: :func:`~linattn.gated_linear_attention`,
  ``S_t = diag(g_t) S_{t-1} + k_t v_tᵀ`` (GLA, Yang et al., 2024a);
- :mod:`linattn.ops.delta`: :func:`~linattn.delta_rule`,
  ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀk_t)ᵀ`` (DeltaNet, Schlag et al., 2021; chunkwise,
  Yang et al., 2024b);
- :mod:`linattn.ops.gated_delta`: :func:`~linattn.gated_delta_rule`,
  ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ`` (Gated DeltaNet, Yang, Kautz &
  Hatamizadeh, 2025; one gate per key channel as in Kimi Delta Attention).

The decay family (all but the first) is unnormalised (no ``z``): with ``γ = 1``, ``g_t = 1``
it is ``linear_attention(..., causal=True, normalize=False)``. Every function has two
algorithms that compute the same numbers up to rounding: ``method="recurrent"`` and
``method="chunk"`` (the default).

The chunkwise forms split the sequence into chunks of ``C`` tokens; everything inside a
chunk is computed for all chunks at once with batched matmuls, and only the passage of
the ``(Dk, Dv)`` state from one chunk to the next is a loop (``T/C`` steps,
:func:`linattn.ops._common.scan`). Decays enter only as ``exp`` of *non-positive* numbers (or
as non-negative integer powers ``γ^m``, or products of such factors): with ``b_t`` the
cumulative log-decay inside a chunk, the factors are ``exp(b_t − b_s)`` for ``s <= t``,
``exp(b_t)`` and ``exp(b_C − b_s)``, each computed from the terms of its own range (a range
sum of log-gates, or a product of gates over disjoint sub-ranges, :mod:`linattn.ops._decay`),
never as a difference. A decay strong enough to
underflow gives zeros, never ``inf`` or NaN (a chunkwise form that writes
``exp(b_t) · exp(−b_s)`` overflows for per-token decays of ``e^-3`` at ``C = 64``).

The shared pieces (validation, chunking, the scan between chunks, range sums of log-gates)
live in :mod:`linattn.ops._common`; the delta rule and the gated delta rule with one gate per
head share one chunk form with a hand-written backward, :mod:`linattn.ops._wy`; GLA has one in
:mod:`linattn.ops._decay` (the others are differentiated by autograd through their chunk forms,
plain linear attention by its own Function); every public function is exported from :mod:`linattn`.
"""
