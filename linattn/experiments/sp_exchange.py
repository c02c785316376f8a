"""How to pass the state between ranks (chapter 12): all-gather, chain or exclusive scan, timed on gloo."""
from __future__ import annotations

import os

NAME = "sp_exchange"
DESCRIPTION = "state exchange of sequence-parallel linear attention: all-gather, chain, scan (gloo, CPU)"

SERIAL = True          # each cell starts P ranks and times them: run the cells one at a time
EXCHANGES = ("allgather", "ring", "scan")
T_ALONE, T_PASS = 65536, 16384


def grid() -> list[dict]:
    return [dict(P=2, blocks=1, repeats_alone=5, repeats_pass=1),
            dict(P=2, blocks=12, repeats_alone=25, repeats_pass=5),
            dict(P=4, blocks=12, repeats_alone=25, repeats_pass=5)]


def run_cell(cell: dict) -> dict:
    from .. import distributed as lad

    cases = []
    for b in range(cell["blocks"]):
        cases += [dict(kind="linear", T=T_ALONE, communication_only=True, state_exchange=ex,
                       repeats=cell["repeats_alone"], block=b) for ex in EXCHANGES]
        cases += [dict(kind="linear", T=T_PASS, backward=True, state_exchange=ex,
                       repeats=cell["repeats_pass"], block=b) for ex in EXCHANGES]
    load_before = [round(x, 2) for x in os.getloadavg()]
    records = lad.measure_sequence_parallel(cell["P"], cases, timeout=600)
    out = {"load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()],
           "input_seeds": {"rule": "1000 * case index + rank", "per_case": [r["input_seeds"] for r in records]}}
    for what, comm in (("alone", True), ("pass", False)):
        rows = [r for r in records if r["communication_only"] == comm]
        out[f"seconds_{what}"] = {ex: [r["seconds"] for r in rows if r["state_exchange"] == ex] for ex in EXCHANGES}
        out[f"bytes_{what}"] = {ex: next(r["bytes_sent"] for r in rows if r["state_exchange"] == ex)
                                for ex in EXCHANGES}
    return out


def summarise(rows: list[dict]) -> dict:
    """Per P and kind of call: the median block time of each exchange and how many blocks each won."""
    import statistics

    out = []
    for row in rows:
        if row["cell"]["blocks"] < 2:
            continue
        for what in ("alone", "pass"):
            secs = row["result"][f"seconds_{what}"]
            wins = {ex: 0 for ex in EXCHANGES}
            for trio in zip(*(secs[ex] for ex in EXCHANGES)):
                wins[EXCHANGES[trio.index(min(trio))]] += 1
            out.append(dict(P=row["cell"]["P"], what=what, blocks=row["cell"]["blocks"],
                            median_ms={ex: round(1e3 * statistics.median(secs[ex]), 3) for ex in EXCHANGES},
                            wins=wins))
    return {"by_P": out}
