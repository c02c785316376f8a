"""Peers from other libraries, timed by ``python -m linattn.bench --decay`` beside linattn when importable."""
from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

__all__ = ["PEER_VARIANT", "transformers_gated_delta", "gated_delta_peer_call"]

PEER_VARIANT = "transformers_gdn"
"""The variant name of transformers' chunked gated delta rule in the decay benchmark's rows."""


def transformers_gated_delta() -> Optional[tuple[Callable, str]]:
    """transformers' ``torch_chunk_gated_delta_rule`` and a label naming it, or None without transformers.

    It is the PyTorch chunked form that Qwen3-Next's and Qwen3.5's layers run where
    flash-linear-attention's kernel cannot (on the CPU): its undecorated function, so that an
    installed FLA never stands in for it.
    """
    try:
        import transformers
        from transformers.models.qwen3_next import modeling_qwen3_next
    except Exception:  # noqa: BLE001  (not installed, or an install that does not import)
        return None
    fn = modeling_qwen3_next.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn), f"transformers {transformers.__version__} torch_chunk_gated_delta_rule"


def gated_delta_peer_call(peer: Callable, log_g: Tensor, beta: Tensor, chunk_size: int) -> Callable:
    """``(q, k, v) -> out`` in linattn's ``(B, H, T, D)`` layout through ``peer``, which takes
    ``(B, T, H, D)`` tensors and ``(B, T, H)`` gates (transposed views: transformers' own
    ``transpose(1, 2)`` then finds them contiguous and copies nothing) and scales ``q`` by
    ``D^(-1/2)`` itself, as linattn's ``gated_delta_rule(q · D^(-1/2), k, v, log_g, beta)`` does."""
    g_t, beta_t = log_g.transpose(1, 2), beta.transpose(1, 2)                 # (B, T, H)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, _ = peer(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g=g_t, beta=beta_t,
                      chunk_size=chunk_size, output_final_state=False, use_qk_l2norm_in_kernel=False)
        return out.transpose(1, 2)                                            # (B, H, T, Dv)

    return call
