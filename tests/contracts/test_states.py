"""Returned states own their memory, share one layout across methods, compare by value, and are
re-validated each time they are used."""
from __future__ import annotations

import pytest
import torch

import linattn
from linattn import distributed

B, H, T, D = 2, 3, 9, 4


def _qkv(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))


def _storages(*tensors):
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _identity(x):
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature_map", [None, _identity, "elu+1"])
def test_step_state_does_not_alias_the_inputs(dtype, feature_map):
    q, k, v = (x[:, :, 0].abs() for x in _qkv(dtype=dtype))
    _, st = linattn.linear_attention_step(q, k, v, feature_map=feature_map)
    assert not _storages(st.S, st.z) & _storages(q, k, v)
    k_before = k.clone()
    st.z.add_(1.0)                                    # editing the state leaves the token alone
    assert torch.equal(k, k_before)
    _, st2 = linattn.linear_attention_step(q, k, v, st, feature_map=feature_map)
    assert not _storages(st2.S, st2.z) & _storages(q, k, v, st.S, st.z)


CALLS = {
    "linear_attention-" + m: (lambda q, k, v, s, m=m: linattn.linear_attention(
        q, k, v, causal=m != "parallel", method=m, chunk_size=4, initial_state=s, return_state=True))
    for m in ("parallel", "quadratic", "recurrent", "chunk")
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("feature_map_none", [True, False])
def test_returned_states_own_their_memory_and_share_one_layout(name, feature_map_none):
    q, k, v = (x.abs() for x in _qkv())
    s0 = linattn.LinearAttentionState(torch.rand(B, H, D, D), torch.rand(B, H, D))
    _, st = CALLS[name](q, k, v, s0)
    assert st.S.is_contiguous() and st.z.is_contiguous(), name
    assert st.S.untyped_storage().nbytes() == st.S.numel() * st.S.element_size()   # no shared buffer
    assert not _storages(st.S, st.z) & _storages(q, k, v, s0.S, s0.z)
    assert st.S.untyped_storage().data_ptr() != st.z.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", ["retention", "gated_linear_attention", "delta_rule", "gated_delta_rule"])
def test_decay_states_own_their_memory(name):
    q, k, v = _qkv()
    extra = {"retention": (0.9,), "gated_linear_attention": (torch.zeros(B, H, T, D),),
             "delta_rule": (torch.full((B, H, T), 0.5),),
             "gated_delta_rule": (torch.zeros(B, H, T), torch.full((B, H, T), 0.5))}[name]
    S0 = torch.rand(B, H, D, D)
    for method in ("chunk", "recurrent"):
        _, S = getattr(linattn, name)(q, k, v, *extra, method=method, initial_state=S0, return_state=True)
        assert S.is_contiguous() and not _storages(S) & _storages(q, k, v, S0)


def test_local_state_owns_its_memory():
    q, k, v = _qkv()
    st = distributed.local_state(k, v, feature_map=None)
    assert not _storages(st.S, st.z) & _storages(k, v)


def test_equality_is_by_value():
    a = linattn.LinearAttentionState(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2))
    b = linattn.LinearAttentionState(torch.ones(1, 1, 2, 3), torch.ones(1, 1, 2))
    c = linattn.LinearAttentionState(torch.ones(1, 1, 2, 3), torch.zeros(1, 1, 2))
    d = a.to(torch.float64)
    assert (a == b) is True and (a != c) is True and (a == d) is False and (a == "state") is False


def test_a_mutated_state_is_validated_when_used():
    q, k, v = (x[:, :, 0] for x in _qkv())
    _, st = linattn.linear_attention_step(q, k, v)
    broken = [("S", None, TypeError, r"state\.S must be a torch\.Tensor, got NoneType"),
              ("z", torch.zeros(B, H, D, dtype=torch.long), TypeError, r"state\.z must be a floating-point"),
              ("z", torch.zeros(B, H, D + 1), ValueError, r"state\.S \(B, H, M, Dv\) and state\.z \(B, H, M\) disagree"),
              ("S", torch.zeros(B, H, D, D, dtype=torch.float64), ValueError, r"must share dtype and device")]
    for attr, value, error, match in broken:
        st2 = linattn.LinearAttentionState(st.S.clone(), st.z.clone())
        setattr(st2, attr, value)
        with pytest.raises(error, match=match):
            linattn.linear_attention_step(q, k, v, st2)
        with pytest.raises(error, match=match.replace("state", "initial_state")):
            linattn.linear_attention(q[:, :, None], k[:, :, None], v[:, :, None], causal=True, initial_state=st2)
