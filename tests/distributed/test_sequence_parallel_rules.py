"""The sequence-parallel decay and delta rules on 1-4 CPU processes (gloo) against one process.

Every rank count is spawned once for this file and ``test_sequence_parallel.py`` together
(``conftest.spawned``): the ranks run every case of both (``every_case``) and return their
outputs, states and gradients, which the tests compare here with one process's float64 run of
the single-process op on the whole sequence.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import linattn
from linattn.distributed import (count_bytes, sequence_parallel_delta_rule, sequence_parallel_gated_delta_rule,
                                 sequence_parallel_gated_linear_attention, sequence_parallel_retention)

B, H, D, DV = 2, 2, 4, 3
CHUNK = 4                                                  # every world size has a slice shorter than this
LENGTHS = {1: [7], 2: [5, 3], 3: [6, 1, 9], 4: [3, 7, 1, 5]}
RULES = ("retention", "retention-gamma-tensor", "gla", "delta", "gated_delta", "kda")
EXCHANGES = ("ring", "allgather", "scan")
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}          # relative to the largest reference value

SP = {"retention": sequence_parallel_retention, "gla": sequence_parallel_gated_linear_attention,
      "delta": sequence_parallel_delta_rule, "gated_delta": sequence_parallel_gated_delta_rule}
ONE = {"retention": linattn.retention, "gla": linattn.gated_linear_attention, "delta": linattn.delta_rule,
       "gated_delta": linattn.gated_delta_rule}


def _family(rule: str) -> str:
    return {"retention-gamma-tensor": "retention", "kda": "gated_delta"}.get(rule, rule)


def _whole(rule: str, T: int, dtype: torch.dtype, seed: int) -> dict:
    """The whole sequence's inputs of ``rule`` (rounded to ``dtype``, held in float64), the same in every process."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = dict(q=randn(B, H, T, D), k=F.normalize(randn(B, H, T, D), dim=-1), v=randn(B, H, T, DV),
             S0=randn(B, H, D, DV), w=randn(B, H, T, DV), wS=randn(B, H, D, DV))
    gates = {"retention": [], "retention-gamma-tensor": ["gamma"], "gla": ["log_g4"], "delta": ["beta"],
             "gated_delta": ["log_g3", "beta"], "kda": ["log_g4", "beta"]}[rule]
    x["gamma"] = 0.8 + 0.2 * torch.rand(H, generator=g, dtype=torch.float64)
    x["log_g4"] = -torch.rand(B, H, T, D, generator=g, dtype=torch.float64)
    x["log_g3"] = -torch.rand(B, H, T, generator=g, dtype=torch.float64)
    x["beta"] = 2 * torch.rand(B, H, T, generator=g, dtype=torch.float64)    # negative eigenvalues included
    x["gates"] = gates
    for name in ("q", "k", "v", "S0", "gamma", "log_g4", "log_g3", "beta"):
        x[name] = x[name].to(dtype).double()
    return x


def _gate_args(rule: str, x: dict) -> list:
    return [0.9] if rule == "retention" else [x[name] for name in x["gates"]]


def _local_inputs(x: dict, lengths: list[int], rank: int, dtype: torch.dtype) -> dict:
    start = sum(lengths[:rank])
    piece = slice(start, start + lengths[rank])
    local = {}
    for name in ("q", "k", "v", "log_g4", "log_g3", "beta", "w"):
        local[name] = x[name][:, :, piece]
    local["gamma"] = x["gamma"]                                   # held whole by every rank
    local["S0"] = x["S0"] if rank == 0 else None
    local["wS"] = x["wS"]
    for name in ("q", "k", "v", "log_g4", "log_g3", "beta", "gamma", "S0"):
        if local[name] is not None:
            local[name] = local[name].to(dtype).requires_grad_()
    local["gates"] = x["gates"]
    return local


def _rule_case(rule: str, exchange: str, dtype: torch.dtype, lengths: list[int], seed: int) -> dict:
    """One rank's run of one case: output, returned state, gradients of Σ w⊙out (+ Σ wS⊙S on the last rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _local_inputs(_whole(rule, sum(lengths), dtype, seed), lengths, rank, dtype)
    with count_bytes() as counter:
        out, S = SP[_family(rule)](x["q"], x["k"], x["v"], *_gate_args(rule, x), initial_state=x["S0"],
                                   chunk_size=CHUNK, state_exchange=exchange, return_state=True)
        loss = (out.double() * x["w"]).sum() + ((S * x["wS"]).sum() if rank == world - 1 else 0.0)
        loss.backward()
    names = ["q", "k", "v", *x["gates"]] + (["S0"] if rank == 0 else [])
    return dict(out=out.detach(), S=S.detach(), grads={n: x[n].grad for n in names}, bytes=counter.by_op())


def rule_cases(world_size: int) -> dict:
    """Every rule, exchange and dtype on the ragged slices of ``LENGTHS[world_size]``."""
    return {(rule, exchange, dtype): dict(rule=rule, exchange=exchange, dtype=dtype, seed=i)
            for i, rule in enumerate(RULES) for exchange in EXCHANGES for dtype in ("float64", "float32")}


def run_rule_cases(world_size: int) -> dict:
    """On every rank: the results of :func:`rule_cases`."""
    lengths = LENGTHS[world_size]
    return {key: _rule_case(c["rule"], c["exchange"], getattr(torch, c["dtype"]), lengths, c["seed"])
            for key, c in rule_cases(world_size).items()}


def every_case(world_size: int) -> dict:
    """What one process group of ``world_size`` ranks runs for the tests of this folder."""
    import test_sequence_parallel as linear

    return {"linear": linear._worker(linear.CASES[world_size]), "rules": run_rule_cases(world_size)}


# ---------------------------------------------------------------------------------------
# The comparisons, in this process
# ---------------------------------------------------------------------------------------


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} x {scale:.3g}"


def _one_process(rule: str, dtype: torch.dtype, lengths: list[int], seed: int):
    """Output, the state after every rank's last token, and the gradients of the same loss, in float64."""
    x = _whole(rule, sum(lengths), dtype, seed)
    names = ["q", "k", "v", *x["gates"], "S0"]
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    args = [leaves[n] for n in x["gates"]] if rule != "retention" else [0.9]
    op = ONE[_family(rule)]
    out, S = op(leaves["q"], leaves["k"], leaves["v"], *args, initial_state=leaves["S0"], return_state=True)
    ((out * x["w"]).sum() + (S * x["wS"]).sum()).backward()
    states, end = [], 0
    for length in lengths:                                   # the state after each rank's slice
        end += length
        piece = [t[:, :, :end] if isinstance(t, torch.Tensor) and t.dim() >= 3 else t for t in args]
        _, S_r = op(x["q"][:, :, :end], x["k"][:, :, :end], x["v"][:, :, :end], *piece, initial_state=x["S0"],
                    return_state=True)
        states.append(S_r)
    return out.detach(), states, {n: leaves[n].grad for n in names}


RULE_IDS = [(P, key) for P in LENGTHS for key in rule_cases(P)]


@pytest.mark.parametrize("world_size,key", RULE_IDS, ids=[f"P{P}-{'-'.join(k)}" for P, k in RULE_IDS])
def test_outputs_states_and_gradients_equal_one_process(spawned, world_size, key):
    """Every rank's output slice, its returned state (the state after its last token) and every gradient
    (q, k, v, gates, β, γ as the sum of the ranks' partial gradients, initial_state on rank 0)."""
    rule, exchange, dtype_name = key
    case, dtype, lengths = rule_cases(world_size)[key], getattr(torch, dtype_name), LENGTHS[world_size]
    out, states, grads = _one_process(rule, dtype, lengths, case["seed"])
    results = [res["rules"][key] for res in spawned(world_size)]
    tol, start = TOL[dtype], 0
    for rank, (res, length) in enumerate(zip(results, lengths)):
        piece = slice(start, start + length)
        start += length
        assert res["out"].dtype == dtype and res["S"].dtype == dtype
        _close(res["out"], out[:, :, piece], f"rank {rank} output", tol)
        _close(res["S"], states[rank], f"rank {rank} state", tol)
        for name, got in res["grads"].items():
            if name == "gamma":
                continue
            want = grads[name] if name == "S0" else grads[name][:, :, piece]
            _close(got, want, f"rank {rank} grad {name}", tol)
    if rule == "retention-gamma-tensor":
        _close(sum(res["grads"]["gamma"] for res in results), grads["gamma"], "sum of the partial grads of gamma", tol)
