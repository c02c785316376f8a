"""Generation: one token at a time from a decoding state, greedy or sampled (temperature, top-k)."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from .. import _checks

__all__ = ["generate", "sample_next", "check_temperature"]


def generate(model, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None, *,
             attention_mask: Optional[Tensor] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """:meth:`linattn.TransformerLM.generate` for ``model`` (see there)."""
    model._check_idx(idx)
    B, T = idx.shape
    max_new_tokens = _checks.check_non_negative_int(max_new_tokens, "max_new_tokens")
    temperature = check_temperature(temperature)
    if top_k is not None:
        top_k = _checks.check_positive_int(top_k, "top_k")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (or None), got {_checks.type_name(generator)}")
        if generator.device.type != idx.device.type:
            raise ValueError(f"generator is on {generator.device} but the model is on {idx.device}")
    attention_mask = _checks.attention_mask_as_bool(attention_mask, B, T, idx.device)
    if attention_mask is not None:
        left_padded = (attention_mask[:, 1:] >= attention_mask[:, :-1]).all() & attention_mask[:, -1].all()
        if not bool(left_padded):
            raise ValueError("attention_mask must describe left padding (each row False... then True..., "
                             "ending in a real token) for generate")
    longest = T if attention_mask is None else int(attention_mask.sum(dim=1).max())
    if model.config.max_len is not None and longest + max_new_tokens > model.config.max_len:
        raise ValueError(f"a prompt of {longest} real tokens plus max_new_tokens={max_new_tokens} makes "
                         f"{longest + max_new_tokens} tokens but the model has max_len={model.config.max_len} "
                         "positions")
    if max_new_tokens > 1:                    # tokens after the first are decoded from the state
        for i, block in enumerate(model.blocks):
            phi = getattr(block.attn, "feature_map", None)
            if _checks.position_dependent(phi):
                raise ValueError(
                    f"generate cannot decode with the position-dependent feature_map {type(phi).__name__} of "
                    f"block {i}: a decoding state does not record positions, so the new tokens would get the "
                    "features of position 0; use a position-independent feature map to generate")
    if max_new_tokens == 0:
        return idx.clone()
    logits, state = model(idx, attention_mask=attention_mask, return_state=True)  # (B, T, V)
    new = []
    for i in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, generator)                # (B, 1)
        new.append(nxt)
        if i + 1 < max_new_tokens:                                                   # the last is not fed back
            logits, state = model(nxt, state=state, return_state=True)                 # (B, 1, V)
    return torch.cat([idx, *new], dim=1)                                              # (B, T + new)


def sample_next(logits: Tensor, temperature: float, top_k: Optional[int], generator) -> Tensor:
    """One token per row of ``logits`` (B, V): argmax when ``temperature == 0``, else a draw."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)                   # (B, 1)
    logits = logits.float()
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]       # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # Shift first: (logits - max) <= 0, exactly 0 at the maximum, so dividing by a tiny temperature
    # gives 0 and -inf (never inf - inf = NaN). The temperature rounds to float32 here: to 0 (for
    # 0 < temperature < 1.4e-45) or inf (above 3.4e38); 0/0 and -inf/inf are then fixed to 0 and -inf.
    shifted = logits - logits.amax(dim=-1, keepdim=True)             # (B, V)
    scaled = torch.where(shifted == 0, 0.0, torch.where(shifted == float("-inf"), float("-inf"),
                                                        shifted / temperature))
    return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)  # (B, 1)


def check_temperature(value) -> float:
    """A finite real number >= 0 (Python or NumPy), as a Python float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a float, got {_checks.type_name(value)}")
    try:
        t = float(value)
    except OverflowError:                                                 # an int beyond float's range
        t = math.inf
    if not (t >= 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {value}")
    return t
