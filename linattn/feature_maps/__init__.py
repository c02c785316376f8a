"""Feature maps φ for linear attention."""
from __future__ import annotations

from typing import Callable, Union

from torch import Tensor

from .cosformer import CosFormerFeatures
from .distill import distill_feature_map
from .dpfp import DPFPFeatures
from .elementwise import elu_plus_one, relu, squared_relu
from .hedgehog import HedgehogFeatures
from .performer import PerformerFeatures, seeded_normal
from .taylor import TaylorFeatures

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
    "resolve_feature_map",
    "FeatureMap",
    "FEATURE_MAPS",
    "PARAMETRIC_FEATURE_MAPS",
]

FeatureMap = Callable[[Tensor], Tensor]

# One public identity for every map, whichever file defines it: what the ranks of
# linattn.distributed compare and what pickles of a model record.
for _obj in (elu_plus_one, relu, squared_relu, DPFPFeatures, PerformerFeatures, TaylorFeatures, HedgehogFeatures,
             CosFormerFeatures, distill_feature_map, seeded_normal):
    for _member in [_obj, *(m for m in vars(_obj).values() if callable(m) and hasattr(m, "__module__"))]:
        _member.__module__ = __name__
del _obj, _member

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
        return FEATURE_MAPS.get(feature_map) or get_feature_map(feature_map)   # an exact name: no normalising
    if callable(feature_map):
        return feature_map
    raise TypeError(
        f"feature_map must be a name, a callable (..., D) -> (..., M) or None, "
        f"got {type(feature_map).__name__}"
    )
