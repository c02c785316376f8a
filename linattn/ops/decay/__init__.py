"""The decay factors the gated chunk forms share: range products (:mod:`.levels`), the mild-decay
prefix form (:mod:`.prefix`) and one gate per head (:mod:`.scalar`)."""
from .levels import (LevelProducts, decay_factors, level_products_backward, padded_chunk, scores_by_cat, scores_fast,
                     scores_fast_backward)
from .prefix import MILD_DECAY, MILD_GATE, mild_groups, prefix_factors, prefix_factors_backward
from .scalar import scalar_decay, scalar_decay_backward

__all__ = ["LevelProducts", "decay_factors", "level_products_backward", "padded_chunk", "scores_by_cat",
           "scores_fast", "scores_fast_backward", "MILD_DECAY", "MILD_GATE", "mild_groups", "prefix_factors",
           "prefix_factors_backward", "scalar_decay", "scalar_decay_backward"]
