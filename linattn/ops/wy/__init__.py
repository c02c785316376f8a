"""The WY / UT chunk form of the delta rule and the gated delta rule: op by op (:mod:`.naive`), its
triangular algebra (:mod:`.linalg`), the pass over chunks (:mod:`.scan`) and the Functions with a
hand-written backward (:mod:`.function`)."""
from .function import wy_chunk, wy_chunk_channel
from .linalg import unit_lower_inverse
from .naive import wy_chunk_channel_ops, wy_chunk_ops

__all__ = ["wy_chunk", "wy_chunk_channel", "wy_chunk_ops", "wy_chunk_channel_ops", "unit_lower_inverse"]
