"""Bad input raises a clear ValueError/TypeError naming the argument (and, for shapes, what it got)."""
from __future__ import annotations

import math
import re

import pytest
import torch

import linattn

# Distinct sizes, so a message's numbers can be told apart.
B, H, T, D, DV = 2, 3, 5, 7, 11


def _qkv(dtype=torch.float32, Tq=T, Tk=T):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(B, H, Tq, D, generator=g).to(dtype),
        torch.randn(B, H, Tk, D, generator=g).to(dtype),
        torch.randn(B, H, Tk, DV, generator=g).to(dtype),
    )


def _state(S_shape=(B, H, D, DV), z_shape=(B, H, D), dtype=torch.float32):
    return linattn.LinearAttentionState(S=torch.zeros(S_shape, dtype=dtype), z=torch.ones(z_shape, dtype=dtype))


def _shape_text(shape):
    return ",".join(str(s) for s in shape)


def _squash(msg):
    return re.sub(r"\s+", "", msg)


def _raises(exc, name_pattern, fn, *, shows=()):
    """fn() raises exc; the message matches name_pattern and shows each of `shows` (spaces ignored)."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert re.search(name_pattern, msg), f"message does not name the argument ({name_pattern!r}): {msg!r}"
    for s in shows:
        assert _squash(str(s)) in _squash(msg), f"message does not show {s!r}: {msg!r}"
    return msg


LA = linattn.linear_attention
VT = (ValueError, TypeError)


# --------------------------------------------------------------------------------------
# linear_attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which,bad_shape,pattern", [
    ("q", (H, T, D), r"\bq\b"),
    ("k", (1, B, H, T, D), r"\bk\b"),
    ("v", (T, DV), r"\bv\b"),
])
def test_wrong_rank(which, bad_shape, pattern, causal):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = torch.randn(bad_shape)
    _raises(ValueError, pattern, lambda: LA(args["q"], args["k"], args["v"], causal=causal),
            shows=[_shape_text(bad_shape)])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which,bad_shape,pattern", [
    ("k", (1, H, T, D), r"\b(k|q)\b"),        # batch 1 vs 2: must not broadcast
    ("k", (B, H + 1, T, D), r"\b(k|q)\b"),    # heads
    ("k", (B, H, T, D + 1), r"\b(k|q)\b"),    # key dim vs query dim
    ("v", (B, H, T + 1, DV), r"\b(v|k)\b"),   # keys and values of different lengths
    ("v", (1, H, T, DV), r"\b(v|k|q)\b"),     # batch
    ("v", (B, 1, T, DV), r"\b(v|k|q)\b"),     # heads (1 would broadcast)
    ("q", (B, H, T, D + 2), r"\b(q|k)\b"),
])
def test_mismatched_shapes(which, bad_shape, pattern, causal):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = torch.randn(bad_shape)
    _raises(ValueError, pattern, lambda: LA(args["q"], args["k"], args["v"], causal=causal),
            shows=[_shape_text(bad_shape)])


@pytest.mark.parametrize("method", ["auto", "quadratic", "recurrent", "chunk"])
def test_causal_with_different_query_and_key_lengths(method):
    q, k, v = _qkv(Tq=T, Tk=T + 3)
    _raises(ValueError, r"causal", lambda: LA(q, k, v, causal=True, method=method), shows=[T, T + 3])
    LA(q, k, v, causal=False)  # fine without causal


@pytest.mark.parametrize("method", ["fast", "", "chunked", "para llel"])
def test_unknown_method(method):
    q, k, v = _qkv()
    _raises(ValueError, r"method", lambda: LA(q, k, v, method=method), shows=[method] if method else [])


def test_method_and_feature_map_names_ignore_case():
    q, k, v = _qkv()
    torch.testing.assert_close(LA(q, k, v, method="Parallel", feature_map="ELU+1"), LA(q, k, v))


@pytest.mark.parametrize("method,causal", [("parallel", True), ("recurrent", False), ("chunk", False)])
def test_method_not_available_for_this_causality(method, causal):
    q, k, v = _qkv()
    _raises(ValueError, r"method|" + method, lambda: LA(q, k, v, method=method, causal=causal), shows=[method])


def test_unknown_feature_map_name():
    q, k, v = _qkv()
    _raises(ValueError, r"feature[_ ]map|nope", lambda: LA(q, k, v, feature_map="nope"), shows=["nope"])
    _raises(ValueError, r"nope", lambda: linattn.get_feature_map("nope"))


@pytest.mark.parametrize("bad", [3, 2.5, ["elu+1"]])
def test_feature_map_of_wrong_type(bad):
    q, k, v = _qkv()
    _raises(TypeError, r"feature_map", lambda: LA(q, k, v, feature_map=bad))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, 1.0, "list"])
def test_non_tensor_input(which, bad):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].tolist() if bad == "list" else bad
    _raises(TypeError, rf"\b{which}\b", lambda: LA(args["q"], args["k"], args["v"]))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("which,pattern", [("k", r"\b(k|q)\b"), ("v", r"\b(v|q|k)\b"), ("q", r"\b(q|k)\b")])
def test_mismatched_dtypes(which, pattern, causal):
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].double()
    _raises(VT, pattern, lambda: LA(args["q"], args["k"], args["v"], causal=causal), shows=["float64"])
    args[which] = args[which].half()
    _raises(VT, pattern, lambda: LA(args["q"], args["k"], args["v"], causal=causal), shows=["float16"])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_floating_dtype(dtype):
    q, k, v = _qkv()
    q, k, v = (torch.ones(x.shape, dtype=dtype) for x in (q, k, v))
    _raises(VT, r"\b(q|k|v)\b", lambda: LA(q, k, v), shows=[str(dtype).replace("torch.", "")])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_shape", [(B, T + 1), (B, 1, T), (1, T), (B,), (B, H, T), (T, B)])
def test_attention_mask_wrong_shape(mask_shape, causal):
    q, k, v = _qkv()
    mask = torch.ones(mask_shape, dtype=torch.bool)
    _raises(ValueError, r"attention_mask", lambda: LA(q, k, v, attention_mask=mask, causal=causal),
            shows=[_shape_text(mask_shape)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_mask_wrong_dtype(dtype):
    q, k, v = _qkv()
    mask = torch.ones(B, T, dtype=dtype)  # an additive/float mask is not a bool "is real" mask
    _raises(VT, r"attention_mask", lambda: LA(q, k, v, attention_mask=mask), shows=[str(dtype).replace("torch.", "")])


def test_attention_mask_not_a_tensor():
    q, k, v = _qkv()
    _raises(TypeError, r"attention_mask", lambda: LA(q, k, v, attention_mask=[[True] * T] * B))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("S_shape,z_shape,bad", [
    ((B, H, D + 1, DV), (B, H, D), (B, H, D + 1, DV)),   # S with the wrong feature dim M
    ((B, H, D, DV + 1), (B, H, D), (B, H, D, DV + 1)),   # S with the wrong value dim
    ((1, H, D, DV), (B, H, D), (1, H, D, DV)),           # S batch (no broadcasting)
    ((B, H, D, DV), (B, H, D + 1), (B, H, D + 1)),       # z with the wrong M
    ((B, H, D, DV), (B, H, D, 1), (B, H, D, 1)),         # z of the wrong rank
    ((B, H, D, DV), (B, 1, D), (B, 1, D)),               # z heads
    ((H, D, DV), (B, H, D), (H, D, DV)),                 # S of the wrong rank
])
def test_initial_state_wrong_shapes(S_shape, z_shape, bad, causal):
    q, k, v = _qkv()
    # the state may already refuse an inconsistent (S, z) pair when it is built: either is fine
    _raises(ValueError, r"initial_state|\bS\b|\bz\b",
            lambda: LA(q, k, v, initial_state=_state(S_shape, z_shape), causal=causal), shows=[_shape_text(bad)])


def test_initial_state_wrong_shape_message_names_initial_state():
    q, k, v = _qkv()
    st = _state((B, H, D + 1, DV), (B, H, D + 1))  # a consistent state of the wrong size for these inputs
    _raises(ValueError, r"initial_state", lambda: LA(q, k, v, initial_state=st), shows=[_shape_text(st.S.shape)])


def test_initial_state_shape_follows_feature_map_dim():
    """With a feature map of M = 2D the state must be (B,H,2D,Dv): a (B,H,D,Dv) state is an error."""
    q, k, v = _qkv()
    fmap = lambda x: torch.cat([x.relu(), (-x).relu()], -1)  # noqa: E731
    _raises(ValueError, r"initial_state", lambda: LA(q, k, v, feature_map=fmap, initial_state=_state()))
    LA(q, k, v, feature_map=fmap, initial_state=_state((B, H, 2 * D, DV), (B, H, 2 * D)))


@pytest.mark.parametrize("method,causal", [("chunk", True), ("auto", True), ("auto", False), ("parallel", False)])
@pytest.mark.parametrize("chunk_size", [0, -1, -64])
def test_chunk_size_below_one(chunk_size, method, causal):
    q, k, v = _qkv()
    _raises(ValueError, r"chunk_size", lambda: LA(q, k, v, causal=causal, method=method, chunk_size=chunk_size),
            shows=[chunk_size])


@pytest.mark.parametrize("chunk_size", [2.5, 4.0, "8", None])
def test_chunk_size_not_an_int(chunk_size):
    q, k, v = _qkv()
    _raises(VT, r"chunk_size", lambda: LA(q, k, v, causal=True, method="chunk", chunk_size=chunk_size))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("eps", [0.0, -1e-6, -1.0, math.nan])
def test_eps_must_be_positive(eps, causal):
    q, k, v = _qkv()
    _raises(ValueError, r"\beps\b", lambda: LA(q, k, v, eps=eps, causal=causal), shows=[eps] if eps == eps else ["nan"])


def test_valid_inputs_do_not_raise():
    """The baseline used above is valid (so the errors above come from the one bad argument)."""
    q, k, v = _qkv()
    for causal in (False, True):
        out, st = LA(q, k, v, causal=causal, return_state=True, initial_state=_state(),
                     attention_mask=torch.ones(B, T, dtype=torch.bool))
        assert out.shape == (B, H, T, DV)


# --------------------------------------------------------------------------------------
# linear_attention_step
# --------------------------------------------------------------------------------------

STEP = linattn.linear_attention_step


def _qkv1(dtype=torch.float32):
    q, k, v = _qkv(dtype)
    return q[:, :, 0], k[:, :, 0], v[:, :, 0]


@pytest.mark.parametrize("which,bad_shape,pattern", [
    ("q", (B, H, 1, D), r"\bq\b"),
    ("k", (B, H, D + 1), r"\b(k|q)\b"),
    ("v", (B + 1, H, DV), r"\b(v|q|k)\b"),
    ("v", (B, H), r"\bv\b"),
])
def test_step_bad_shapes(which, bad_shape, pattern):
    q, k, v = _qkv1()
    args = {"q": q, "k": k, "v": v}
    args[which] = torch.randn(bad_shape)
    _raises(ValueError, pattern, lambda: STEP(args["q"], args["k"], args["v"]), shows=[_shape_text(bad_shape)])


@pytest.mark.parametrize("S_shape,z_shape,bad", [
    ((B, H, D + 1, DV), (B, H, D), (B, H, D + 1, DV)),
    ((B, H, D, DV), (B, H, D + 1), (B, H, D + 1)),
    ((B, H, D, DV - 1), (B, H, D), (B, H, D, DV - 1)),
])
def test_step_bad_state(S_shape, z_shape, bad):
    q, k, v = _qkv1()
    _raises(ValueError, r"state|\bS\b|\bz\b", lambda: STEP(q, k, v, _state(S_shape, z_shape)),
            shows=[_shape_text(bad)])


def test_step_other_bad_arguments():
    q, k, v = _qkv1()
    _raises(ValueError, r"\beps\b", lambda: STEP(q, k, v, eps=0.0))
    _raises(ValueError, r"feature[_ ]map|nope", lambda: STEP(q, k, v, feature_map="nope"))
    _raises(TypeError, r"\bq\b", lambda: STEP(q.tolist(), k, v))
    _raises(VT, r"\b(k|q)\b", lambda: STEP(q, k.double(), v))
    _raises(VT, r"\b(q|k|v)\b", lambda: STEP(*(torch.ones(x.shape, dtype=torch.int64) for x in (q, k, v))))


# --------------------------------------------------------------------------------------
# softmax_attention
# --------------------------------------------------------------------------------------

SA = linattn.softmax_attention


def test_softmax_bad_inputs():
    q, k, v = _qkv()
    _raises(ValueError, r"\bq\b", lambda: SA(q[0], k, v), shows=[_shape_text(q[0].shape)])
    _raises(ValueError, r"\b(k|q)\b", lambda: SA(q, torch.randn(B, H, T, D + 1), v))
    _raises(ValueError, r"\b(v|k)\b", lambda: SA(q, k, torch.randn(B, H, T + 1, DV)))
    _raises(ValueError, r"\b(k|q)\b", lambda: SA(q, torch.randn(1, H, T, D), v))
    _raises(ValueError, r"attention_mask", lambda: SA(q, k, v, attention_mask=torch.ones(B, T + 1, dtype=torch.bool)))
    _raises(VT, r"attention_mask", lambda: SA(q, k, v, attention_mask=torch.ones(B, T)))
    _raises(TypeError, r"\bv\b", lambda: SA(q, k, v.tolist()))
    _raises(VT, r"\b(q|k)\b", lambda: SA(q, k.double(), v))


# --------------------------------------------------------------------------------------
# utils
# --------------------------------------------------------------------------------------


def test_set_seed_reproducible():
    linattn.set_seed(123)
    a = torch.randn(5)
    linattn.set_seed(123)
    b = torch.randn(5)
    assert torch.equal(a, b)
    linattn.set_seed(124)
    assert not torch.equal(torch.randn(5), a)


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), ("1", TypeError), (1.5, TypeError)])
def test_set_seed_bad(bad, exc):
    _raises(exc, r"seed", lambda: linattn.set_seed(bad))


def test_default_device():
    dev = linattn.default_device()
    assert isinstance(dev, torch.device)
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")


# --- edge values found by trying to break the package ---------------------------------


@pytest.mark.parametrize("eps", [1e-50, 1e39, 10**400])
def test_eps_outside_the_float32_range_is_rejected(eps):
    # 1e-50 would underflow to 0 in float32 (0/0 = NaN for a zero ReLU normaliser).
    q, k, v = _qkv()
    _raises(ValueError, r"eps", lambda: LA(q.float(), k.float(), v.float(), eps=eps))


@pytest.mark.parametrize("scale", [1e39, 10**400])
def test_softmax_scale_outside_the_float32_range_is_rejected(scale):
    q, k, v = _qkv()
    _raises(ValueError, r"scale", lambda: linattn.softmax_attention(q.float(), k.float(), v.float(), scale=scale))


def test_numpy_scalars_are_accepted_for_flags_and_sizes():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    want = LA(q, k, v, causal=True, chunk_size=4, eps=1e-6)
    got = LA(q, k, v, causal=np.bool_(True), chunk_size=np.int64(4), eps=np.float32(1e-6))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_and_values_holding_nan_or_inf_contribute_nothing(causal):
    q, k, v = _qkv()
    B, T = q.shape[0], q.shape[2]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T // 2:] = False
    clean = LA(q, k, v, causal=causal, attention_mask=mask)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, T // 2:] = float("nan")
    v_bad[0, :, T // 2:] = float("inf")
    got = LA(q, k_bad, v_bad, causal=causal, attention_mask=mask)
    torch.testing.assert_close(got, clean, rtol=0, atol=0)


def test_state_parts_must_share_dtype_and_device():
    S = torch.zeros(1, 2, 3, 4)
    _raises(ValueError, r"state\.S and state\.z", lambda: linattn.LinearAttentionState(S, torch.zeros(1, 2, 3, dtype=torch.float64)))


@pytest.mark.parametrize("bad", [1.5, 0, True])
def test_state_zeros_checks_sizes(bad):
    _raises((TypeError, ValueError), r"batch", lambda: linattn.LinearAttentionState.zeros(bad, 3, 4, 5))


def test_step_names_the_head_dim_mismatch():
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 6)
    _raises(ValueError, r"head_dim", lambda: linattn.linear_attention_step(q, k, v))
