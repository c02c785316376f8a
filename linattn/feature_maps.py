"""Feature maps φ for linear attention.

A feature map turns a query or key vector of size ``D`` into a feature vector of
size ``M`` so that the attention similarity becomes a dot product,
``sim(q, k) = φ(q)ᵀφ(k)`` (Katharopoulos et al., 2020, eq. 4). Every map here acts
on the last dimension and keeps the leading ones: ``(..., D) -> (..., M)``.
"""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["elu_plus_one", "relu", "get_feature_map", "FeatureMap", "FEATURE_MAPS"]

FeatureMap = Callable[[Tensor], Tensor]


def elu_plus_one(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1, the feature map of "Transformers are RNNs".

    Katharopoulos et al. (2020), eq. 7; ELU from Clevert et al. (2016). Elementwise:
    ``x + 1`` for ``x > 0`` and ``exp(x)`` for ``x <= 0``, so every feature is strictly
    positive (but not bounded below by 1: it tends to 0 as ``x -> -inf``).

    Parameters
    ----------
    x : Tensor
        Floating tensor of shape ``(..., D)``.

    Returns
    -------
    Tensor
        Same shape and dtype as ``x`` (``M = D``), every entry in ``(0, inf)``.

    Raises
    ------
    TypeError
        If ``x`` is not a floating-point tensor.
    """
    _check_floating(x, "x")
    return F.elu(x).add_(1.0)  # in place: elu's backward needs its input, not its output


def relu(x: Tensor) -> Tensor:
    """φ(x) = max(x, 0), the ReLU feature map (used e.g. by cosFormer, Qin et al. 2022, eq. 7).

    Non-negative but not strictly positive: a query whose features are all zero, or one
    orthogonal to every key's features, has a zero normaliser; ``linear_attention``'s
    ``eps`` keeps that finite.

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


FEATURE_MAPS: dict[str, FeatureMap] = {
    "elu+1": elu_plus_one,
    "elu_plus_one": elu_plus_one,
    "relu": relu,
}


def get_feature_map(name: str, **kwargs) -> FeatureMap:
    """Look up a feature map by name.

    Parameters
    ----------
    name : str
        One of ``"elu+1"`` (alias ``"elu_plus_one"``) or ``"relu"``.
    **kwargs
        Options of parametrised maps; the maps available now take none.

    Returns
    -------
    callable
        A function ``(..., D) -> (..., M)``.

    Raises
    ------
    TypeError
        If ``name`` is not a string, or options are given to a map that takes none.
    ValueError
        If ``name`` is not a known feature map (the message lists the known names).
    """
    if not isinstance(name, str):
        raise TypeError(f"feature_map name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in FEATURE_MAPS:
        known = ", ".join(repr(n) for n in FEATURE_MAPS)
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


def _check_floating(x: Tensor, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
