"""Feature maps: elu_plus_one, relu, get_feature_map, and their use by name / object in linear_attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from refimpl import rand_qkv

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _x(dtype=torch.float64, shape=(2, 3, 17, 5)):
    g = torch.Generator().manual_seed(0)
    return (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elu_plus_one_values_shape_dtype(dtype):
    x = _x(dtype)
    y = linattn.elu_plus_one(x)
    assert y.shape == x.shape and y.dtype == dtype
    expected = F.elu(x.double()) + 1
    tol = dict(rtol=0, atol=0) if dtype == torch.float64 else None
    if tol is None:
        torch.testing.assert_close(y.double(), expected, rtol=2 * torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps)
    else:
        torch.testing.assert_close(y, expected, rtol=1e-15, atol=1e-15)


def test_elu_plus_one_is_nonnegative_and_positive_for_moderate_inputs():
    x = torch.linspace(-60, 60, 10001, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        y = linattn.elu_plus_one(x.to(dtype))
        assert (y >= 0).all()
        assert (y[x.to(dtype) > -10] > 0).all()
    # exactly x + 1 for x > 0 and exp(x) for x <= 0
    xs = torch.tensor([-3.0, -1e-3, 0.0, 1e-3, 2.0], dtype=torch.float64)
    torch.testing.assert_close(linattn.elu_plus_one(xs), torch.where(xs > 0, xs + 1, torch.exp(xs)),
                               rtol=1e-14, atol=1e-15)


def test_elu_plus_one_gradient():
    x = _x().requires_grad_(True)
    (g1,) = torch.autograd.grad(linattn.elu_plus_one(x).sum(), x)
    (g2,) = torch.autograd.grad((F.elu(x) + 1).sum(), x)
    torch.testing.assert_close(g1, g2, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extra", [0, 77])
def test_elu_plus_one_on_a_large_tensor_is_the_same_bits_with_one_allocation(dtype, extra):
    """Large contiguous CPU inputs go block by block: the same bits as the four whole-tensor passes (e^x for
    x <= 0, 1 + x for x > 0, NaN and infinities included), a result of its own, and no second tensor of the
    input's size allocated."""
    from linattn.bench import peak_memory
    from linattn.feature_maps.elementwise import ELU_BLOCK

    n = 5 * ELU_BLOCK + extra
    x = 20 * torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x[::97], x[::101], x[::103] = float("nan"), float("inf"), -float("inf")
    want = torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0.0)))
    want[x.isnan()] = float("nan")
    with torch.no_grad():
        got = linattn.elu_plus_one(x)
        peak = peak_memory(lambda: linattn.elu_plus_one(x))
    assert torch.equal(got.isnan(), x.isnan()) and torch.equal(got.nan_to_num(nan=0.0), want.nan_to_num(nan=0.0))
    assert got.data_ptr() != x.data_ptr()
    assert peak < 1.5 * n * x.element_size(), peak


def test_elu_plus_one_forward_mode_ad_on_a_large_tensor():
    """A forward-mode dual as large as the blocked path's threshold still gets its tangent, e^x for x <= 0 and 1
    above (the blocked path writes into buffers, which forward-mode AD cannot follow)."""
    import torch.autograd.forward_ad as fwAD
    from linattn.feature_maps.elementwise import ELU_BLOCK

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5 * ELU_BLOCK, generator=g, dtype=torch.float64)
    t = torch.randn(5 * ELU_BLOCK, generator=g, dtype=torch.float64)
    with fwAD.dual_level():
        y = linattn.elu_plus_one(fwAD.make_dual(x, t))
        tangent = fwAD.unpack_dual(y).tangent
    want = torch.where(x > 0, torch.ones_like(x), x.exp()) * t
    torch.testing.assert_close(tangent, want, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_values_shape_dtype(dtype):
    x = _x(dtype)
    y = linattn.relu(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, F.relu(x))


@pytest.mark.parametrize("name,fn", [("elu+1", lambda x: F.elu(x) + 1), ("relu", F.relu)])
def test_get_feature_map_by_name(name, fn):
    fmap = linattn.get_feature_map(name)
    assert callable(fmap)
    x = _x()
    torch.testing.assert_close(fmap(x), fn(x), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("name", ["nope", "elu", "softmax", ""])
def test_get_feature_map_unknown_name(name):
    with pytest.raises(ValueError) as info:
        linattn.get_feature_map(name)
    assert repr(name) in str(info.value) or (name and name in str(info.value))


@pytest.mark.parametrize("causal", [False, True])
def test_name_function_and_lookup_give_identical_attention(causal):
    q, k, v = rand_qkv(2, 2, 40, 6, 3, seed=1)
    for name, fn in (("elu+1", linattn.elu_plus_one), ("relu", linattn.relu)):
        a = linattn.linear_attention(q, k, v, causal=causal, feature_map=name)
        b = linattn.linear_attention(q, k, v, causal=causal, feature_map=fn)
        c = linattn.linear_attention(q, k, v, causal=causal, feature_map=linattn.get_feature_map(name))
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_feature_map_none_equals_precomputed_features():
    q, k, v = rand_qkv(2, 2, 30, 6, 3, seed=2)
    for causal in (False, True):
        a = linattn.linear_attention(q, k, v, causal=causal)
        b = linattn.linear_attention(F.elu(q) + 1, F.elu(k) + 1, v, causal=causal, feature_map=None)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_feature_map_module_parameters_receive_gradients():
    """An nn.Module feature map with learnable weights (M != D) is trained through linear_attention."""
    lin = torch.nn.Linear(6, 10, dtype=torch.float64)
    fmap = lambda x: F.elu(lin(x)) + 1  # noqa: E731
    q, k, v = rand_qkv(2, 2, 20, 6, 3, seed=3)
    for causal in (False, True):
        lin.zero_grad()
        linattn.linear_attention(q, k, v, causal=causal, feature_map=fmap).pow(2).sum().backward()
        assert lin.weight.grad is not None and lin.weight.grad.abs().sum() > 0
