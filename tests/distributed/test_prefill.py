"""prefill_on_ranks: a LinearMixer's prefill on two gloo ranks, then decoding in this process, against one process."""
from __future__ import annotations

import signal

import pytest
import torch

import linattn
from linattn.distributed import prefill_on_ranks

D_MODEL, HEADS = 16, 2


def _mixer() -> linattn.LinearMixer:
    torch.manual_seed(11)
    return linattn.LinearMixer(D_MODEL, HEADS, rule="gated_delta", chunk_size=4).double()


def test_a_prefill_on_two_ranks_hands_its_state_to_one_process_decoding():
    """Outputs and the state after a ragged prefill (a 2-token slice, shorter than the convolution's 3 inputs and
    than a chunk) equal one process's; decoding three tokens from that state equals one process reading on."""
    mixer = _mixer()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    g = torch.Generator().manual_seed(12)
    x, more = (torch.randn(2, T, D_MODEL, generator=g, dtype=torch.float64) for T in (11, 3))
    with torch.no_grad():
        y, state = mixer(x, return_state=True)
        got = prefill_on_ranks(mixer, x, 2, lengths=[9, 2], timeout=60.0)
        assert (got.y - y).abs().max().item() <= 1e-12
        assert (got.state.S - state.S).abs().max().item() <= 1e-12
        assert (got.state.conv - state.conv).abs().max().item() <= 1e-12
        want = mixer(torch.cat([x, more], dim=1))[:, 11:]
        S, steps = got.state, []
        for t in range(3):
            out, S = mixer(more[:, t:t + 1], state=S, return_state=True)
            steps.append(out)
        assert (torch.cat(steps, dim=1) - want).abs().max().item() <= 1e-12
    assert got.bytes_sent[0] > 0 and got.bytes_sent[1] > 0          # the handshake, the conv inputs, the state
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers   # the launcher's handlers are gone again


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(world_size=2, lengths=[5, 5]), ValueError, "summing to T=11"),
    (dict(world_size=2, lengths=[11, 0]), ValueError, "at least one token"),
    (dict(world_size=3, lengths=[5, 6]), ValueError, "3 slices"),
    (dict(world_size=2, lengths=[5.0, 6]), TypeError, "list of ints"),
    (dict(world_size=2, state_exchange="tree"), ValueError, "state_exchange"),
    (dict(world_size=0), ValueError, "world_size"),
])
def test_bad_arguments_raise_before_any_process_starts(kwargs, error, words):
    x = torch.zeros(1, 11, D_MODEL, dtype=torch.float64)
    with pytest.raises(error, match=words):
        prefill_on_ranks(_mixer(), x, **kwargs)


def test_a_non_mixer_raises():
    with pytest.raises(TypeError, match="LinearMixer"):
        prefill_on_ranks(torch.nn.Linear(2, 2), torch.zeros(1, 3, 2), 2)
