"""Performer's FAVOR+ positive random features for softmax's kernel (Choromanski et al., 2021)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .._checks import check_floating, check_int_at_least, check_positive_finite, check_strict_bool, shape_str

__all__ = ['PerformerFeatures', 'seeded_normal']


class PerformerFeatures(nn.Module):
    """FAVOR+ positive random features (Choromanski et al., 2021, Lemma 1 and §2.4).

    For ``ω ~ N(0, I_D)``, ``E[exp(ωᵀx - |x|²/2) · exp(ωᵀy - |y|²/2)] = exp(xᵀy)``. With
    ``M`` draws ``ω_1..ω_M`` stacked in a projection ``W`` (``M×D``)::

        φ(x) = exp(W x̃ - |x̃|²/2) / √M,   x̃ = x · √scale

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
            head_dim = check_int_at_least(head_dim, "head_dim", minimum=1)
        if num_features is not None:
            num_features = check_int_at_least(num_features, "num_features", minimum=1)
        check_strict_bool(orthogonal, "orthogonal")
        seed = check_int_at_least(seed, "seed", minimum=0)
        if scale is not None:
            scale = check_positive_finite(scale, "scale")
        self.head_dim = head_dim
        self.num_features = num_features
        self.orthogonal = orthogonal
        self.seed = seed
        self.scale = scale
        self.register_buffer("projection", None)
        if head_dim is not None:
            self._draw(head_dim)

    def forward(self, x: Tensor, *, is_query: bool = False) -> Tensor:
        """``(..., D) -> (..., M)`` positive features, same dtype as ``x``."""
        check_floating(x, "x")
        check_strict_bool(is_query, "is_query")
        D = x.shape[-1]
        if self.projection is None:
            W = self._drawn(D)
            if not torch.compiler.is_compiling():   # compiled code cannot register it; it redraws instead
                self.projection = W
        elif self.projection.shape[1] != D:
            raise ValueError(
                f"PerformerFeatures was built for head_dim {self.projection.shape[1]}, got x of shape "
                f"{shape_str(x.shape)} (last dim {D})"
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
            seed = check_int_at_least(seed, "seed", minimum=0)
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
    """A 32-bit integer hash of each entry of the int64 tensor ``x`` (values in ``[0, 2^32)``)."""
    state = (x * 747796405 + 2891336453) & _M32
    word = (((state >> ((state >> 28) + 4)) ^ state) * 277803737) & _M32
    return (word >> 22) ^ word


def seeded_normal(shape: tuple[int, ...], seed: int, stream: int = 0) -> Tensor:
    """Standard normal float64 numbers determined by ``(seed, stream)`` alone (counter-based).

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
    seed = check_int_at_least(seed, "seed", minimum=0)
    stream = check_int_at_least(stream, "stream", minimum=0)
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
