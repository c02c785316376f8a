"""Feature maps φ for linear attention.

A feature map turns a query or key vector of size ``D`` into a feature vector of
size ``M`` so that the attention similarity becomes a dot product,
``sim(q, k) = φ(q)ᵀφ(k)`` (Katharopoulos et al., 2020, eq. 4). Every map here acts
on the last dimension and keeps the leading ones: ``(..., D) -> (..., M)``.

Two kinds live here:

- heuristic maps with no target kernel: :func:`elu_plus_one`, :func:`relu`,
  :func:`squared_relu`, :class:`DPFPFeatures`, :class:`CosFormerFeatures` (which adds a
  position re-weighting);
- maps built to reproduce softmax's kernel ``exp(qᵀk · scale)``: :class:`PerformerFeatures`
  (unbiased random features), :class:`TaylorFeatures` (its second-order Taylor polynomial,
  exactly) and :class:`HedgehogFeatures` (learned, fitted with :func:`distill_feature_map`).

No map couples the tokens of a batch or of a sequence: each token's features depend on
that token alone (and, for cosFormer, on its position), so a batch element cannot change
another's output and, in causal attention, a later key cannot change an earlier output.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "elu_plus_one",
    "relu",
    "squared_relu",
    "DPFPFeatures",
    "PerformerFeatures",
    "TaylorFeatures",
    "HedgehogFeatures",
    "CosFormerFeatures",
    "distill_feature_map",
    "seeded_normal",
    "get_feature_map",
    "FeatureMap",
    "FEATURE_MAPS",
    "PARAMETRIC_FEATURE_MAPS",
]

FeatureMap = Callable[[Tensor], Tensor]


# ---------------------------------------------------------------------------------------
# Elementwise maps (no target kernel)
# ---------------------------------------------------------------------------------------


def elu_plus_one(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, the feature map of "Transformers are RNNs".

    Katharopoulos et al. (2020), eq. 7; ELU from Clevert et al. (2016). Elementwise:
    ``x + 1`` for ``x > 0`` and ``exp(x)`` for ``x <= 0``, so every feature is strictly
    positive (but not bounded below by 1: it tends to 0 as ``x -> -inf``). It does not
    approximate a particular kernel; it only makes ``φ(q)ᵀφ(k)`` positive.

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``(0, inf)`` until
        ``exp(x)`` underflows (``x < -103`` in float32): ``exp(x)`` is computed directly,
        never as ``elu(x) + 1``, whose ``-1 + 1`` cancels to exactly 0 from ``x ≈ -17``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    _check_floating(x, "x")
    if torch._C._are_functorch_transforms_active():
        return _EluPlusOneWithJvp.apply(x)
    return _EluPlusOne.apply(x)


class _EluPlusOne(torch.autograd.Function):
    """``exp(min(x, 0)) + max(x, 0)``: elu(x) + 1 without the cancellation, in four passes.

    Written in the ``setup_context`` style with a generated ``vmap`` rule (and, in
    :class:`_EluPlusOneWithJvp`, a forward-mode rule), so that ``torch.func`` transforms
    (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``hessian``) work through it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.clamp(max=0.0).exp_().add_(x.clamp(min=0.0))    # e^x for x <= 0, 1 + x for x > 0

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        (x,) = inputs
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, y = ctx.saved_tensors
        # dφ/dx = 1 for x > 0 and e^x = φ(x) for x <= 0. Written with the saved output,
        # this backward is itself differentiable (second derivatives work).
        return torch.where(x > 0, grad, grad * y)



class _EluPlusOneWithJvp(_EluPlusOne):
    """:class:`_EluPlusOne` with its forward-mode rule: used only under ``torch.func`` transforms
    (``torch.compile`` cannot trace a Function with ``jvp`` when gradients are needed)."""

    @staticmethod
    def jvp(ctx, tangent: Tensor) -> Tensor:
        x, y = ctx.saved_tensors
        return torch.where(x > 0, tangent, tangent * y)


def relu(x: Tensor) -> Tensor:
    """φ(x) = max(x, 0), the ReLU feature map (used e.g. by cosFormer, Qin et al. 2022, eq. 7).

    Non-negative but not strictly positive: a query whose features are all zero, or one
    orthogonal to every key's features, has a zero normaliser; ``linear_attention``'s
    ``eps`` keeps that finite. No target kernel.

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``[0, inf)``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    _check_floating(x, "x")
    return F.relu(x)


def squared_relu(x: Tensor) -> Tensor:
    """φ(x) = max(x, 0)², elementwise.

    The squared-ReLU activation of Primer (So et al., 2021), which FLASH (Hua et al.,
    2022) applies to attention scores, ``relu(qᵀk)²``; used here as a feature map, so that
    ``φ(q)ᵀφ(k) = Σ_d relu(q_d)² relu(k_d)²``. No target kernel: it is a heuristic that
    is peakier than :func:`relu` (it grows quadratically with the inputs) and, like it,
    can give a zero normaliser.

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``[0, inf)``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    _check_floating(x, "x")
    return F.relu(x).square()


class DPFPFeatures(nn.Module):
    """Deterministic parameter-free projection (DPFP) of Schlag et al. (2021).

    With ``r = relu([x, -x])`` (size ``2D``), DPFP of order ``ν`` takes the products of
    each feature with its neighbours at distances ``1..ν`` (cyclically)::

        φ_{(i, n)}(x) = r_i · r_{(i + n) mod 2D},   n = 1..ν,   M = 2·D·ν

    Its features are non-negative and sparse (a product is non-zero only when both entries
    are); the paper motivates it by making keys nearly orthogonal in a larger space, which
    raises the capacity of the ``M×Dv`` state. No target kernel.

    Parameters
    ----------
    nu : int
        The order ``ν >= 1`` (the paper uses 1 to 3); ``M = 2·D·ν``.

    Raises
    ------
    TypeError
        If ``nu`` is not an int (at construction) or ``x`` is not floating (at call).
    ValueError
        If ``nu < 1``, or (at call) ``nu >= D``: the products at distance ``D`` pair
        ``relu(x_i)`` with ``relu(-x_i)`` and are always zero.
    """

    def __init__(self, nu: int = 1) -> None:
        super().__init__()
        nu = _check_int(nu, "nu", minimum=1)
        self.nu = nu

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 2·D·ν)``, same dtype as ``x``."""
        _check_floating(x, "x")
        D = x.shape[-1]
        if self.nu >= D:
            raise ValueError(
                f"DPFP needs nu < D for inputs with D = {D}, got nu = {self.nu}: the products at distance D are "
                "relu(x_i)·relu(-x_i) = 0 for every input, features that are always zero")
        r = F.relu(torch.cat([x, -x], dim=-1))                                    # (..., 2D)
        return torch.cat([r * r.roll(n, dims=-1) for n in range(1, self.nu + 1)], dim=-1)

    def extra_repr(self) -> str:
        return f"nu={self.nu}"


# ---------------------------------------------------------------------------------------
# Maps that target softmax's kernel exp(qᵀk · scale)
# ---------------------------------------------------------------------------------------


class PerformerFeatures(nn.Module):
    """FAVOR+ positive random features (Choromanski et al., 2021, Lemma 1 and §2.4).

    For ``ω ~ N(0, I_D)``, ``E[exp(ωᵀx - |x|²/2) · exp(ωᵀy - |y|²/2)] = exp(xᵀy)``. With
    ``M`` draws ``ω_1..ω_M`` stacked in a projection ``W`` (``M×D``)::

        φ(x) = exp(W x̃ - |x̃|²/2) / √M,   x̃ = x · √scale

    so ``φ(q)ᵀφ(k)`` is an unbiased estimate of the softmax kernel ``exp(qᵀk · scale)``
    (every feature is positive, unlike the trigonometric random features of Rahimi and
    Recht, 2007). With ``orthogonal=True`` the ``ω`` are orthogonal in blocks of ``D``
    (Gram-Schmidt via QR) and rescaled to the norms of Gaussian vectors: each is still
    ``N(0, I)`` on its own, so the estimate stays unbiased, and its variance is lower.
    One feature's variance relative to the kernel's square is ``exp(|q̃ + k̃|²) - 1``: the
    estimate degrades exponentially with the size of the inputs, i.e. with the sharpness
    of the attention it approximates (chapter 6 measures it).

    Numerics: the exponent is formed first and exponentiated once (log space), never as
    ``exp(Wx̃) · exp(-|x̃|²/2)``, whose factors overflow and underflow separately. No
    stabiliser computed from the data is applied to keys: a maximum taken over the keys
    of a sequence lets later keys change earlier outputs in causal attention, and one taken
    over a batch couples its elements (chapter 6 shows both). Keys therefore overflow float32
    only where ``ωᵀk̃ - |k̃|²/2 > 88``, which needs ``|ω|²/2 > 88`` (large ``D``). For queries,
    ``forward(q, is_query=True)`` subtracts each query's own maximum exponent: a factor per
    query, which cancels exactly in normalised attention (use it with
    ``linear_attention(φ(q, is_query=True), φ(k), v, feature_map=None)``).

    The projection is a function of ``seed`` alone (see ``projection`` below), so it does not
    touch (or depend on) torch's global random state. It stays fixed between calls; call
    :meth:`redraw` to draw a new one.

    Parameters
    ----------
    head_dim : int, optional
        ``D``. If None, it is taken from the first input (the projection is drawn then).
    num_features : int, optional
        ``M``; default ``D · ceil(ln D)`` (the paper's ``Θ(D log D)``).
    orthogonal : bool
        Orthogonal (True) or i.i.d. Gaussian (False) projections.
    seed : int
        Seed of the projection; the same seed gives the same ``W`` on every machine.
    scale : float, optional
        The softmax temperature the kernel targets; default ``1/√D``, as in
        :func:`linattn.softmax_attention`.

    Attributes
    ----------
    projection : Tensor or None
        ``(M, D)`` float64 buffer (None until ``D`` is known). It moves with the module
        (``.to(device)``, ``.cuda()``) but stays float64: ``.half()`` or ``.to(torch.bfloat16)``
        do not round it. The draw is counter-based (each number a hash of its index and the
        seed, then Box-Muller), so the same seed gives the same ``W`` on every machine and
        device, and a lazily drawn map also compiles (``torch.compile`` redraws it inside the
        graph, since compiled code cannot register a buffer; call the map once eagerly to
        store it).

    Raises
    ------
    TypeError
        Non-int ``head_dim``, ``num_features`` or ``seed``; non-bool ``orthogonal``;
        non-numeric ``scale``; (at call) a non-floating ``x``.
    ValueError
        ``head_dim < 1``, ``num_features < 1``, ``seed < 0``, ``scale <= 0``; (at call)
        an input whose last dimension is not ``head_dim``.
    """

    projection: Optional[Tensor]

    def __init__(self, head_dim: Optional[int] = None, num_features: Optional[int] = None, *,
                 orthogonal: bool = True, seed: int = 0, scale: Optional[float] = None) -> None:
        super().__init__()
        if head_dim is not None:
            head_dim = _check_int(head_dim, "head_dim", minimum=1)
        if num_features is not None:
            num_features = _check_int(num_features, "num_features", minimum=1)
        _check_bool(orthogonal, "orthogonal")
        seed = _check_int(seed, "seed", minimum=0)
        if scale is not None:
            scale = _check_positive(scale, "scale")
        self.head_dim = head_dim
        self.num_features = num_features
        self.orthogonal = orthogonal
        self.seed = seed
        self.scale = scale
        self.register_buffer("projection", None)
        if head_dim is not None:
            self._draw(head_dim)

    def forward(self, x: Tensor, *, is_query: bool = False) -> Tensor:
        """``(..., D) -> (..., M)`` positive features, same dtype as ``x``.

        Computed in float32 (float64 for float64 inputs). With ``is_query=True`` each row
        is divided by its largest entry (see the class docstring).
        """
        _check_floating(x, "x")
        _check_bool(is_query, "is_query")
        D = x.shape[-1]
        if self.projection is None:
            W = self._drawn(D)
            if not torch.compiler.is_compiling():   # compiled code cannot register it; it redraws instead
                self.projection = W
        elif self.projection.shape[1] != D:
            raise ValueError(
                f"PerformerFeatures was built for head_dim {self.projection.shape[1]}, got x of shape "
                f"{_shape(x.shape)} (last dim {D})"
            )
        else:
            W = self.projection
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        W = W.to(device=x.device, dtype=acc)                                      # (M, D)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D)
        xs = x.to(acc) * math.sqrt(scale)                                         # (..., D)
        log_phi = xs @ W.T - 0.5 * xs.square().sum(-1, keepdim=True)              # (..., M)
        log_phi = log_phi - 0.5 * math.log(W.shape[0])
        if is_query:
            log_phi = log_phi - log_phi.amax(dim=-1, keepdim=True)
        return log_phi.exp().to(x.dtype)

    def redraw(self, seed: Optional[int] = None) -> "PerformerFeatures":
        """Draw a new projection: from ``seed`` if given, else from ``self.seed + 1``.

        Returns
        -------
        PerformerFeatures
            ``self``, for chaining.

        Raises
        ------
        TypeError, ValueError
            If ``seed`` is not a non-negative int.
        """
        if seed is not None:
            seed = _check_int(seed, "seed", minimum=0)
        self.seed = self.seed + 1 if seed is None else seed
        if self.projection is not None:
            self._draw(self.projection.shape[1])
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A map whose projection is drawn lazily (head_dim=None) can still load a saved one.
        key = prefix + "projection"
        if self.projection is None and key in state_dict:
            self.projection = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _drawn(self, D: int) -> Tensor:
        """The ``(M, D)`` float64 projection of this map's seed (a pure function of the settings)."""
        M = self.num_features if self.num_features is not None else D * max(1, math.ceil(math.log(D)))
        return (_orthogonal_gaussian(M, D, self.seed) if self.orthogonal
                else seeded_normal((M, D), self.seed, stream=0))

    def _draw(self, D: int) -> None:
        W = self._drawn(D)
        device = self.projection.device if self.projection is not None else None
        self.projection = W.to(device) if device is not None else W

    def _apply(self, fn, recurse=True):
        # Module.half(), .to(dtype), ... convert every floating buffer; the projection would be
        # rounded for good (forward computes in float32 or float64 anyway). It follows the
        # module's device but stays float64.
        W = self._buffers.get("projection")
        if W is None:
            return super()._apply(fn, recurse)
        self._buffers["projection"] = None
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["projection"] = W.to(device=fn(W.new_empty(0)).device)
        return self

    def extra_repr(self) -> str:
        M = None if self.projection is None else self.projection.shape[0]
        return (f"head_dim={self.head_dim}, num_features={M or self.num_features}, "
                f"orthogonal={self.orthogonal}, seed={self.seed}, scale={self.scale}")


def _orthogonal_gaussian(M: int, D: int, seed: int) -> Tensor:
    """``(M, D)`` rows orthogonal in blocks of ``D``, each with the norm of a N(0, I_D) vector."""
    G = seeded_normal((math.ceil(M / D), D, D), seed, stream=1)                  # (blocks, D, D)
    Q, R = torch.linalg.qr(G)
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)           # Haar-distributed
    W = Q.transpose(-1, -2).reshape(-1, D)[:M]                                      # (M, D), unit rows
    norms = seeded_normal((M, D), seed, stream=2).norm(dim=1, keepdim=True)
    return W * norms


_M32 = 0xFFFFFFFF


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of each entry of the int64 tensor ``x`` (values in ``[0, 2^32)``).

    The PCG hash of Jarzynski & Olano (2020, "Hash Functions for GPU Rendering"), in int64
    arithmetic that never overflows (each product is of a 32-bit value and a 30-bit constant).
    """
    state = (x * 747796405 + 2891336453) & _M32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _M32
    return (word >> 22) ^ word


def seeded_normal(shape: tuple[int, ...], seed: int, stream: int = 0) -> Tensor:
    """Standard normal float64 numbers determined by ``(seed, stream)`` alone (counter-based).

    Each entry hashes its own index with the seed and goes through the Box-Muller transform,
    so the draw needs no ``torch.Generator`` and touches no global random state; it is the
    same on every machine and device, and ``torch.compile`` can trace it (a lazily drawn
    projection then compiles). ``stream`` separates draws from one seed:
    :class:`PerformerFeatures` uses stream 0 for i.i.d. projections, 1 for the Gaussian blocks
    it orthogonalises and 2 for their lengths.

    Parameters
    ----------
    shape : tuple of int
        Shape of the result.
    seed : int
        A non-negative integer (its low 64 bits are used).
    stream : int
        A non-negative integer below ``2^32``.

    Returns
    -------
    Tensor
        float64 of ``shape`` on the CPU, standard normal entries.

    Raises
    ------
    TypeError, ValueError
        A seed or stream that is not a non-negative int, a stream of ``2^32`` or more.
    """
    seed = _check_int(seed, "seed", minimum=0)
    stream = _check_int(stream, "stream", minimum=0)
    if stream > _M32:
        raise ValueError(f"stream must be < 2**32, got {stream}")
    n = math.prod(shape)
    key = _hash32(_hash32(torch.tensor([seed & _M32, (seed >> 32) & _M32, stream], dtype=torch.int64)))
    base = _hash32(key[0] ^ _hash32(key[1] ^ key[2]))
    idx = torch.arange(2 * n, dtype=torch.int64)
    bits = _hash32(_hash32(idx) ^ base).to(torch.float64)
    u = (bits + 0.5) / 2.0 ** 32                                                    # uniform in (0, 1)
    u1, u2 = u[:n], u[n:]
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).reshape(shape)


class TaylorFeatures(nn.Module):
    """Second-order Taylor features of the softmax kernel, as in Based (Arora et al., 2024).

    ``exp(s) ≈ 1 + s + s²/2`` with ``s = qᵀk · scale``. With ``x̃ = x · √scale``::

        φ(x) = [1, x̃, (x̃_i x̃_j · c_ij)_{i <= j}],   c_ii = 1/√2,  c_ij = 1 (i < j)

    gives ``φ(q)ᵀφ(k) = 1 + s + s²/2`` exactly (the symmetric products ``x̃_i x̃_j`` and
    ``x̃_j x̃_i`` are stored once), with ``M = 1 + D + D(D+1)/2``. The features can be
    negative, but the kernel is always ``>= 1/2``: ``1 + s + s²/2 = ((1 + s)² + 1)/2``.
    It matches ``exp(s)`` near ``s = 0`` and is far flatter than it for ``s < -1``, so it
    cannot give a small weight to a key (chapter 6).

    Parameters
    ----------
    scale : float, optional
        The factor on ``qᵀk``; default ``1/√D`` (softmax's).

    Raises
    ------
    TypeError
        Non-numeric ``scale``; (at call) a non-floating ``x``.
    ValueError
        ``scale <= 0`` or not finite.
    """

    def __init__(self, scale: Optional[float] = None) -> None:
        super().__init__()
        if scale is not None:
            scale = _check_positive(scale, "scale")
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 1 + D + D(D+1)/2)``, same dtype as ``x`` (computed in float32 for half)."""
        _check_floating(x, "x")
        D = x.shape[-1]
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(D)
        xs = x.to(acc) * math.sqrt(scale)                                         # (..., D)
        i, j = torch.triu_indices(D, D, device=x.device)                          # i <= j
        coef = torch.ones(i.shape[0], dtype=acc, device=x.device)                 # (D(D+1)/2,)
        coef[i == j] = math.sqrt(0.5)
        second = xs[..., i] * xs[..., j] * coef                                   # (..., D(D+1)/2)
        ones = torch.ones_like(xs[..., :1])
        return torch.cat([ones, xs, second], dim=-1).to(x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class HedgehogFeatures(nn.Module):
    """Hedgehog's learnable feature map (Zhang et al., 2024).

    ``φ(x) = softmax([Wx + b, -(Wx + b)])`` over the ``2F`` features: the paper's
    ``[exp(Wx + b), exp(-Wx - b)]`` divided by its sum, which keeps it finite. The division
    is part of the map, one factor per token, not a stabiliser over tokens; it is not free,
    though: for a query the factor cancels in the normalisation, for a key it does not, so
    the kernel is ``exp(±…)ᵀexp(±…) / Z(k)`` with ``Z(k)`` the key's own sum, a different
    kernel from the paper's. Exponentials of a learned projection can be as peaked as
    softmax; ``W`` is trained so that the linear attention weights mimic softmax's
    (:func:`distill_feature_map`).

    The start of ``W`` (``init``):

    - ``"identity"`` (default): the first ``min(F, D)`` rows are those of the identity, as in
      the square (``F = D``) maps of the common Hedgehog implementations, which start ``W``
      at the identity and ``b`` at zero; so an untrained map with ``F = D`` is deterministic.
      Rows beyond ``D`` (``F > D``) are drawn at random, ``N(0, 1/D)`` entries from
      :func:`seeded_normal` (``seed``, stream 3): zero rows would sit at a symmetric
      stationary point, since a zero row gives the feature pair ``(1, 1)`` (times the
      normaliser) whose two gradients cancel, and distillation would never move them.
    - ``"random"``: every row drawn so, ``N(0, 1/D)`` entries (rows of norm about 1, like
      the identity's).

    Parameters
    ----------
    head_dim : int
        ``D``, the size of the inputs.
    num_features : int, optional
        ``F``, the rows of ``W``; default ``D``. The output has ``M = 2F`` features.
    bias : bool
        Learn ``b`` (True) or not.
    init : str
        ``"identity"`` or ``"random"``, see above.
    seed : int
        Seed of the random rows (a non-negative int).

    Raises
    ------
    TypeError
        Non-int sizes or seed, non-bool ``bias``, non-str ``init``; (at call) a non-floating ``x``.
    ValueError
        Sizes ``< 1``, a negative seed, an unknown ``init``; (at call) an input whose last
        dimension is not ``head_dim``.
    """

    INITS = ("identity", "random")

    def __init__(self, head_dim: int, num_features: Optional[int] = None, *, bias: bool = True,
                 init: str = "identity", seed: int = 0) -> None:
        super().__init__()
        head_dim = _check_int(head_dim, "head_dim", minimum=1)
        if num_features is not None:
            num_features = _check_int(num_features, "num_features", minimum=1)
        _check_bool(bias, "bias")
        if not isinstance(init, str):
            raise TypeError(f"init must be a str, one of {self.INITS}, got {type(init).__name__}")
        if init not in self.INITS:
            raise ValueError(f"init must be one of {self.INITS}, got {init!r}")
        _check_int(seed, "seed", minimum=0)
        self.head_dim, self.init, self.seed = head_dim, init, seed
        self.num_features = num_features if num_features is not None else head_dim
        W = seeded_normal((self.num_features, head_dim), seed, stream=3) / math.sqrt(head_dim)   # (F, D)
        if init == "identity":
            n = min(self.num_features, head_dim)
            W[:n] = torch.eye(n, head_dim, dtype=W.dtype)
        self.weight = nn.Parameter(W.float())                                     # (F, D)
        self.bias = nn.Parameter(torch.zeros(self.num_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """``(..., D) -> (..., 2F)`` features in ``(0, 1)`` summing to 1, same dtype as ``x``."""
        _check_floating(x, "x")
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"HedgehogFeatures expects x of shape (..., {self.head_dim}), got {_shape(x.shape)}"
            )
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        b = None if self.bias is None else self.bias.to(acc)
        y = F.linear(x.to(acc), self.weight.to(acc), b)                           # (..., F)
        return torch.softmax(torch.cat([y, -y], dim=-1), dim=-1).to(x.dtype)      # (..., 2F)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, bias={self.bias is not None}, "
                f"init={self.init!r}, seed={self.seed}")


# ---------------------------------------------------------------------------------------
# Position re-weighting
# ---------------------------------------------------------------------------------------


class CosFormerFeatures(nn.Module):
    """cosFormer: ReLU features with the cos-based re-weighting of Qin et al. (2022).

    The similarity of query ``i`` and key ``j`` is
    ``relu(q_i)ᵀrelu(k_j) · cos(π/2 · (i - j)/L)``, which favours nearby tokens. Since
    ``cos(a - b) = cos a cos b + sin a sin b``, it is the dot product of::

        φ(x_i) = [relu(x_i) cos(π i / 2L), relu(x_i) sin(π i / 2L)],   M = 2D

    For ``0 <= i, j < L`` the cosine is positive, so the similarity is non-negative. The
    same features serve non-causal and causal attention. ``L`` is ``max_len`` if given,
    else the length of the input (the paper's choice for non-causal attention). Give
    ``max_len`` for causal use and streaming, where a prefix must get the same features
    as the whole sequence, and for cross-attention, where queries and keys must share ``L``.

    The features depend on position, so the input must be ``(B, H, T, D)`` with positions
    ``offset .. offset + T - 1`` along dim 2. For one-token decoding compute
    ``φ(x[:, :, None], offset=t)[:, :, 0]`` yourself and pass ``feature_map=None``
    (``linear_attention_step`` calls maps on ``(B, H, D)`` and cannot know ``t``).

    Parameters
    ----------
    max_len : int, optional
        ``L``, the largest number of positions; None uses each input's ``offset + T``.

    Raises
    ------
    TypeError
        Non-int ``max_len`` or ``offset``; (at call) a non-floating ``x``.
    ValueError
        ``max_len < 1``; (at call) an input that is not 4-D, a negative ``offset``, or
        ``offset + T > max_len``.
    """

    position_dependent = True
    """Marks a map whose features depend on the position: callers that feed a sequence in
    pieces (decoding) must pass ``offset=`` the number of tokens already seen."""

    def __init__(self, max_len: Optional[int] = None) -> None:
        super().__init__()
        if max_len is not None:
            max_len = _check_int(max_len, "max_len", minimum=1)
        self.max_len = max_len

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        """``(B, H, T, D) -> (B, H, T, 2D)``, same dtype as ``x`` (angles in float32 or float64)."""
        _check_floating(x, "x")
        offset = _check_int(offset, "offset", minimum=0)
        if x.dim() != 4:
            raise ValueError(
                "CosFormerFeatures needs x of shape (batch, heads, seq, dim): its features depend on "
                f"the position along dim 2; got {_shape(x.shape)}"
            )
        T = x.shape[-2]
        L = self.max_len if self.max_len is not None else offset + T
        if offset + T > L:
            raise ValueError(f"positions offset + T = {offset} + {T} exceed max_len = {L}")
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        pos = torch.arange(offset, offset + T, device=x.device, dtype=acc)        # (T,)
        angle = (math.pi / 2) * pos / L
        r = F.relu(x.to(acc))                                                     # (B, H, T, D)
        feats = torch.cat([r * angle.cos()[:, None], r * angle.sin()[:, None]], dim=-1)
        return feats.to(x.dtype)                                                  # (B, H, T, 2D)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}"


# ---------------------------------------------------------------------------------------
# Distillation (Hedgehog)
# ---------------------------------------------------------------------------------------


def distill_feature_map(feature_map: nn.Module, q: Tensor, k: Tensor, *, steps: int = 200,
                        lr: float = 1e-2, scale: Optional[float] = None, causal: bool = False
                        ) -> list[float]:
    """Fit a learnable feature map so that linear attention's weights mimic softmax's.

    Hedgehog's attention distillation (Zhang et al., 2024): minimise the soft cross-entropy
    between the rows of the softmax weights ``A = softmax(QKᵀ · scale)`` and of the linear
    weights ``Â_ij = φ(q_i)ᵀφ(k_j) / Σ_l φ(q_i)ᵀφ(k_l)`` with Adam. The loss reported is
    that cross-entropy minus the entropy of ``A``, i.e. the mean over rows of
    ``KL(A_i ‖ Â_i)`` in nats (0 for a perfect fit); the gradients are the same.
    One map is used for queries and keys, as ``linear_attention`` applies one ``φ``.

    Parameters
    ----------
    feature_map : nn.Module
        A map with trainable parameters, e.g. :class:`HedgehogFeatures`; trained in place.
    q, k : Tensor
        ``(B, H, T, D)`` queries and keys to fit on (floating, same shape); not trained.
    steps : int
        Adam steps (full batch).
    lr : float
        Adam's learning rate.
    scale : float, optional
        Softmax temperature; default ``1/√D``.
    causal : bool
        Fit the causal weights (query ``i`` sees keys ``j <= i``).

    Returns
    -------
    list of float
        The loss (mean KL, nats) before each step, ``steps`` values.

    Raises
    ------
    TypeError
        A map without trainable parameters, non-tensor or non-floating inputs, non-int
        ``steps``, non-numeric ``lr`` or ``scale``, non-bool ``causal``.
    ValueError
        ``q`` or ``k`` not 4-D or of different shapes; ``steps < 1``, ``lr <= 0``, ``scale <= 0``.
    """
    params = [p for p in feature_map.parameters() if p.requires_grad] if isinstance(feature_map, nn.Module) else []
    if not params:
        raise TypeError(f"feature_map must be an nn.Module with trainable parameters, got {type(feature_map).__name__}")
    for name, x in (("q", q), ("k", k)):
        _check_floating(x, name)
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, dim), got {_shape(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q {_shape(q.shape)} and k {_shape(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have one dtype, got q {q.dtype} and k {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got q on {q.device} and k on {k.device}")
    steps = _check_int(steps, "steps", minimum=1)
    lr = _check_positive(lr, "lr")
    if scale is not None:
        scale = _check_positive(scale, "scale")
    _check_bool(causal, "causal")
    # Under torch.inference_mode() inputs are inference tensors and autograd is off: train on
    # ordinary copies made outside inference mode.
    # Half inputs are fitted in float32: in float16 the 1e-30 floor of the logarithms rounds to 0.
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.inference_mode(False), torch.enable_grad():
        q, k = q.detach().to(acc, copy=True), k.detach().to(acc, copy=True)
        target = _softmax_weights(q, k, scale, causal)                              # (B, H, T, T)
        entropy = -(target * target.clamp_min(1e-30).log()).sum(-1).mean()
        opt = torch.optim.Adam(params, lr=lr)
        history = []
        for _ in range(steps):
            weights = _kernel_weights(feature_map(q).to(acc), feature_map(k).to(acc), causal)  # (B, H, T, T)
            cross_entropy = -(target * weights.clamp_min(1e-30).log()).sum(-1).mean()
            history.append(float(cross_entropy.detach() - entropy))
            opt.zero_grad()
            cross_entropy.backward()
            opt.step()
    return history


def _softmax_weights(q: Tensor, k: Tensor, scale: Optional[float], causal: bool) -> Tensor:
    """``softmax(QKᵀ · scale)`` rows, causally masked if asked: (B, H, Tq, Tk)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _kernel_weights(phi_q: Tensor, phi_k: Tensor, causal: bool) -> Tensor:
    """``φ(q_i)ᵀφ(k_j)`` normalised over ``j`` (causally masked if asked): (B, H, Tq, Tk)."""
    a = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        a = a.tril()
    return a / a.sum(-1, keepdim=True).clamp_min(1e-30)


# ---------------------------------------------------------------------------------------
# Lookup by name
# ---------------------------------------------------------------------------------------

FEATURE_MAPS: dict[str, FeatureMap] = {
    "elu+1": elu_plus_one,
    "elu_plus_one": elu_plus_one,
    "relu": relu,
    "squared_relu": squared_relu,
}
"""Maps without options, by name: the function itself."""

PARAMETRIC_FEATURE_MAPS: dict[str, type] = {
    "dpfp": DPFPFeatures,
    "performer": PerformerFeatures,
    "favor+": PerformerFeatures,
    "taylor": TaylorFeatures,
    "hedgehog": HedgehogFeatures,
    "cosformer": CosFormerFeatures,
}
"""Maps with options, by name: the class; ``get_feature_map`` builds one with the options."""


def get_feature_map(name: str, **kwargs) -> FeatureMap:
    """Look up a feature map by name.

    Parameters
    ----------
    name : str
        Case-insensitive. Without options: ``"elu+1"`` (alias ``"elu_plus_one"``), ``"relu"``,
        ``"squared_relu"``. With options (a new module is built each call): ``"dpfp"``
        (:class:`DPFPFeatures`), ``"performer"`` (alias ``"favor+"``,
        :class:`PerformerFeatures`), ``"taylor"`` (:class:`TaylorFeatures`), ``"hedgehog"``
        (:class:`HedgehogFeatures`, needs ``head_dim``), ``"cosformer"``
        (:class:`CosFormerFeatures`).
    **kwargs
        Options passed to the class. A Performer map built by name with the same ``seed``
        (default 0) has the same projection every time, so passing ``"performer"`` to
        ``linear_attention`` twice gives the same result.

    Returns
    -------
    callable
        A function or module ``(..., D) -> (..., M)``.

    Raises
    ------
    TypeError
        If ``name`` is not a string, options are given to a map that takes none, or the
        options do not fit the class (the message names the map).
    ValueError
        If ``name`` is not a known feature map (the message lists the known names), or an
        option has a bad value.
    """
    if not isinstance(name, str):
        raise TypeError(f"feature_map name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key in PARAMETRIC_FEATURE_MAPS:
        cls = PARAMETRIC_FEATURE_MAPS[key]
        try:
            return cls(**kwargs)
        except TypeError as err:
            if "argument" in str(err):  # a missing or unexpected keyword, not a bad value
                raise TypeError(f"feature_map {name!r} ({cls.__name__}): {err}") from None
            raise
    if key not in FEATURE_MAPS:
        known = ", ".join(repr(n) for n in [*FEATURE_MAPS, *PARAMETRIC_FEATURE_MAPS])
        raise ValueError(f"unknown feature_map {name!r}; known names: {known}")
    if kwargs:
        raise TypeError(f"feature_map {name!r} takes no options, got {sorted(kwargs)}")
    return FEATURE_MAPS[key]


def resolve_feature_map(feature_map: Union[str, FeatureMap, None]) -> FeatureMap | None:
    """Turn the ``feature_map`` argument of the attention functions into a callable (or None)."""
    if feature_map is None:
        return None
    if isinstance(feature_map, str):
        return get_feature_map(feature_map)
    if callable(feature_map):
        return feature_map
    raise TypeError(
        f"feature_map must be a name, a callable (..., D) -> (..., M) or None, "
        f"got {type(feature_map).__name__}"
    )


# ---------------------------------------------------------------------------------------
# Argument checks (private)
# ---------------------------------------------------------------------------------------


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def _check_floating(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _check_int(value, name: str, minimum: int) -> int:
    """A Python or NumPy integer >= ``minimum``, returned as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_bool(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_positive(value, name: str) -> float:
    """A positive finite Python or NumPy real number, returned as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)
