"""The sequence-parallel decay and delta rules on 1-4 CPU processes (gloo) against one process.

Every rank count is spawned once for this folder (``conftest.spawned``): the ranks run every
case of this file, ``test_sequence_parallel.py`` and ``test_sequence_parallel_layers.py``
(``every_case``) and return their outputs, states and gradients, which the tests compare here
with one process's float64 run of the single-process op on the whole sequence.
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
RULES = ("retention", "retention-gamma-tensor", "gla", "delta", "gated_delta", "kda",
         "retention-grouped", "gla-grouped", "kda-grouped")          # grouped: v, the gates and β have 2H heads
EXCHANGES = ("ring", "allgather", "scan")
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}          # relative to the largest reference value

SP = {"retention": sequence_parallel_retention, "gla": sequence_parallel_gated_linear_attention,
      "delta": sequence_parallel_delta_rule, "gated_delta": sequence_parallel_gated_delta_rule}
ONE = {"retention": linattn.retention, "gla": linattn.gated_linear_attention, "delta": linattn.delta_rule,
       "gated_delta": linattn.gated_delta_rule}


def _family(rule: str) -> str:
    rule = rule.removesuffix("-grouped")
    return {"retention-gamma-tensor": "retention", "kda": "gated_delta"}.get(rule, rule)


def _whole(rule: str, T: int, dtype: torch.dtype, seed: int) -> dict:
    """The whole sequence's inputs of ``rule`` (rounded to ``dtype``, held in float64), the same in every process."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    HV = 2 * H if rule.endswith("-grouped") else H                   # value head j reads q/k head j // (HV // H)
    x = dict(q=randn(B, H, T, D), k=F.normalize(randn(B, H, T, D), dim=-1), v=randn(B, HV, T, DV),
             S0=randn(B, HV, D, DV), w=randn(B, HV, T, DV), wS=randn(B, HV, D, DV))
    gates = {"retention": [], "retention-gamma-tensor": ["gamma"], "gla": ["log_g4"], "delta": ["beta"],
             "gated_delta": ["log_g3", "beta"], "kda": ["log_g4", "beta"], "retention-grouped": ["gamma"],
             "gla-grouped": ["log_g4"], "kda-grouped": ["log_g4", "beta"]}[rule]
    x["gamma"] = 0.8 + 0.2 * torch.rand(HV, generator=g, dtype=torch.float64)
    x["log_g4"] = -torch.rand(B, HV, T, D, generator=g, dtype=torch.float64)
    x["log_g3"] = -torch.rand(B, HV, T, generator=g, dtype=torch.float64)
    x["beta"] = 2 * torch.rand(B, HV, T, generator=g, dtype=torch.float64)   # negative eigenvalues included
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


def _outcome(call) -> tuple:
    """``("ok", result)`` or ``(exception type name, message)``."""
    try:
        return "ok", call()
    except (TypeError, ValueError) as err:
        return type(err).__name__, str(err)


def _error_cases() -> dict:
    """Calls on two ranks that must raise on both: one rank's bad input, or ranks that disagree."""
    rank = dist.get_rank()
    x = _local_inputs(_whole("kda", 8, torch.float64, 7), [4, 4], rank, torch.float64)
    q, k, v, log_g, beta = (x[n].detach() for n in ("q", "k", "v", "log_g4", "beta"))
    S0 = torch.zeros(B, H, D, DV, dtype=torch.float64)
    kda = sequence_parallel_gated_delta_rule
    calls = {
        "initial-state-on-rank-1": lambda: kda(q, k, v, log_g, beta, initial_state=S0 if rank == 1 else None),
        "gamma-differs": lambda: sequence_parallel_retention(q, k, v, 0.9 if rank == 0 else 0.8),
        "gamma-tensor-differs": lambda: sequence_parallel_retention(q, k, v, torch.full((H,), 0.9 - 0.1 * rank)),
        "rule-differs": lambda: (sequence_parallel_gated_linear_attention(q, k, v, log_g) if rank == 0 else
                                 kda(q, k, v, log_g, beta)),
        "grad-on-one-rank": lambda: kda(q.clone().requires_grad_(rank == 0), k, v, log_g, beta),
        "beta-out-of-range-on-rank-0": lambda: kda(q, k, v, log_g, beta + 3.0 * (rank == 0)),
        "value-dim-differs": lambda: kda(q, k, v[..., :DV - rank], log_g, beta),
        "position-dependent-feature-map": lambda: kda(
            q, k, v, log_g, beta, feature_map=linattn.feature_maps.CosFormerFeatures(max_len=16)),
        "unknown-exchange": lambda: kda(q, k, v, log_g, beta, state_exchange="tree"),
        "after-the-errors": lambda: kda(q, k, v, log_g, beta, chunk_size=CHUNK),
    }
    return {name: _outcome(call) for name, call in calls.items()}


def _half_and_feature_map_cases() -> dict:
    """bfloat16 inputs (float32 state) and a feature map, on two ranks."""
    rank = dist.get_rank()
    x = _local_inputs(_whole("kda", 8, torch.bfloat16, 8), [5, 3], rank, torch.bfloat16)
    half = [x[n].detach() for n in ("q", "k", "v", "log_g4", "beta")]
    out, S = sequence_parallel_gated_delta_rule(*half, chunk_size=CHUNK, return_state=True)
    y = _local_inputs(_whole("gla", 8, torch.float64, 9), [5, 3], rank, torch.float64)
    mapped = sequence_parallel_gated_linear_attention(y["q"], y["k"], y["v"], y["log_g4"], feature_map="elu+1",
                                                      chunk_size=CHUNK)
    (mapped * y["w"]).sum().backward()
    return {"bfloat16": (out, S), "feature-map": (mapped.detach(), [y[n].grad for n in ("q", "k", "v", "log_g4")])}


def _group_cases() -> dict:
    """Four ranks as two groups of two, each holding its own sequence."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, member = groups[rank // 2], rank % 2
    x = _local_inputs(_whole("gated_delta", 9, torch.float64, 10 + rank // 2), [6, 3], member, torch.float64)
    out, S = sequence_parallel_gated_delta_rule(x["q"], x["k"], x["v"], x["log_g3"], x["beta"],
                                                initial_state=x["S0"], group=mine, chunk_size=CHUNK,
                                                state_exchange="scan", return_state=True)
    return {"group": (out.detach(), S.detach())}


def every_case(world_size: int) -> dict:
    """What one process group of ``world_size`` ranks runs for the tests of this folder."""
    import test_sequence_parallel as linear
    import test_sequence_parallel_layers as layers

    extra = {2: lambda: {**_error_cases(), **_half_and_feature_map_cases()}, 4: _group_cases}
    return {"linear": linear._worker(linear.CASES[world_size]), "rules": run_rule_cases(world_size),
            "extra": extra.get(world_size, dict)(), "layers": layers.run_layer_cases(world_size)}


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


def _scan_sends(P: int, position: int) -> int:
    """Maps one position of the scan sends: one per round whose partner exists."""
    rounds = (P - 1).bit_length()
    return sum(position + 2 ** j < P for j in range(rounds))


def _transition_numbers(rule: str) -> int:
    """Numbers of one rank's transition A per batch and value head: a decay, a decay vector, a Dk x Dk matrix."""
    return {"retention": 1, "gla": D}.get(_family(rule), D * D)


def _value_heads(rule: str) -> int:
    return 2 * H if rule.endswith("-grouped") else H


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_each_exchange_sends_match_the_analytic_counts(spawned, world_size):
    """Per rank and pass: the chain one state (none from the last rank; backward none from rank 0), the
    all-gather P-1 maps (transition and state; backward P-1 states), the scan one map a round."""
    P = world_size
    for (rule, exchange, dtype_name), _ in rule_cases(P).items():
        n = 8 if dtype_name == "float64" else 4
        HV = _value_heads(rule)
        state, a_map = B * HV * D * DV * n, B * HV * (_transition_numbers(rule) + D * DV) * n
        for rank, res in enumerate(spawned(P)):
            got = res["rules"][(rule, exchange, dtype_name)]["bytes"]
            want = {"ring": (state * (rank < P - 1), state * (rank > 0)),
                    "allgather": ((P - 1) * a_map, (P - 1) * state),
                    "scan": (_scan_sends(P, rank) * a_map, _scan_sends(P, P - 1 - rank) * a_map)}[exchange]
            assert (got.get("state", 0), got.get("state_grad", 0)) == want, (rule, exchange, dtype_name, rank)
            assert got["handshake"] == (P - 1) * 15 * 8


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_chain_and_the_all_gather_agree_bit_for_bit(spawned, world_size):
    """Both fold the same maps in the same order, forward and backward."""
    for rule in RULES:
        for rank, res in enumerate(spawned(world_size)):
            a, b = res["rules"][(rule, "ring", "float64")], res["rules"][(rule, "allgather", "float64")]
            assert torch.equal(a["out"], b["out"]) and torch.equal(a["S"], b["S"]), (rule, rank)
            assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), (rule, rank)


@pytest.mark.parametrize("name,words", [
    ("initial-state-on-rank-1", [["rank(s) [1] rejected their inputs"], ["rank 1 must pass None"]]),
    ("gamma-differs", [["disagree on gamma ("]] * 2),
    ("gamma-tensor-differs", [["disagree on gamma ("]] * 2),
    ("rule-differs", [["disagree on rule", "rule=gated_linear_attention", "rule=gated_delta_rule"]] * 2),
    ("grad-on-one-rank", [["disagree on grad", "grad=True", "grad=False"]] * 2),
    ("beta-out-of-range-on-rank-0", [["beta", "[0, 2]"], ["rank(s) [0] rejected their inputs"]]),
    ("value-dim-differs", [["disagree on value_dim (", "value_dim=3", "value_dim=2"]] * 2),
    ("position-dependent-feature-map", [["position-dependent feature_map CosFormerFeatures"]] * 2),
    ("unknown-exchange", [["state_exchange must be one of"]] * 2),
])
def test_bad_inputs_and_disagreeing_ranks_raise_on_every_rank(spawned, name, words):
    for rank, res in enumerate(spawned(2)):
        kind, message = res["extra"][name]
        assert kind == "ValueError", f"rank {rank}: {kind} {message}"
        for word in words[rank]:
            assert word in message, f"rank {rank}: {word!r} not in {message!r}"


def test_the_group_works_after_the_errors(spawned):
    x = _whole("kda", 8, torch.float64, 7)
    want = linattn.gated_delta_rule(x["q"], x["k"], x["v"], x["log_g4"], x["beta"])
    for rank, res in enumerate(spawned(2)):
        kind, out = res["extra"]["after-the-errors"]
        assert kind == "ok"
        _close(out, want[:, :, 4 * rank:4 * rank + 4], f"rank {rank}", TOL[torch.float64])


def test_half_inputs_keep_a_float32_state(spawned):
    x = _whole("kda", 8, torch.bfloat16, 8)
    q, k, v, log_g, beta = (x[n].bfloat16() for n in ("q", "k", "v", "log_g4", "beta"))
    want, want_S = linattn.gated_delta_rule(q, k, v, log_g, beta, return_state=True)
    (out0, _), (out1, S) = (res["extra"]["bfloat16"] for res in spawned(2))
    assert out0.dtype == out1.dtype == torch.bfloat16 and S.dtype == torch.float32
    _close(torch.cat([out0, out1], dim=2), want.double(), "output", 2.0 ** -7)   # bfloat16's rounding
    _close(S, want_S.double(), "final state", 1e-5)                              # float32 arithmetic


def test_a_feature_map_is_applied_on_every_rank(spawned):
    x = _whole("gla", 8, torch.float64, 9)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "log_g4")]
    want = linattn.gated_linear_attention(*leaves, feature_map="elu+1")
    (want * x["w"]).sum().backward()
    for rank, res in enumerate(spawned(2)):
        out, grads = res["extra"]["feature-map"]
        piece = slice(5 * rank, 5 + 3 * rank)
        _close(out, want.detach()[:, :, piece], f"rank {rank} output", TOL[torch.float64])
        for name, got, leaf in zip(("q", "k", "v", "log_g"), grads, leaves):
            _close(got, leaf.grad[:, :, piece], f"rank {rank} grad {name}", TOL[torch.float64])


def test_two_groups_of_two_ranks_each_hold_their_own_sequence(spawned):
    results = spawned(4)
    for g in range(2):
        x = _whole("gated_delta", 9, torch.float64, 10 + g)
        want, want_S = linattn.gated_delta_rule(x["q"], x["k"], x["v"], x["log_g3"], x["beta"],
                                                initial_state=x["S0"], return_state=True)
        out = torch.cat([results[2 * g]["extra"]["group"][0], results[2 * g + 1]["extra"]["group"][0]], dim=2)
        _close(out, want, f"group {g} output", TOL[torch.float64])
        _close(results[2 * g + 1]["extra"]["group"][1], want_S, f"group {g} final state", TOL[torch.float64])
