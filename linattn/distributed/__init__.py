"""Sequence parallelism over ``torch.distributed``: each rank holds a contiguous slice of the sequence."""
from .affine import apply_transition
from .agreement import AUTO_STATE_EXCHANGE, AUTO_STATE_EXCHANGE_DEFAULT, STATE_EXCHANGE_ALIASES, STATE_EXCHANGES
from .comm import ByteCounter, count_bytes
from .decay_rules import sequence_parallel_gated_linear_attention, sequence_parallel_retention
from .delta_rules import sequence_parallel_delta_rule, sequence_parallel_gated_delta_rule
from .launch import RankError, run_on_ranks
from .layers import sequence_parallel_lm, sequence_parallel_mixer
from .measure import measure_sequence_parallel
from .prefill import Prefill, prefill_on_ranks
from .ring import ring_softmax_attention
from .sequence_parallel import local_state, sequence_parallel_linear_attention

__all__ = [
    "STATE_EXCHANGES",
    "STATE_EXCHANGE_ALIASES",
    "AUTO_STATE_EXCHANGE",
    "sequence_parallel_linear_attention",
    "sequence_parallel_retention",
    "sequence_parallel_gated_linear_attention",
    "sequence_parallel_delta_rule",
    "sequence_parallel_gated_delta_rule",
    "sequence_parallel_mixer",
    "sequence_parallel_lm",
    "prefill_on_ranks",
    "Prefill",
    "apply_transition",
    "local_state",
    "ring_softmax_attention",
    "ByteCounter",
    "count_bytes",
    "RankError",
    "run_on_ranks",
    "measure_sequence_parallel",
]
