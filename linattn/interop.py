"""Layers as transformers ships them, loaded into :class:`~linattn.LinearMixer` with their weights.

``from_transformers(layer)`` takes Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's
``Qwen3_5GatedDeltaNet`` and ``Qwen3_5MoeGatedDeltaNet`` (the same layer with its projections
unfused) or Kimi Linear's
``KimiLinearDeltaAttention`` and returns a :class:`~linattn.LinearMixer` that computes the same
function. transformers is not imported here: the layer is read through its attributes, so this
module imports (and ``import linattn`` works) without transformers installed.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from . import _checks
from .layers.mixer import LinearMixer

__all__ = ["from_transformers", "SUPPORTED_LAYERS"]

SUPPORTED_LAYERS = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                    "KimiLinearDeltaAttention")
"""The class names of the transformers layers :func:`from_transformers` converts."""


def from_transformers(layer: nn.Module) -> LinearMixer:
    """A :class:`~linattn.LinearMixer` with the weights of a transformers linear-attention layer.

    The mapping (transformers 5.x; Yang et al., 2025, Gated DeltaNet; Kimi Team, 2025, Kimi Linear):

    - **Qwen3-Next / Qwen3.5** (``Qwen3NextGatedDeltaNet``, ``Qwen3_5[Moe]GatedDeltaNet``):
      ``rule="gated_delta"``, ``n_heads`` = ``linear_num_key_heads``, ``n_v_heads`` =
      ``linear_num_value_heads`` (value head ``j`` reads query/key head ``j // (H_v / H)``),
      ``head_dim``/``v_head_dim`` = ``linear_key_head_dim``/``linear_value_head_dim``. Qwen3-Next's
      fused ``in_proj_qkvz`` (per key head: ``q``, ``k``, its value heads, their gates) and
      ``in_proj_ba`` (per key head: ``b``, then ``a`` of its value heads) are split into
      ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (the SiLU output gate ``z``), ``b_proj``,
      ``a_proj``; ``conv1d`` (over ``q``, ``k``, ``v`` side by side), ``A_log``, ``dt_bias``,
      ``norm`` (RMSNorm over ``Dv``, then ``silu(z)``) and ``out_proj`` are copied.
    - **Kimi Linear** (``KimiLinearDeltaAttention``): ``rule="kda"`` (one decay per key channel),
      ``forget_gate.f_a_proj``/``f_b_proj`` -> ``a_proj`` (low rank ``Dk``), ``forget_gate.A_log``
      and ``dt_bias``, ``b_proj``; the output gate ``sigmoid(g_b_proj(g_a_proj(x)))`` ->
      ``output_gate="sigmoid"``, ``gate_rank=Dk``; ``o_norm`` and ``o_proj``.

    In both, ``q`` and ``k`` are L2-normalised as FLA does (``qk_norm="fla"``), ``q`` is
    scaled by ``Dk^(-1/2)``, ``β = sigmoid(b)`` and ``log α = −exp(A_log) · softplus(a + dt_bias)``;
    the RMSNorm's ε is the layer's. transformers' ``attention_mask`` zeroes padded inputs
    (their tokens still write and decay the state); ``LinearMixer``'s removes padded tokens.

    Parameters
    ----------
    layer : nn.Module
        One of :data:`SUPPORTED_LAYERS`, with SiLU as its convolution's activation and no
        convolution bias.

    Returns
    -------
    LinearMixer
        New parameters (copies) in the dtype and on the device of ``layer``'s output
        projection; ``forward(x)`` on ``(B, T, d_model)`` returns ``(B, T, d_model)``, and
        ``return_state=True`` / ``state=`` decode token by token.

    Raises
    ------
    TypeError
        ``layer`` is not one of :data:`SUPPORTED_LAYERS`.
    ValueError
        A layer whose convolution has a bias or whose activation is not SiLU.
    """
    kind = type(layer).__name__
    if not isinstance(layer, nn.Module) or kind not in SUPPORTED_LAYERS:
        raise TypeError(f"layer must be one of transformers' {', '.join(SUPPORTED_LAYERS)}, got "
                        f"{_checks.type_name(layer)}")
    if layer.conv1d.bias is not None or layer.activation not in ("silu", "swish"):
        raise ValueError(f"{kind} with conv1d.bias={layer.conv1d.bias is not None} and activation="
                         f"{layer.activation!r}: LinearMixer's short convolution has no bias and applies SiLU")
    if kind == "KimiLinearDeltaAttention":
        return _from_kimi(layer)
    return _from_qwen(layer, fused=kind == "Qwen3NextGatedDeltaNet")


def _from_qwen(layer: nn.Module, fused: bool) -> LinearMixer:
    """Qwen3-Next (``fused``: ``in_proj_qkvz``, ``in_proj_ba``) or Qwen3.5 (``in_proj_qkv``, ``_z``, ``_b``, ``_a``)."""
    H, Hv, Dk, Dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    r = Hv // H
    mixer = _new_mixer(layer, d_model=layer.hidden_size, n_heads=H, rule="gated_delta", n_v_heads=Hv, head_dim=Dk,
                       v_head_dim=Dv, conv_size=layer.conv_kernel_size, output_gate="silu",
                       norm_eps=layer.layer_norm_epsilon)
    d = layer.hidden_size
    if fused:
        qkvz = layer.in_proj_qkvz.weight.view(H, 2 * Dk + 2 * r * Dv, d)    # per key head: q, k, r v, r z
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
        b, a = layer.in_proj_ba.weight.view(H, 2 * r, d).split([r, r], dim=1)
        q, k, v, z, b, a = (w.reshape(-1, d) for w in (q, k, v, z, b, a))   # heads in order, value head j = r·h + i
    else:
        q, k, v = layer.in_proj_qkv.weight.split([H * Dk, H * Dk, Hv * Dv], dim=0)
        z, b, a = layer.in_proj_z.weight, layer.in_proj_b.weight, layer.in_proj_a.weight
    _copy({mixer.q_proj.weight: q, mixer.k_proj.weight: k, mixer.v_proj.weight: v, mixer.g_proj.weight: z,
           mixer.b_proj.weight: b, mixer.a_proj.weight: a, mixer.conv.weight: layer.conv1d.weight,
           mixer.A_log: layer.A_log, mixer.dt_bias: layer.dt_bias, mixer.o_norm: layer.norm.weight,
           mixer.out_proj.weight: layer.out_proj.weight})
    return mixer


def _from_kimi(layer: nn.Module) -> LinearMixer:
    H, D = layer.num_heads, layer.head_dim
    gate = layer.forget_gate
    mixer = _new_mixer(layer, d_model=layer.hidden_size, n_heads=H, rule="kda", head_dim=D,
                       conv_size=layer.conv_kernel_size, output_gate="sigmoid", gate_rank=D,
                       norm_eps=layer.layer_norm_epsilon)
    _copy({mixer.q_proj.weight: layer.q_proj.weight, mixer.k_proj.weight: layer.k_proj.weight,
           mixer.v_proj.weight: layer.v_proj.weight, mixer.conv.weight: layer.conv1d.weight,
           mixer.a_proj[0].weight: gate.f_a_proj.weight, mixer.a_proj[1].weight: gate.f_b_proj.weight,
           mixer.A_log: gate.A_log.reshape(H), mixer.dt_bias: gate.dt_bias, mixer.b_proj.weight: layer.b_proj.weight,
           mixer.g_proj[0].weight: layer.g_a_proj.weight, mixer.g_proj[1].weight: layer.g_b_proj.weight,
           mixer.o_norm: layer.o_norm.weight, mixer.out_proj.weight: layer.o_proj.weight})
    return mixer


def _new_mixer(layer: nn.Module, **options) -> LinearMixer:
    """A LinearMixer of ``options`` (no biases, FLA's L2 norm) in the dtype and on the device of ``layer``."""
    weight = layer.out_proj.weight if hasattr(layer, "out_proj") else layer.o_proj.weight
    mixer = LinearMixer(options.pop("d_model"), options.pop("n_heads"), qk_norm="fla", bias=False, **options)
    return mixer.to(device=weight.device, dtype=weight.dtype)


def _copy(pairs: dict[nn.Parameter, Tensor]) -> None:
    """Copy each source into its parameter (shapes checked: a mismatch is a bug of the mapping)."""
    with torch.no_grad():
        for target, source in pairs.items():
            if tuple(target.shape) != tuple(source.shape):
                raise ValueError(f"cannot copy a {_checks.shape_str(source.shape)} weight into a LinearMixer "
                                 f"parameter of shape {_checks.shape_str(target.shape)}")
            target.copy_(source)
