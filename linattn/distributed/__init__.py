"""Sequence parallelism over ``torch.distributed``: each rank holds a contiguous slice of the sequence.

Linear attention needs only a fixed-size state from the tokens before a slice, so ranks
exchange ``B·H·M·(Dv + 1)`` numbers each, whatever the sequence length (Sun et al., 2024,
"Linear Attention Sequence Parallelism", sec. 3). Softmax attention needs every earlier key
and value: the ring-attention baseline passes ``K, V`` blocks from rank to rank (Liu, Zaharia
& Abbeel, 2023, "Ring Attention with Blockwise Transformers", sec. 3).

Everything communicates through PyTorch's own collectives (``all_gather``, ``all_reduce``,
``send``/``recv``, ``isend``/``irecv``); there is no communication layer of our own. What
this module adds:

- :func:`sequence_parallel_linear_attention`: causal (an exclusive prefix of the per-rank
  states over ranks) and non-causal (one all-reduce), differentiable: the backward pass
  communicates too.
- :func:`ring_softmax_attention`: the softmax baseline, forward only.
- :func:`count_bytes`: counts the bytes each rank hands to ``torch.distributed``.
- :func:`run_on_ranks` and :func:`measure_sequence_parallel`: start a process group of
  ``P`` CPU processes (gloo on 127.0.0.1), run a module-level function on every rank and
  return the results; the tests and chapter 12 use them.

Every rank must make the same calls in the same order (as with any collective code), and
when training, every rank must call ``backward`` on a loss that uses the output.
"""
from .agreement import AUTO_STATE_EXCHANGE, AUTO_STATE_EXCHANGE_DEFAULT, STATE_EXCHANGES
from .comm import ByteCounter, count_bytes
from .launch import RankError, run_on_ranks
from .measure import measure_sequence_parallel
from .ring import ring_softmax_attention
from .sequence_parallel import local_state, sequence_parallel_linear_attention

__all__ = [
    "STATE_EXCHANGES",
    "AUTO_STATE_EXCHANGE",
    "sequence_parallel_linear_attention",
    "local_state",
    "ring_softmax_attention",
    "ByteCounter",
    "count_bytes",
    "RankError",
    "run_on_ranks",
    "measure_sequence_parallel",
]
