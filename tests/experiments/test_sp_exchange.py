"""The sp_exchange study: interleaved timings of the three state exchanges, and the bytes they send."""
from __future__ import annotations

from linattn.experiments import sp_exchange


def test_short_cell_times_all_three_and_counts_their_bytes():
    out = sp_exchange.run_cell(dict(P=2, blocks=1, repeats_alone=1, repeats_pass=1))
    s = 1 * 2 * 16 * 17 * 4                                   # one float32 state
    assert out["bytes_alone"] == {"allgather": [s, s], "ring": [s, 0], "scan": [s, 0]}
    assert all(len(v) == 1 and v[0] > 0 for v in out["seconds_pass"].values())
    assert len(out["load_before"]) == 3
    # the seeds of every rank's q, k, v: one list per timed case (3 exchanges x 2 kinds of call)
    assert out["input_seeds"]["per_case"] == [[1000 * i, 1000 * i + 1] for i in range(6)]


def test_summary_counts_the_blocks_each_exchange_wins():
    result = {"seconds_alone": {"allgather": [3, 3], "ring": [1, 4], "scan": [2, 2]},
              "seconds_pass": {"allgather": [1, 1], "ring": [2, 2], "scan": [3, 3]}}
    rows = [dict(cell=dict(P=2, blocks=2), result=result), dict(cell=dict(P=2, blocks=1), result=result)]
    alone, passes = sp_exchange.summarise(rows)["by_P"]
    assert alone["wins"] == {"allgather": 0, "ring": 1, "scan": 1} and alone["median_ms"]["ring"] == 2500.0
    assert passes["wins"] == {"allgather": 2, "ring": 0, "scan": 0}
