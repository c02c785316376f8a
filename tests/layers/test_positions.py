"""Tests of positions: rotary embeddings (softmax and φ-linear layers), learned / rope / none in TransformerLM.

The references build RoFormer's rotation matrices explicitly (block-diagonal 2×2 rotations
of the channel pairs (i, i + D/2)) in float64; they use the layers' weights but none of
linattn's functions.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from linattn import LinearAttention, SoftmaxAttention, TransformerConfig, TransformerLM, apply_rope
from linattn.layers.positions import DEFAULT_POSITIONS, POSITIONS

VOCAB = 23


def rotation(p: int, D: int, base: float = 10000.0) -> torch.Tensor:
    """RoFormer's R_p (D×D), GPT-NeoX pairing: channel i turns with channel i + D/2 by p·base^(-2i/D)."""
    R = torch.zeros(D, D, dtype=torch.float64)
    for i in range(D // 2):
        a = p * base ** (-2 * i / D)
        c, s = torch.cos(torch.tensor(a, dtype=torch.float64)), torch.sin(torch.tensor(a, dtype=torch.float64))
        j = i + D // 2
        R[i, i], R[i, j], R[j, i], R[j, j] = c, -s, s, c
    return R


def _heads(t, n):
    B, T, _ = t.shape
    return t.view(B, T, n, -1).transpose(1, 2)                          # (B, n, T, D)


def _model(attention="linear", positions="rope", *, seed=0, max_len=None, n_layers=2, **kwargs):
    torch.manual_seed(seed)
    return TransformerLM(VOCAB, 32, n_layers, 4, attention=attention, positions=positions, max_len=max_len,
                         chunk_size=8, **kwargs).eval()


def _ids(*shape, seed=1):
    return torch.randint(VOCAB, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------
# apply_rope
# ---------------------------------------------------------------------------------------


def test_apply_rope_is_the_rotation_of_each_channel_pair():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 7, 300], [4, 4, 5, 9, 10]])
    want = torch.empty_like(x)
    for b in range(2):
        for t in range(5):
            want[b, :, t] = x[b, :, t] @ rotation(int(pos[b, t]), 8).T
    torch.testing.assert_close(apply_rope(x, pos), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(apply_rope(x, torch.zeros(2, 5, dtype=torch.long)), x, rtol=0, atol=0)


def test_rotated_dot_products_depend_on_the_relative_position_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 6, 16, dtype=torch.float64), torch.randn(1, 2, 6, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 4, 9, 10, 20]])
    scores = apply_rope(q, pos) @ apply_rope(k, pos).transpose(-1, -2)
    shifted = apply_rope(q, pos + 1000) @ apply_rope(k, pos + 1000).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(scores, q @ k.transpose(-1, -2))              # the positions do enter


def test_apply_rope_errors_and_dtypes():
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="last dimension of x must be even"):
        apply_rope(torch.randn(1, 2, 3, 7), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"positions must be an int64 tensor of shape \(batch, seq\) = \(1, 3\)"):
        apply_rope(x, torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"positions must have shape \(batch, seq\) = \(1, 3\), got \(3\)"):
        apply_rope(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be a tensor of positions >= 0, got -1"):
        apply_rope(x, torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match="base must be > 1"):
        apply_rope(x, torch.zeros(1, 3, dtype=torch.long), base=1.0)
    pos = torch.arange(3)[None]
    half = apply_rope(x.bfloat16(), pos)
    assert half.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert apply_rope(x, pos).dtype == torch.float32
    torch.testing.assert_close(half.float(), apply_rope(x, pos), rtol=0.02, atol=0.02)


# ---------------------------------------------------------------------------------------
# Softmax attention with RoPE
# ---------------------------------------------------------------------------------------


def test_softmax_rope_layer_equals_the_rotated_reference():
    torch.manual_seed(0)
    layer = SoftmaxAttention(16, 2, causal=True, rope=True).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    q, k, v = (_heads(p(x), 2) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    R = torch.stack([rotation(t, 8) for t in range(6)])                 # (T, D, D)
    rq, rk = torch.einsum("tij,bhtj->bhti", R, q), torch.einsum("tij,bhtj->bhti", R, k)
    scores = (rq @ rk.transpose(-1, -2)) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 16)
    torch.testing.assert_close(layer(x), layer.out_proj(y), rtol=1e-12, atol=1e-12)


def test_softmax_rope_outputs_are_unchanged_by_shifting_every_position():
    torch.manual_seed(0)
    layer = SoftmaxAttention(16, 2, n_kv_heads=1, causal=True, rope=True).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        y = layer(x, positions=pos)
        torch.testing.assert_close(layer(x, positions=pos + 517), y, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(layer(x), y, rtol=0, atol=0)          # default: counted from 0
        assert not torch.allclose(layer(x, positions=pos * 2), y)        # relative positions do matter


def test_softmax_rope_counts_positions_after_the_cache():
    torch.manual_seed(0)
    layer = SoftmaxAttention(16, 2, causal=True, rope=True).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    mask = torch.tensor([[False, False] + [True] * 7, [True] * 9])
    with torch.no_grad():
        full = layer(x, attention_mask=mask)
        y, cache = layer(x[:, :5], attention_mask=mask[:, :5], return_state=True)
        rest = layer(x[:, 5:], state=cache)                              # positions 3.. and 5..
    torch.testing.assert_close(torch.cat([y, rest], dim=1)[mask], full[mask], rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------
# Linear attention with RoPE: rotated numerator, plain normaliser (RoFormer, eq. 19)
# ---------------------------------------------------------------------------------------


def _linear_rope_reference(layer, x, mask, causal):
    """y_i = Σ_j (R_i φ(q_i))ᵀ(R_j φ(k_j)) v_j / Σ_j φ(q_i)ᵀφ(k_j), T×T explicitly.

    The sums run over the real tokens j (j <= i when causal)."""
    B, T, _ = x.shape
    H, G, D = layer.n_heads, layer.group_size, layer.head_dim
    q = F.elu(_heads(layer.q_proj(x), H)) + 1
    k = (F.elu(_heads(layer.k_proj(x), layer.n_kv_heads)) + 1).repeat_interleave(G, dim=1)
    v = _heads(layer.v_proj(x), layer.n_kv_heads).repeat_interleave(G, dim=1)
    y = torch.zeros(B, H, T, D, dtype=torch.float64)
    for b in range(B):
        pos = (mask[b].long().cumsum(0) - 1).clamp_min(0)                 # real tokens before
        R = torch.stack([rotation(int(p), D) for p in pos])
        for h in range(H):
            for i in range(T):
                num, den = torch.zeros(D, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
                for j in range(T):
                    if not mask[b, j] or (causal and j > i):
                        continue
                    num = num + ((R[i] @ q[b, h, i]) @ (R[j] @ k[b, h, j])) * v[b, h, j]
                    den = den + q[b, h, i] @ k[b, h, j]
                y[b, h, i] = num / den
    return layer.out_proj(y.transpose(1, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("causal", [True, False])
def test_linear_rope_rotates_the_numerator_not_the_normaliser(causal):
    torch.manual_seed(0)
    layer = LinearAttention(16, 4, n_kv_heads=2, causal=causal, rope=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    with torch.no_grad():
        got = layer(x, attention_mask=mask)
        want = _linear_rope_reference(layer, x, mask, causal)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-12)


def test_linear_rope_decoding_carries_the_rotated_sum_and_the_plain_normaliser():
    torch.manual_seed(0)
    layer = LinearAttention(16, 4, n_kv_heads=2, causal=True, rope=True).double()
    plain = LinearAttention(16, 4, n_kv_heads=2, causal=True).double()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full, full_state = layer(x, return_state=True)
        y, state = layer(x[:, :4], return_state=True)
        outs = [y]
        for t in range(4, 9):
            y, state = layer(x[:, t:t + 1], state=state, positions=pos[:, t:t + 1], return_state=True)
            outs.append(y)
        _, plain_state = plain(x, return_state=True)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.S, full_state.S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.z, plain_state.z, rtol=1e-12, atol=1e-12)    # z = Σ φ(k_j), not rotated
    assert not torch.allclose(state.S, plain_state.S)                               # S = Σ R_j φ(k_j) v_jᵀ
    assert state.nbytes == plain_state.nbytes


def test_rope_layers_refuse_what_they_cannot_do():
    x = torch.randn(1, 4, 16)
    layer = LinearAttention(16, 2, causal=True, rope=True)
    _, state = layer(x, return_state=True)
    with pytest.raises(ValueError, match="positions .* must be given to continue a state with rope=True"):
        layer(x[:, :1], state=state)
    with pytest.raises(ValueError, match="positions is only used by a layer built with rope=True"):
        LinearAttention(16, 2, causal=True)(x, positions=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="positions is only used by a layer built with rope=True"):
        SoftmaxAttention(16, 2, causal=True)(x, positions=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions must have shape \(batch, seq\) = \(1, 4\)"):
        layer(x, positions=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="rope=True .* needs an even head_dim, got head_dim=5"):
        SoftmaxAttention(10, 2, rope=True)
    odd_map = lambda t: torch.cat([F.elu(t) + 1, torch.ones_like(t[..., :1])], dim=-1)  # noqa: E731
    with pytest.raises(ValueError, match="rope=True rotates pairs of features, but feature_map=.* gives an odd "
                                         "number of features, M=9, for head_dim=8"):
        LinearAttention(16, 2, causal=True, rope=True, feature_map=odd_map)
    layer.feature_map = odd_map                                           # replaced after construction
    with pytest.raises(ValueError, match="even number of features, got M=9"):
        layer(x)
    with pytest.raises(ValueError, match="rope_base must be > 1"):
        LinearAttention(16, 2, rope=True, rope_base=0.5)
    with pytest.raises(TypeError, match="rope must be a bool"):
        SoftmaxAttention(16, 2, rope="yes")


def test_taylor_features_with_rope_are_refused_when_the_model_is_built():
    """1 + D + D(D+1)/2 features: odd whenever D % 4 == 0, and RoPE turns pairs. The model is refused
    when built (not at its first forward); without rope, or with D % 4 == 2, Taylor runs."""
    with pytest.raises(ValueError, match=r"feature_map='taylor' gives an odd number of features, M=45, for "
                                         r"head_dim=8 .* positions='none' or 'learned'"):
        TransformerLM(65, 32, 1, 4, feature_map="taylor")                # positions="rope" by default
    for model in (TransformerLM(65, 32, 1, 4, feature_map="taylor", positions="none"),
                  TransformerLM(65, 24, 1, 4, feature_map="taylor")):     # head_dim 6: M = 28, even
        assert model(torch.randint(65, (1, 5))).shape == (1, 5, 65)


# ---------------------------------------------------------------------------------------
# TransformerLM: learned, rope, none
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["linear", "softmax"])
@pytest.mark.parametrize("positions", POSITIONS)
def test_model_decoding_equals_the_forward_pass_for_every_position_scheme(positions, attention):
    model = _model(attention, positions, max_len=32 if positions == "learned" else None)
    idx = _ids(2, 19)
    with torch.no_grad():
        full = model(idx)
        logits, state = model(idx[:, :5], return_state=True)
        outs = [logits]
        for t in range(5, 19):
            logits, state = model(idx[:, t:t + 1], state=state, return_state=True)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_rope_left_padded_prompt_equals_the_prompt_alone(attention):
    model = _model(attention, "rope")
    prompt = _ids(1, 9)
    idx = torch.cat([torch.full((1, 4), 3), prompt], dim=1)
    mask = torch.tensor([[False] * 4 + [True] * 9])
    with torch.no_grad():
        alone, padded = model(prompt), model(idx, attention_mask=mask)
    torch.testing.assert_close(padded[:, 4:], alone, rtol=1e-5, atol=1e-5)
    out = model.generate(idx, 8, temperature=0.0, attention_mask=mask)
    assert torch.equal(out[:, 13:], model.generate(prompt, 8, temperature=0.0)[:, 9:])


def test_the_schemes_build_different_models():
    learned, rope, none = (_model("softmax", p, max_len=32 if p == "learned" else None) for p in POSITIONS)
    assert learned.pos_emb.num_embeddings == 32 and rope.pos_emb is None and none.pos_emb is None
    assert all(b.attn.rope for b in rope.blocks) and not any(b.attn.rope for b in none.blocks)
    none.load_state_dict(rope.state_dict())                              # the same weights
    idx = _ids(1, 12)
    with torch.no_grad():
        assert not torch.allclose(rope(idx), none(idx), atol=1e-4)       # rotation makes the difference


def test_chapter_8_model_is_the_learned_scheme_with_max_len():
    model = _model("linear", "learned", max_len=16)
    assert not any(b.attn.rope for b in model.blocks)
    with pytest.raises(ValueError, match=r"position of every token must be < max_len=16 \(the model's learned"):
        model(_ids(1, 17))
    with pytest.raises(ValueError, match="max_len=16"):
        model.generate(_ids(1, 10), 7)


def test_default_positions_is_one_constant_that_does_not_bound_generation():
    assert inspect.signature(TransformerLM).parameters["positions"].default == DEFAULT_POSITIONS
    assert TransformerConfig(10, 8, 1, 2).positions == DEFAULT_POSITIONS != "learned"
    model = TransformerLM(VOCAB, 16, 1, 2)
    assert model.config.positions == DEFAULT_POSITIONS and model.config.max_len is None and model.pos_emb is None


def test_rope_and_none_take_max_len_as_an_optional_limit():
    model = _model("linear", "rope", max_len=12)
    assert model.generate(_ids(1, 4), 8, temperature=0.0).shape == (1, 12)
    with pytest.raises(ValueError, match=r"makes 13 tokens but the model has max_len=12"):
        model.generate(_ids(1, 4), 9)
    with pytest.raises(ValueError, match=r"< max_len=12 \(the limit the model was built with"):
        model(_ids(1, 13))


@pytest.mark.parametrize("attention, positions", [("linear", "rope"), ("linear", "none"), ("gated_delta", "rope")])
def test_linear_lm_generates_2000_tokens_from_a_state_of_constant_size(attention, positions):
    torch.manual_seed(0)
    model = TransformerLM(11, 8, 1, 2, attention=attention, positions=positions, mlp_ratio=1).eval()
    out = model.generate(_ids(1, 3) % 11, 2000, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 2003)
    with torch.no_grad():
        _, at_10 = model(out[:, :10], return_state=True)
        logits, at_2000 = model(out[:, :2000], return_state=True)
        step, _ = model(out[:, 2000:2001], state=at_2000, return_state=True)
    assert at_10.nbytes == at_2000.nbytes == model.decoding_state_nbytes(10) == model.decoding_state_nbytes(2000)
    assert at_2000.positions.tolist() == [2000] and torch.isfinite(logits).all() and torch.isfinite(step).all()


def test_bad_positions_arguments():
    with pytest.raises(ValueError, match=r"positions must be one of \('learned', 'rope', 'none'\), got 'alibi'"):
        TransformerLM(VOCAB, 16, 1, 2, positions="alibi")
    with pytest.raises(TypeError, match="positions must be a str"):
        TransformerLM(VOCAB, 16, 1, 2, positions=None)
    with pytest.raises(ValueError, match="positions='learned' needs max_len"):
        TransformerLM(VOCAB, 16, 1, 2, positions="learned")
    with pytest.raises(ValueError, match="needs an even head_dim"):
        TransformerLM(VOCAB, 18, 1, 6, attention="softmax", positions="rope")
