"""linattn under PyTorch's transforms: torch.func (vmap, grad, jvp, jacrev, jacfwd), torch.compile
(fullgraph, eager and aot_eager backends; one inductor smoke test) and torch.autocast.

References are independent of the transform: a Python loop over the vmapped dimension, the
quadratic method under plain autograd, and the same call without autocast.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import linattn

B, H, T, D = 1, 2, 11, 4


def _qkv(*lead, seed=0, dtype=torch.float64, T=T):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, B, H, T, D, generator=g, dtype=dtype) for _ in range(3))


def _chunk(q, k, v):
    return linattn.linear_attention(q, k, v, causal=True, method="chunk", chunk_size=4)


def _quadratic(q, k, v):
    return linattn.linear_attention(q, k, v, causal=True, method="quadratic")


TIGHT = dict(rtol=1e-10, atol=1e-12)

# ---------------------------------------------------------------------------------------------- torch.func


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (0, None, 0), (None, 0, None), (1, 0, 2)])
def test_vmap_equals_a_loop(in_dims):
    Q, K, V = _qkv(3)
    args = [x if d is None or d == 0 else x.movedim(0, d) for x, d in zip((Q, K, V), in_dims)]
    args = [x[0] if d is None else x for x, d in zip(args, in_dims)]
    got = vmap(_chunk, in_dims=in_dims)(*args)
    pick = lambda x, d, i: x if d is None else x.select(d, i)
    loop = torch.stack([_chunk(*(pick(x, d, i) for x, d in zip(args, in_dims))) for i in range(3)])
    torch.testing.assert_close(got, loop, **TIGHT)


def test_grad_jvp_jacrev_jacfwd_equal_the_quadratic_form():
    q, k, v = _qkv()
    loss = lambda fn: (lambda q, k, v: fn(q, k, v).square().sum())
    for argnum in range(3):
        torch.testing.assert_close(grad(loss(_chunk), argnums=argnum)(q, k, v),
                                   grad(loss(_quadratic), argnums=argnum)(q, k, v), **TIGHT)
    t = _qkv(seed=1)
    torch.testing.assert_close(jvp(_chunk, (q, k, v), t)[1], jvp(_quadratic, (q, k, v), t)[1], **TIGHT)
    small = tuple(x[:, :1, :6] for x in (q, k, v))
    for jac in (jacrev, jacfwd):
        got = jac(_chunk, argnums=(0, 1, 2))(*small)
        ref = jac(_quadratic, argnums=(0, 1, 2))(*small)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **TIGHT)


def test_per_sample_gradients_vmap_of_grad():
    Q, K, V = _qkv(4)
    loss = lambda fn: (lambda q, k, v: fn(q, k, v).square().sum())
    got = vmap(grad(loss(_chunk), argnums=(0, 1, 2)))(Q, K, V)
    ref = [torch.autograd.grad(_quadratic(*(x[i].requires_grad_() for x in (Q.clone(), K.clone(), V.clone())))
                               .square().sum(), [])
           if False else None for i in range(0)]
    for i in range(4):
        xs = [x[i].clone().requires_grad_() for x in (Q, K, V)]
        gs = torch.autograd.grad(_quadratic(*xs).square().sum(), xs)
        for a, b in zip(got, gs):
            torch.testing.assert_close(a[i], b, **TIGHT)


def test_jvp_with_state_and_normaliser_tangents():
    q, k, v = _qkv()
    S0 = torch.rand(B, H, D, D, dtype=torch.float64)
    z0 = torch.rand(B, H, D, dtype=torch.float64)

    def fn(method):
        def run(q, k, v, S0, z0):
            out, st = linattn.linear_attention(q, k, v, causal=True, method=method, chunk_size=4,
                                               initial_state=linattn.LinearAttentionState(S0, z0),
                                               return_state=True)
            return out, st.S, st.z
        return run

    primals = (q, k, v, S0, z0)
    tangents = _qkv(seed=2) + (torch.randn_like(S0), torch.randn_like(z0))
    for a, b in zip(jvp(fn("chunk"), primals, tangents)[1], jvp(fn("quadratic"), primals, tangents)[1]):
        torch.testing.assert_close(a, b, **TIGHT)


def test_elu_plus_one_under_every_transform():
    x = torch.randn(3, 5, dtype=torch.float64)
    ref = lambda x: torch.where(x > 0, x + 1, torch.exp(x.clamp(max=0)))
    f = linattn.elu_plus_one
    torch.testing.assert_close(vmap(f)(x), ref(x), rtol=0, atol=0)
    for transform in (jacrev, jacfwd):
        torch.testing.assert_close(transform(f)(x), transform(ref)(x), **TIGHT)
    hess = torch.func.hessian(lambda x: f(x).sum())
    torch.testing.assert_close(hess(x), torch.func.hessian(lambda x: ref(x).sum())(x), **TIGHT)


def test_second_derivatives_of_the_chunk_form_raise():
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.func.hessian(lambda q: _chunk(q, k, v).sum())(q)
    hq = torch.func.hessian(lambda q: _quadratic(q, k, v).sum())(q)     # the quadratic form has them
    assert torch.isfinite(hq).all()


def test_value_checks_under_vmap():
    Q, K, V = _qkv(2)
    log_g = -torch.rand(2, B, H, T, D, dtype=torch.float64)
    run = lambda q, k, v, g: linattn.gated_linear_attention(q, k, v, g, chunk_size=4)
    vmap(run)(Q, K, V, log_g)
    with pytest.raises(ValueError, match=r"log_g must be finite and <= 0.*got 0.5"):
        vmap(run)(Q, K, V, log_g.index_fill(0, torch.tensor([1]), 0.5))

# ---------------------------------------------------------------------------------------------- torch.compile


def _decay_args(q):
    g = torch.Generator().manual_seed(9)
    log_g = F.logsigmoid(torch.randn(q.shape, generator=g, dtype=q.dtype))
    beta = torch.rand(q.shape[:3], generator=g, dtype=q.dtype)
    return log_g, beta


def _functions(dtype=torch.float32):
    log_g, beta = _decay_args(torch.zeros(B, H, T, D, dtype=dtype))    # made outside any compiled region
    gammas = torch.tensor([0.9, 0.5], dtype=dtype)
    return {
        "linear_attention chunk": _chunk,
        "linear_attention quadratic": _quadratic,
        "linear_attention recurrent": lambda q, k, v: linattn.linear_attention(q, k, v, causal=True,
                                                                               method="recurrent"),
        "linear_attention parallel": lambda q, k, v: linattn.linear_attention(q, k, v),
        "linear_attention state": lambda q, k, v: linattn.linear_attention(
            q, k, v, causal=True, return_state=True, chunk_size=4)[1].S,
        "linear_attention mask": lambda q, k, v: linattn.linear_attention(
            q, k, v, causal=True, attention_mask=torch.arange(T).expand(B, T) > 2, chunk_size=4),
        "linear_attention_step": lambda q, k, v: linattn.linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0])[0],
        "softmax_attention": lambda q, k, v: linattn.softmax_attention(q, k, v, causal=True),
        "retention": lambda q, k, v: linattn.retention(q, k, v, 0.9, chunk_size=4),
        "retention per head": lambda q, k, v: linattn.retention(q, k, v, gammas, chunk_size=4),
        "gated_linear_attention": lambda q, k, v: linattn.gated_linear_attention(q, k, v, log_g, chunk_size=4),
        "delta_rule": lambda q, k, v: linattn.delta_rule(q, F.normalize(k, dim=-1), v, beta, chunk_size=4),
        "gated_delta_rule": lambda q, k, v: linattn.gated_delta_rule(q, F.normalize(k, dim=-1), v, log_g[..., 0], beta,
                                                                     chunk_size=4),
        "gated_delta_rule per channel": lambda q, k, v: linattn.gated_delta_rule(q, F.normalize(k, dim=-1), v, log_g,
                                                                                 beta, chunk_size=4),
        "performer lazy": lambda q, k, v: linattn.linear_attention(q, k, v, feature_map=linattn.PerformerFeatures()),
        "performer by name": lambda q, k, v: linattn.linear_attention(q, k, v, feature_map="performer"),
        "taylor": lambda q, k, v: linattn.linear_attention(q, k, v, feature_map="taylor", causal=True),
        "cosformer": lambda q, k, v: linattn.linear_attention(
            q, k, v, feature_map=linattn.CosFormerFeatures(max_len=64), causal=True),
    }


@pytest.mark.parametrize("backend,dynamic", [("eager", False), ("eager", True), ("aot_eager", False)])
@pytest.mark.parametrize("name", list(_functions()))
def test_fullgraph_compile_of_every_public_function(name, backend, dynamic):
    """Dynamo traces every function in one graph (also with symbolic shapes and floats, dynamic=True);
    aot_eager also traces it through AOTAutograd, as inductor would, without generating code."""
    fn = _functions()[name]
    q, k, v = _qkv(dtype=torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-5, atol=1e-5)


def test_compiled_backward_of_the_chunk_form():
    q, k, v = (x.float().requires_grad_() for x in _qkv())
    torch._dynamo.reset()
    compiled = torch.compile(_chunk, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    ref = torch.autograd.grad(_quadratic(q, k, v).square().sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["log_g", "beta", "gamma", "mask"])
def test_compiled_calls_still_refuse_bad_values(case):
    q, k, v = _qkv(dtype=torch.float32)
    log_g, beta = _decay_args(q)
    fn = {
        "log_g": lambda q, g: linattn.gated_linear_attention(q, q, q, g, chunk_size=4),
        "beta": lambda q, b: linattn.delta_rule(q, q, q, b, chunk_size=4),
        "gamma": lambda q, g: linattn.retention(q, q, q, g, chunk_size=4),
        "mask": lambda q, m: linattn.linear_attention(q, q, q, causal=True, attention_mask=m, chunk_size=4),
    }[case]
    good, bad, match = {
        "log_g": (log_g, log_g.abs(), "log_g must be finite and <= 0"),
        "beta": (beta, beta + 2.5, r"beta must be in \[0, 2\]"),
        "gamma": (torch.tensor([0.9, 0.5]), torch.tensor([0.9, 1.5]), r"gamma must be in \(0, 1\]"),
        "mask": (torch.ones(B, T, dtype=torch.long), torch.full((B, T), 2), "attention_mask must be 0 or 1"),
    }[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, good), fn(q, good), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=match):
        compiled(q, bad)
    with pytest.raises(ValueError, match=match):
        fn(q, bad)


def test_inductor_smoke():
    """One real code-generating compile: forward and backward of the causal chunk form."""
    q, k, v = (x.float().requires_grad_() for x in _qkv(T=37))
    torch._dynamo.reset()
    compiled = torch.compile(_chunk, fullgraph=True, backend="inductor")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, _quadratic(q, k, v), rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(out.sum(), (q, k, v))
    ref = torch.autograd.grad(_quadratic(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

# ---------------------------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("name", list(_functions()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_function_under_cpu_autocast(name, dtype):
    """linattn picks its own precision: under autocast the numbers are those without it."""
    fn = _functions(dtype)[name]
    q, k, v = _qkv(dtype=dtype)
    ref = fn(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(q, k, v)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_backward_under_cpu_autocast():
    q, k, v = (x.float().requires_grad_() for x in _qkv())
    ref = torch.autograd.grad(_chunk(q, k, v).square().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _chunk(q, k, v).square().sum()
        got = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["linear", "softmax"])
def test_layers_and_the_language_model_train_under_cpu_autocast(attention):
    torch.manual_seed(0)
    layer = (linattn.LinearAttention(16, 2, causal=True, chunk_size=4) if attention == "linear"
             else linattn.SoftmaxAttention(16, 2, causal=True))
    x = torch.randn(2, 9, 16)
    lm = linattn.TransformerLM(13, 16, 2, 2, attention=attention, max_len=32, chunk_size=4)
    idx = torch.randint(13, (2, 9))
    with torch.no_grad():
        ref_y, ref_loss = layer(x), lm.loss(idx, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        loss = lm.loss(idx, idx)
    loss.backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), ref_y, rtol=0.05, atol=0.02)          # bf16 projections
    torch.testing.assert_close(loss, ref_loss, rtol=0.01, atol=0.01)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters() if p.requires_grad)
