"""Under non-reentrant activation checkpointing, the chunk form must not leave its recomputed
tensors in a reference cycle (they would then live until Python's garbage collector runs, and the
memory that checkpointing is meant to save would depend on when it does)."""
import gc

import torch
from torch.utils.checkpoint import checkpoint

import linattn
from linattn.bench import peak_memory


def _tensors_in_cycles(fn):
    gc.collect()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    return found


def _stack(x, recompute, n_layers=4, method="chunk"):
    layer = lambda h: linattn.linear_attention(h, h, h, causal=True, chunk_size=16, method=method)
    for _ in range(n_layers):
        x = (checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)) + x
    return x


def test_checkpointed_chunk_form_leaves_no_more_tensors_in_cycles_than_plain_pytorch_ops():
    # checkpoint itself leaves a few objects to the collector; the quadratic form (built-in ops
    # only) shows how many tensors among them: the chunk form's Function must add none
    x = torch.randn(1, 2, 64, 8, requires_grad=True)
    cycles = {m: len(_tensors_in_cycles(lambda: torch.autograd.grad(_stack(x, True, method=m).sum(), x)))
              for m in ("quadratic", "chunk")}
    assert cycles["chunk"] <= cycles["quadratic"], cycles


def test_checkpointing_saves_memory_whether_or_not_the_collector_runs():
    x = torch.randn(1, 2, 256, 32, requires_grad=True)
    run = lambda recompute: peak_memory(lambda: torch.autograd.grad(_stack(x, recompute).sum(), x))
    stored = run(False)
    gc.disable()
    try:
        paused = run(True)
    finally:
        gc.enable()
    assert paused == run(True)          # the same peak with the collector paused and running
    assert paused < 0.6 * stored
