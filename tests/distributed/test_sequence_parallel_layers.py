"""LinearMixer, ring attention's backward and a hybrid TransformerLM across gloo ranks against one process.

The ranks run ``run_layer_cases(P)`` inside the folder's one process group per world size
(``conftest.spawned``, ``test_sequence_parallel_rules.every_case``).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import linattn
from linattn.distributed import (count_bytes, ring_softmax_attention, sequence_parallel_lm,
                                 sequence_parallel_mixer)

LENGTHS = {2: [7, 2], 3: [5, 2, 4], 4: [3, 1, 6, 2]}     # the 2-token slices are shorter than the conv's 3 inputs
D_MODEL, HEADS, VOCAB = 16, 2, 50
MIXER_RULES = ("retention", "gla", "delta", "gated_delta", "kda")
TOL = 1e-12


def _piece(lengths: list[int], rank: int) -> slice:
    start = sum(lengths[:rank])
    return slice(start, start + lengths[rank])


def _mixer(rule: str) -> linattn.LinearMixer:
    torch.manual_seed(3)
    return linattn.LinearMixer(D_MODEL, HEADS, rule=rule, n_kv_heads=1, chunk_size=4).double()


def _mixer_input(T: int) -> torch.Tensor:
    return torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(4), dtype=torch.float64)


def _hybrid() -> linattn.TransformerLM:
    torch.manual_seed(5)
    return linattn.TransformerLM(VOCAB, D_MODEL, 2, HEADS, attention=["gated_delta", "softmax"], positions="rope",
                                 chunk_size=4).double()


def _tokens(T: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T + 1), generator=torch.Generator().manual_seed(6))


def _ring_inputs(T: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64) for _ in range(4)]   # q, k, v, w


def run_layer_cases(world_size: int) -> dict:
    """On every rank: each mixer rule (output, returned state, gradients), ring attention's gradients, and
    (two ranks) one training step of a small hybrid model."""
    rank, lengths = dist.get_rank(), LENGTHS.get(world_size)
    if lengths is None:
        return {}
    piece, T = _piece(lengths, rank), sum(lengths)
    results = {}
    for rule in MIXER_RULES:
        mixer, x = _mixer(rule), _mixer_input(T)[:, piece].requires_grad_()
        y, state = sequence_parallel_mixer(mixer, x, return_state=True)
        (y * _mixer_input(T)[:, piece].flip(-1)).sum().backward()
        state = linattn.MixerState(state.S.detach(), state.conv.detach())
        results[("mixer", rule)] = dict(y=y.detach(), state=state, x_grad=x.grad,
                                        grads={n: p.grad for n, p in mixer.named_parameters()})
    for causal in (True, False):
        q, k, v, w = (t[:, :, piece].clone().requires_grad_() for t in _ring_inputs(T))
        with count_bytes() as counter:
            out = ring_softmax_attention(q, k, v, causal=causal)
            (out * w.detach()).sum().backward()
        results[("ring", causal)] = dict(out=out.detach(), grads=[t.grad for t in (q, k, v)], bytes=counter.by_op())
    if world_size == 2:
        model, idx = _hybrid(), _tokens(T)
        logits = sequence_parallel_lm(model, idx[:, :-1][:, piece])
        targets = idx[:, 1:]
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, piece].flatten(), reduction="sum") / targets.numel()
        loss.backward()
        results["hybrid"] = dict(loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()})
        other = linattn.TransformerLM(VOCAB, D_MODEL, 2, HEADS, attention=["gated_delta", "gated_delta" if rank else
                                                                            "softmax"], positions="rope").double()
        try:
            sequence_parallel_lm(other, idx[:, :-1][:, piece])
            results["model-differs"] = "no error"
        except ValueError as err:
            results["model-differs"] = str(err)
    return results


# ---------------------------------------------------------------------------------------
# The comparisons, in this process
# ---------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.mark.parametrize("world_size", sorted(LENGTHS))
@pytest.mark.parametrize("rule", MIXER_RULES)
def test_a_mixer_across_ranks_equals_one_process(spawned, world_size, rule):
    """Outputs, the input's and every parameter's gradient (summed over the ranks), and the last rank's state,
    from which one process decodes on as after the whole sequence."""
    lengths, T = LENGTHS[world_size], sum(LENGTHS[world_size])
    mixer, x = _mixer(rule), _mixer_input(T).requires_grad_()
    y, state = mixer(x, return_state=True)
    (y * _mixer_input(T).flip(-1)).sum().backward()
    results = [res["layers"][("mixer", rule)] for res in spawned(world_size)]
    for rank, res in enumerate(results):
        _close(res["y"], y.detach()[:, _piece(lengths, rank)], f"rank {rank} output")
        _close(res["x_grad"], x.grad[:, _piece(lengths, rank)], f"rank {rank} grad x")
    for name, p in mixer.named_parameters():
        _close(sum(res["grads"][name] for res in results), p.grad, f"grad {name}")
    last = results[-1]["state"]
    _close(last.S, state.S, "final S")
    _close(last.conv, state.conv, "final conv inputs")
    step = torch.randn(2, 1, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        want_next = mixer(torch.cat([x.detach(), step], dim=1))[:, -1:]
        _close(mixer(step, state=last), want_next, "one-process decoding from the last rank's state")


@pytest.mark.parametrize("world_size", sorted(LENGTHS))
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_gradients_equal_one_process(spawned, world_size, causal):
    lengths, T = LENGTHS[world_size], sum(LENGTHS[world_size])
    q, k, v, w = _ring_inputs(T)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = linattn.softmax_attention(*leaves, causal=causal)
    (out * w).sum().backward()
    P = world_size
    for rank, res in enumerate(spawned(world_size)):
        got = res["layers"][("ring", causal)]
        piece = _piece(lengths, rank)
        _close(got["out"], out.detach()[:, :, piece], f"rank {rank} output")
        for name, g, leaf in zip("qkv", got["grads"], leaves):
            _close(g, leaf.grad[:, :, piece], f"rank {rank} grad {name}")
        passed = [lengths[(rank - step) % P] for step in range(P - 1)]    # the blocks this rank forwards
        token = 2 * 3 * 8 * 8                                            # one token's k and v, float64
        assert got["bytes"].get("kv", 0) == sum(passed) * token
        home = lengths[(rank + 1) % P] if P > 1 else 0                    # the last hop: gradients only
        assert got["bytes"].get("kv_grad", 0) == 2 * sum(passed) * token + home * token


def test_a_training_step_of_a_hybrid_model_on_two_ranks_equals_one_process(spawned):
    """Gated DeltaNet and softmax (ring attention) layers with rotary positions: the same loss and gradients."""
    lengths = LENGTHS[2]
    model, idx = _hybrid(), _tokens(sum(lengths))
    loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    results = [res["layers"]["hybrid"] for res in spawned(2)]
    _close(sum(res["loss"] for res in results), loss.detach(), "loss")
    for name, p in model.named_parameters():
        _close(sum(res["grads"][name] for res in results), p.grad, f"grad {name}")


def test_ranks_with_different_models_raise_on_every_rank(spawned):
    for rank, res in enumerate(spawned(2)):
        message = res["layers"]["model-differs"]
        assert "sequence_parallel_lm: every rank must" in message and "disagree on model" in message, message
