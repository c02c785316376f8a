"""Sequence-parallel attention over torch.distributed, on 1, 2 and 4 CPU processes (gloo, 127.0.0.1).

Starting a process costs seconds (it imports torch), so each world size is spawned once: the
ranks run every case of ``CASES[P]`` in one process group (``_worker``) and return their
local outputs and gradients; the tests compare them here with single-process float64 runs of
``linear_attention`` / ``softmax_attention`` on the concatenated sequence.
"""
from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import linattn
from linattn.distributed import (RankError, count_bytes, local_state, measure_sequence_parallel, ring_softmax_attention,
                                 run_on_ranks, sequence_parallel_linear_attention)

B, H, D, DV = 2, 3, 4, 5
M = D  # elu+1 keeps the dimension
TOL = 1e-12  # float64 throughout, relative to the largest reference value


def _scaled_elu(x, scale=1.0):
    """A module-level feature map with a parameter, for functools.partial."""
    return (F.elu(x) + 1) * scale


def _child_feature_map(spec):
    """Feature maps that cannot be pickled to the ranks, built there from a name (else ``spec`` itself)."""
    if spec == "<lambda: elu+1>":
        return lambda x: F.elu(x) + 1
    if spec == "<lambda: relu>":
        return lambda x: F.relu(x)
    if spec == "<nested: elu+1>":
        def elu_plus_one(x):
            return F.elu(x) + 1
        return elu_plus_one
    return spec


def _cosformer(max_len):
    return linattn.feature_maps.CosFormerFeatures(max_len=max_len)


def _feature_map(case: dict, key: str = "feature_map"):
    """The case's feature map: ``("cosformer", max_len)`` or the default elu+1."""
    spec = case.get(key, case.get("feature_map"))
    return "elu+1" if spec is None else _cosformer(spec[1])


_PARTIAL = f"functools.partial({__name__}._scaled_elu, scale="
_REFUSED = "cannot be compared across processes: "

# name -> options. lengths: tokens per rank (queries and keys unless q_lengths is given).
_LINEAR = {
    "causal-norm-allgather": dict(lengths=None, causal=True, normalize=True, exchange="allgather"),
    "causal-norm-ring": dict(lengths=None, causal=True, normalize=True, exchange="ring"),
    "causal-unnorm-allgather": dict(lengths=None, causal=True, normalize=False, exchange="allgather"),
    "causal-unnorm-ring": dict(lengths=None, causal=True, normalize=False, exchange="ring"),
    "causal-norm-scan": dict(lengths=None, causal=True, normalize=True, exchange="scan"),
    "causal-norm-auto": dict(lengths=None, causal=True, normalize=True, exchange="auto"),
    "causal-norm-chain": dict(lengths=None, causal=True, normalize=True, exchange="chain"),
    "causal-unnorm-scan": dict(lengths=None, causal=True, normalize=False, exchange="scan"),
    "noncausal-norm": dict(lengths=None, causal=False, normalize=True, exchange="allgather"),
    "noncausal-unnorm": dict(lengths=None, causal=False, normalize=False, exchange="ring"),
}


def _cases(lengths: list[int]) -> dict[str, dict]:
    cases = {name: {**opts, "kind": "linear", "lengths": lengths} for name, opts in _LINEAR.items()}
    for causal in (True, False):
        tag = "causal" if causal else "noncausal"
        cases[f"softmax-{tag}"] = dict(kind="softmax", lengths=lengths, causal=causal)
    return cases


CASES = {
    1: {**_cases([7]), "mask": dict(kind="linear", lengths=[7], causal=True, normalize=True, exchange="ring",
                                     mask=True),
        "softmax-nonfinite": dict(kind="softmax", lengths=[9], causal=True, nonfinite={"v": [(6, "nan")],
                                                                                    "k": [(8, "nan")]})},
    2: {
        **_cases([5, 7]),
        "mismatch-heads": dict(kind="mismatch", lengths=[4, 4], field="heads"),
        "one-token-causal": dict(kind="linear", lengths=[1, 9], causal=True, normalize=True, exchange="ring"),
        "one-token-noncausal": dict(kind="linear", lengths=[9, 1], causal=False, normalize=True,
                                    exchange="allgather"),
        "invalid-on-rank-1": dict(kind="invalid", lengths=[4, 4]),
        "mask-causal": dict(kind="linear", lengths=[6, 5], causal=True, normalize=True, exchange="allgather",
                            mask=True),
        "mask-noncausal": dict(kind="linear", lengths=[6, 5], causal=False, normalize=True,
                               exchange="allgather", mask=True),
        "cross-attention": dict(kind="linear", lengths=[5, 7], q_lengths=[4, 2], causal=False, normalize=True,
                                exchange="allgather"),
        "mismatch-causal": dict(kind="mismatch", lengths=[4, 4], field="causal"),
        "softmax-one-token": dict(kind="softmax", lengths=[1, 9], causal=True),
        # a NaN or inf at a later position of the same rank must not reach earlier queries
        "softmax-nonfinite-first-rank": dict(kind="softmax", lengths=[5, 7], causal=True,
                                             nonfinite={"v": [(3, "nan")]}),
        "softmax-nonfinite-last-rank": dict(kind="softmax", lengths=[5, 7], causal=True,
                                            nonfinite={"v": [(9, "inf"), (11, "-inf")], "k": [(10, "nan")]}),
        "softmax-mismatch-dv": dict(kind="mismatch", lengths=[4, 4], field="value_dim", softmax=True),
        "autocast": dict(kind="autocast", lengths=[5, 7]),
        "return-state-causal": dict(kind="state", lengths=[5, 7], causal=True),
        "return-state-noncausal": dict(kind="state", lengths=[5, 7], causal=False),
        **{f"return-state-{method}-{'causal' if causal else 'noncausal'}": dict(
            kind="state", lengths=[5, 7], causal=causal, method=method)
           for causal, method in ((True, "chunk"), (True, "recurrent"), (True, "quadratic"),
                                  (False, "parallel"), (False, "quadratic"))},
        "bfloat16": dict(kind="linear", lengths=[5, 7], causal=True, normalize=True, exchange="allgather",
                         dtype="bfloat16"),
        # position-dependent features: each rank's slice starts at Σ of the earlier slices' lengths
        "cosformer-causal": dict(kind="linear", lengths=[5, 7], causal=True, normalize=True, exchange="allgather",
                                 feature_map=("cosformer", 16)),
        "cosformer-causal-unnorm-ring": dict(kind="linear", lengths=[2, 9], causal=True, normalize=False,
                                             exchange="ring", feature_map=("cosformer", 11)),
        "cosformer-noncausal": dict(kind="linear", lengths=[5, 7], causal=False, normalize=True,
                                    exchange="allgather", feature_map=("cosformer", 30)),
        "cosformer-noncausal-whole-length": dict(  # max_len = T gives one process's max_len=None
            kind="linear", lengths=[5, 7], causal=False, normalize=True, exchange="allgather",
            feature_map=("cosformer", 12), reference_feature_map=("cosformer", None)),
        "cosformer-cross-attention": dict(kind="linear", lengths=[5, 7], q_lengths=[4, 2], causal=False,
                                          normalize=True, exchange="allgather", feature_map=("cosformer", 12)),
        "cosformer-mask": dict(kind="linear", lengths=[6, 5], causal=True, normalize=True, exchange="ring",
                               mask=True, feature_map=("cosformer", 11)),
        **{f"options-{name}": dict(kind="options", lengths=[5, 7], **opts) for name, opts in {
            # agree, or may differ: computed, and equal to the single-process reference
            "exchange-unused-when-noncausal": dict(per_rank=[dict(causal=False, state_exchange="ring"),
                                                             dict(causal=False, state_exchange="allgather")]),
            "exchange-any-case": dict(per_rank=[dict(causal=True, state_exchange=" Ring "),
                                                dict(causal=True, state_exchange="RING")]),
            "exchange-chain-is-ring": dict(per_rank=[dict(causal=True, state_exchange="Chain"),
                                                     dict(causal=True, state_exchange="ring")]),
            "method-and-chunk-may-differ": dict(per_rank=[dict(causal=True, method="recurrent"),
                                                          dict(causal=True, method="Chunk", chunk_size=3)]),
            "feature-map-by-name-or-function": dict(per_rank=[dict(causal=True, feature_map=" ELU+1"),
                                                              dict(causal=True, feature_map=linattn.elu_plus_one)]),
            # disagree: every rank raises, naming the option and showing both values
            "exchange-differs-when-causal": dict(
                per_rank=[dict(causal=True, state_exchange="ring"), dict(causal=True, state_exchange="allgather")],
                expect=("ValueError", ["disagree on state_exchange (", "state_exchange='ring'",
                                       "state_exchange='allgather'"])),
            "eps-differs": dict(
                per_rank=[dict(causal=True, eps=1e-6), dict(causal=True, eps=1e-5)],
                expect=("ValueError", ["disagree on eps (", "eps=1e-06", "eps=1e-05"])),
            "normalize-differs": dict(
                per_rank=[dict(causal=False, normalize=True), dict(causal=False, normalize=False)],
                expect=("ValueError", ["disagree on normalize (", "normalize=True", "normalize=False"])),
            "feature-map-differs": dict(
                per_rank=[dict(causal=True, feature_map="elu+1"), dict(causal=True, feature_map="relu")],
                expect=("ValueError", ["disagree on feature_map (", "feature_map=linattn.feature_maps.elu_plus_one",
                                       "feature_map=linattn.feature_maps.relu"])),
            "softmax-scale-differs": dict(
                softmax=True, per_rank=[dict(causal=True, scale=0.5), dict(causal=True, scale=0.25)],
                expect=("ValueError", ["disagree on scale (", "scale=0.5", "scale=0.25"])),
            "feature-map-equal-partials": dict(
                per_rank=[dict(causal=True, feature_map=functools.partial(_scaled_elu, scale=2.0))] * 2),
            "feature-map-partials-differ": dict(
                per_rank=[dict(causal=True, feature_map=functools.partial(_scaled_elu, scale=1.0)),
                          dict(causal=True, feature_map=functools.partial(_scaled_elu, scale=2.0))],
                expect=("ValueError", ["disagree on feature_map (", f"feature_map={_PARTIAL}1.0)",
                                       f"feature_map={_PARTIAL}2.0)"])),
            "feature-map-two-lambdas": dict(
                per_rank=[dict(causal=True, feature_map="<lambda: elu+1>"),
                          dict(causal=True, feature_map="<lambda: relu>")],
                expect=("TypeError", [_REFUSED + "every lambda has the same name", "use a module-level function"])),
            "feature-map-lambda-on-one-rank": dict(
                per_rank=[dict(causal=False, feature_map="elu+1"), dict(causal=False, feature_map="<lambda: elu+1>")],
                expect=[("ValueError", ["rank(s) [1] rejected their inputs"]),
                        ("TypeError", [_REFUSED + "every lambda has the same name"])]),
            "feature-map-nested-function": dict(
                per_rank=[dict(causal=True, feature_map="<nested: elu+1>")] * 2,
                expect=("TypeError", [_REFUSED, "elu_plus_one is defined inside a function"])),
            "cosformer-max-len-differs": dict(
                per_rank=[dict(causal=True, feature_map=_cosformer(16)), dict(causal=True, feature_map=_cosformer(32))],
                expect=("ValueError", ["disagree on feature_map (", "CosFormerFeatures(max_len=16)",
                                       "CosFormerFeatures(max_len=32)"])),
            "cosformer-max-len-none": dict(
                per_rank=[dict(causal=False, feature_map=_cosformer(None))] * 2,
                expect=("ValueError", ["sequence_parallel_linear_attention: feature_map CosFormerFeatures(",
                                       "depends on the position and has max_len=None", "give the map max_len"])),
            "cosformer-max-len-none-on-one-rank": dict(
                per_rank=[dict(causal=True, feature_map=_cosformer(12)),
                          dict(causal=True, feature_map=_cosformer(None))],
                expect=[("ValueError", ["rank(s) [1] rejected their inputs"]),
                        ("ValueError", ["has max_len=None"])]),
            "cosformer-past-max-len-on-the-last-rank": dict(   # rank 1 holds positions 5..11
                per_rank=[dict(causal=True, feature_map=_cosformer(10))] * 2,
                expect=[("ValueError", ["rank(s) [1] rejected their inputs"]),
                        ("ValueError", ["5 + 7 exceed max_len"])]),       # cosFormer's own error
            # invalid on every rank: each raises its own error
            **{f"dtype-float8{'-softmax' if softmax else ''}": dict(
                softmax=softmax, dtype="float8_e4m3fn", per_rank=[dict(causal=True)] * 2,
                expect=("TypeError", ["q, k and v must be one of torch.float16, torch.bfloat16, torch.float32, "
                                      "torch.float64 for sequence parallelism, got torch.float8_e4m3fn"]))
               for softmax in (False, True)},
            "exchange-not-a-str": dict(
                per_rank=[dict(causal=True, state_exchange=1)] * 2,
                expect=("TypeError", ["state_exchange must be a str, one of ('auto', 'allgather', 'chain', 'ring', 'scan'), "
                                       "got int"])),
            "exchange-unknown-even-when-unused": dict(
                per_rank=[dict(causal=False, state_exchange="tree")] * 2,
                expect=("ValueError", ["state_exchange must be one of ('auto', 'allgather', 'chain', 'ring', 'scan') (any case), "
                                       "got 'tree'"])),
        }.items()},
    },
    3: {name: {**opts, "kind": "linear", "lengths": [4, 2, 5]} for name, opts in _LINEAR.items()},  # P not 2^k
    4: {
        **_cases([3, 1, 6, 4]),
        "mismatch-value-dim": dict(kind="mismatch", lengths=[3, 3, 3, 3], field="value_dim"),
        "softmax-nonfinite": dict(kind="softmax", lengths=[3, 1, 6, 4], causal=True,
                                  nonfinite={"v": [(2, "inf"), (8, "nan")], "k": [(13, "nan")]}),
        "after-mismatch": dict(kind="linear", lengths=[2, 5, 1, 3], causal=True, normalize=True, exchange="ring"),
        "cosformer-causal": dict(kind="linear", lengths=[3, 1, 6, 4], causal=True, normalize=True,
                                 exchange="ring", feature_map=("cosformer", 20)),
        "cosformer-causal-allgather": dict(kind="linear", lengths=[3, 1, 6, 4], causal=True, normalize=True,
                                           exchange="allgather", feature_map=("cosformer", 14)),
        "cosformer-noncausal": dict(kind="linear", lengths=[3, 1, 6, 4], causal=False, normalize=True,
                                    exchange="allgather", feature_map=("cosformer", 14)),
        "cosformer-cross-attention": dict(kind="linear", lengths=[3, 1, 6, 4], q_lengths=[1, 5, 2, 2],
                                          causal=False, normalize=True, exchange="ring",
                                          feature_map=("cosformer", 20)),
    },
}


def _inputs(name: str, case: dict):
    """The whole sequence in float64, the same in every process (seeded by the case name, so that
    the two exchanges of one configuration see the same numbers)."""
    key = name.removesuffix("-ring").removesuffix("-allgather").removesuffix("-scan").removesuffix("-auto").removesuffix("-chain")
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    Tk = sum(case["lengths"])
    Tq = sum(case.get("q_lengths") or case["lengths"])
    q = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, Tk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Tk, DV, generator=g, dtype=torch.float64)
    w = torch.randn(B, H, Tq, DV, generator=g, dtype=torch.float64)   # loss = Σ w ⊙ out
    mask = torch.rand(B, Tk, generator=g) > 0.3 if case.get("mask") else None
    for name, x in (("k", k), ("v", v)):
        for t, value in case.get("nonfinite", {}).get(name, []):
            x[1, 0, t, 1] = float(value)                               # one entry of one batch and head
    return q, k, v, w, mask


def _slice(lengths: list[int], rank: int) -> slice:
    start = sum(lengths[:rank])
    return slice(start, start + lengths[rank])


def _local(name: str, case: dict, rank: int):
    q, k, v, w, mask = _inputs(name, case)
    sk = _slice(case["lengths"], rank)
    sq = _slice(case.get("q_lengths") or case["lengths"], rank)
    return q[:, :, sq], k[:, :, sk], v[:, :, sk], w[:, :, sq], None if mask is None else mask[:, sk]


def _run_linear(name: str, case: dict, rank: int) -> dict:
    q, k, v, w, mask = _local(name, case, rank)
    dtype = getattr(torch, case.get("dtype", "float64"))
    q, k, v = (x.to(dtype).requires_grad_() for x in (q, k, v))
    with count_bytes() as counter:
        out = sequence_parallel_linear_attention(
            q, k, v, causal=case["causal"], normalize=case["normalize"], state_exchange=case["exchange"],
            attention_mask=mask, chunk_size=4, feature_map=_feature_map(case))
        (out.double() * w).sum().backward()
    return dict(out=out.detach(), grads=[x.grad for x in (q, k, v)], bytes=counter.by_op())


def _run_mismatch(case: dict, rank: int) -> tuple[str, str]:
    q, k, v, _, _ = _local("mismatch", case, rank)
    causal = True
    if rank == 1 and case["field"] == "heads":
        q, k, v = (torch.cat([x, x[:, :1]], dim=1) for x in (q, k, v))
    if rank == 1 and case["field"] == "value_dim":
        v = v[..., :-1]
    if rank == 1 and case["field"] == "causal":
        causal = False
    try:
        if case.get("softmax"):
            ring_softmax_attention(q, k, v, causal=causal)
        else:
            sequence_parallel_linear_attention(q, k, v, causal=causal)
    except ValueError as err:
        return ("ValueError", str(err))
    return ("no error", "")


def _run_invalid(case: dict, rank: int) -> tuple[str, str]:
    q, k, v, _, _ = _local("invalid", case, rank)
    if rank == 1:
        q = q[0]                                              # 3-D: rejected by rank 1's own checks
    try:
        sequence_parallel_linear_attention(q, k, v, causal=True)
    except ValueError as err:
        return ("ValueError", str(err))
    return ("no error", "")


def _run_options(name: str, case: dict, rank: int):
    """One call with this rank's own options: ("ok", out) or (exception type name, message)."""
    q, k, v, _, _ = _local(name, case, rank)
    q, k, v = (x.to(getattr(torch, case.get("dtype", "float64"))) for x in (q, k, v))
    opts = dict(case["per_rank"][rank])
    if "feature_map" in opts:
        opts["feature_map"] = _child_feature_map(opts["feature_map"])
    try:
        if case.get("softmax"):
            out = ring_softmax_attention(q, k, v, **opts)
        else:
            out = sequence_parallel_linear_attention(q, k, v, **opts)
    except (TypeError, ValueError) as err:
        return (type(err).__name__, str(err))
    return ("ok", out)


def _layout(state, others: list[torch.Tensor]) -> dict:
    """How the returned state's tensors sit in memory (checked in the rank: pickling would copy them)."""
    def owns(x):
        return x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    pointers = [x.untyped_storage().data_ptr() for x in (state.S, state.z, *others)]
    return dict(contiguous=(state.S.is_contiguous(), state.z.is_contiguous()), owns=(owns(state.S), owns(state.z)),
                distinct=len(set(pointers)) == len(pointers))


def _run_autocast(name: str, case: dict) -> dict:
    """Each call in and out of a bfloat16 autocast region, on the same inputs: "equal" or what differed."""
    q64, k64, v64, w, _ = _local(name, case, dist.get_rank())
    calls = {
        "linear-causal": lambda q, k, v: sequence_parallel_linear_attention(q, k, v, causal=True, chunk_size=4),
        "linear-causal-cosformer": lambda q, k, v: sequence_parallel_linear_attention(
            q, k, v, causal=True, feature_map=_cosformer(12), method="quadratic"),
        "linear-noncausal-state": lambda q, k, v: sequence_parallel_linear_attention(
            q, k, v, causal=False, return_state=True)[1].S,
        "softmax-causal": lambda q, k, v: ring_softmax_attention(q, k, v, causal=True),
    }
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        for label, call in calls.items():
            runs = []
            for autocast in (False, True):
                q, k, v = (x.to(dtype).requires_grad_(not label.startswith("softmax")) for x in (q64, k64, v64))
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        with torch.set_grad_enabled(not label.startswith("softmax")):
                            out = call(q, k, v)
                    if out.requires_grad:
                        (out.double() * (w if out.shape == w.shape else 1.0)).sum().backward()
                    runs.append((out.detach(), [x.grad for x in (q, k, v)]))
                except (RuntimeError, ValueError, TypeError) as err:
                    runs.append((f"{type(err).__name__}: {err}", []))
            (a, grads_a), (b, grads_b) = runs
            same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                    and torch.equal(a, b) and all(x is None and y is None or torch.equal(x, y)
                                                  for x, y in zip(grads_a, grads_b)))
            report[f"{label} {dtype}"] = "equal" if same else f"without autocast: {a!r:.200}; with: {b!r:.200}"
    return report


def _worker(cases: dict[str, dict]) -> dict:
    """Runs on every rank: each case on this rank's slice; returns what the tests compare."""
    rank = dist.get_rank()
    results = {}
    for name, case in cases.items():
        if case["kind"] == "linear":
            results[name] = _run_linear(name, case, rank)
        elif case["kind"] == "softmax":
            q, k, v, _, _ = _local(name, case, rank)
            with count_bytes() as counter, torch.no_grad():
                out = ring_softmax_attention(q, k, v, causal=case["causal"])
            results[name] = dict(out=out, bytes=counter.by_op())
        elif case["kind"] == "state":
            q, k, v, _, _ = _local(name, case, rank)
            out, state = sequence_parallel_linear_attention(q, k, v, causal=case["causal"], return_state=True,
                                                            method=case.get("method", "auto"), chunk_size=4)
            results[name] = dict(S=state.S, z=state.z, layout=_layout(state, [q, k, v, out]))
        elif case["kind"] == "mismatch":
            results[name] = _run_mismatch(case, rank)
        elif case["kind"] == "options":
            results[name] = _run_options(name, case, rank)
        elif case["kind"] == "autocast":
            results[name] = _run_autocast(name, case)
        else:
            results[name] = _run_invalid(case, rank)
    return results


@pytest.fixture
def ranks(spawned):
    """``ranks(P)``: the per-rank results of ``_worker`` on P processes (one process group per P for the
    whole folder, ``conftest.spawned``)."""
    return lambda world_size: [res["linear"] for res in spawned(world_size)]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:g} x {scale:.3g}"


def _reference_linear(name: str, case: dict):
    q, k, v, w, mask = _inputs(name, case)
    if case.get("dtype") == "bfloat16":     # the distributed run saw bfloat16-rounded inputs
        q, k, v = (x.bfloat16().double() for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = linattn.linear_attention(q, k, v, causal=case["causal"], normalize=case["normalize"],
                                   attention_mask=mask, feature_map=_feature_map(case, "reference_feature_map"))
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)]


LINEAR_IDS = [(P, name) for P, cases in CASES.items() for name, c in cases.items() if c["kind"] == "linear"]


@pytest.mark.parametrize("world_size,name", LINEAR_IDS, ids=[f"P{P}-{n}" for P, n in LINEAR_IDS])
def test_outputs_and_gradients_equal_single_process(ranks, world_size, name):
    case = CASES[world_size][name]
    results = ranks(world_size)
    out, grads = _reference_linear(name, case)
    half = case.get("dtype") == "bfloat16"
    tol = 2.0 ** -7 if half else TOL          # bfloat16: the output is rounded to 8 significant bits
    q_lengths = case.get("q_lengths") or case["lengths"]
    for rank, res in enumerate(results):
        sq, sk = _slice(q_lengths, rank), _slice(case["lengths"], rank)
        assert res[name]["out"].dtype == getattr(torch, case.get("dtype", "float64"))
        _close(res[name]["out"], out[:, :, sq], f"rank {rank} output", tol)
        for label, got, want in zip("qkv", res[name]["grads"], grads):
            if not half:                          # (bfloat16 gradients are bfloat16 roundings of these)
                _close(got, want[:, :, sq if label == "q" else sk], f"rank {rank} grad {label}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_and_allgather_exchanges_agree_bit_for_bit(ranks, world_size):
    for rank, res in enumerate(ranks(world_size)):
        for norm in ("norm", "unnorm"):
            a, b = res[f"causal-{norm}-allgather"], res[f"causal-{norm}-ring"]
            assert torch.equal(a["out"], b["out"]), f"rank {rank}"
            assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), f"rank {rank}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_scan_agrees_with_allgather_to_rounding(ranks, world_size):
    """The scan adds the same states in a tree's order: equal up to float64 rounding (bit for bit at P = 2)."""
    for rank, res in enumerate(ranks(world_size)):
        for norm in ("norm", "unnorm"):
            a, b = res[f"causal-{norm}-allgather"], res[f"causal-{norm}-scan"]
            _close(b["out"], a["out"], f"rank {rank} output")
            for x, y in zip(a["grads"], b["grads"]):
                _close(y, x, f"rank {rank} gradient")
            if world_size == 2:
                assert torch.equal(a["out"], b["out"]), f"rank {rank}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_auto_exchange_is_the_chain_on_gloo(ranks, world_size):
    assert linattn.distributed.AUTO_STATE_EXCHANGE == {"nccl": "allgather"}
    for rank, res in enumerate(ranks(world_size)):
        a, b = res["causal-norm-auto"], res["causal-norm-ring"]
        assert torch.equal(a["out"], b["out"]) and a["bytes"] == b["bytes"], f"rank {rank}"
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), f"rank {rank}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_chain_is_another_name_for_ring(ranks, world_size):
    """``"chain"`` is exactly ``"ring"``: the same messages, bit-identical outputs and gradients."""
    assert linattn.distributed.STATE_EXCHANGE_ALIASES == {"chain": "ring"}
    assert "chain" not in linattn.distributed.STATE_EXCHANGES      # results files keep the name "ring"
    for rank, res in enumerate(ranks(world_size)):
        a, b = res["causal-norm-chain"], res["causal-norm-ring"]
        assert torch.equal(a["out"], b["out"]) and a["bytes"] == b["bytes"], f"rank {rank}"
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), f"rank {rank}"


def test_chain_is_named_where_a_bad_exchange_is_refused():
    with pytest.raises(ValueError, match=r"state_exchange must be one of \('auto', 'allgather', 'chain', 'ring', "
                                         r"'scan'\) \(any case\), got 'tree'"):
        measure_sequence_parallel(2, [dict(kind="linear", T=8, state_exchange="tree")])


def _scan_sends(P: int, position: int) -> int:
    """States one position of the scan sends: one per round whose partner exists."""
    rounds = max(1, math.ceil(math.log2(P))) if P > 1 else 0
    return sum(position + 2 ** j < P for j in range(rounds))


SOFTMAX_IDS = [(P, name) for P, cases in CASES.items() for name, c in cases.items()
               if c["kind"] == "softmax" and "nonfinite" not in c]


@pytest.mark.parametrize("world_size,name", SOFTMAX_IDS, ids=[f"P{P}-{n}" for P, n in SOFTMAX_IDS])
def test_ring_softmax_equals_softmax_attention(ranks, world_size, name):
    case = CASES[world_size][name]
    q, k, v, _, _ = _inputs(name, case)
    want = linattn.softmax_attention(q, k, v, causal=case["causal"])
    for rank, res in enumerate(ranks(world_size)):
        _close(res[name]["out"], want[:, :, _slice(case["lengths"], rank)], f"rank {rank}")


def _causal_softmax_by_rows(q, k, v):
    """Causal softmax attention one query at a time, over its own keys only (no masked pairs at all)."""
    rows = []
    for i in range(q.shape[2]):
        w = torch.softmax(q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-1, -2) / D ** 0.5, dim=-1)  # (B, H, 1, i+1)
        rows.append(w @ v[:, :, :i + 1])
    return torch.cat(rows, dim=2)


NONFINITE_IDS = [(P, name) for P, cases in CASES.items() for name, c in cases.items() if "nonfinite" in c]


@pytest.mark.parametrize("world_size,name", NONFINITE_IDS, ids=[f"P{P}-{n}" for P, n in NONFINITE_IDS])
def test_ring_softmax_a_nan_or_inf_reaches_no_earlier_query(ranks, world_size, name):
    case = CASES[world_size][name]
    q, k, v, _, _ = _inputs(name, case)
    want = _causal_softmax_by_rows(q, k, v)
    first = min(t for spots in case["nonfinite"].values() for t, _ in spots)
    assert torch.isfinite(want[:, :, :first]).all() and not torch.isfinite(want[:, :, first:]).all()
    for rank, res in enumerate(ranks(world_size)):
        got, ref = res[name]["out"], want[:, :, _slice(case["lengths"], rank)]
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), f"rank {rank}: NaN/inf at other places"
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"rank {rank}: NaN where one process has inf"
        ok = torch.isfinite(ref)
        _close(got[ok], ref[ok], f"rank {rank} finite outputs")


def _state_nbytes() -> int:
    return B * H * M * (DV + 1) * 8          # float64 state, normaliser column included


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bytes_sent_match_the_analytic_counts(ranks, world_size):
    P, s = world_size, _state_nbytes()
    handshake = (P - 1) * 15 * 8              # an all-gather of one row of 15 int64 per rank
    for rank, res in enumerate(ranks(world_size)):
        assert res["causal-norm-allgather"]["bytes"] == (
            {"handshake": handshake, "state": (P - 1) * s, "state_grad": (P - 1) * s} if P > 1 else
            {"handshake": 0, "state": 0, "state_grad": 0})
        ring = res["causal-norm-ring"]["bytes"]
        assert ring.get("state", 0) == (s if rank < P - 1 else 0)          # forward: to the right
        assert ring.get("state_grad", 0) == (s if rank > 0 else 0)         # backward: to the left
        scan = res["causal-norm-scan"]["bytes"]
        assert scan.get("state", 0) == _scan_sends(P, rank) * s            # forward: rounds to the right
        assert scan.get("state_grad", 0) == _scan_sends(P, P - 1 - rank) * s   # backward: to the left
        assert res["noncausal-norm"]["bytes"]["state"] == 2 * (P - 1) * s // P
        lengths = CASES[P]["softmax-causal"]["lengths"]
        passed = [lengths[(rank - step) % P] for step in range(P - 1)]     # the blocks this rank forwards
        assert res["softmax-causal"]["bytes"].get("kv", 0) == sum(passed) * B * H * (D + DV) * 8


@pytest.mark.parametrize("world_size,name,words", [
    (2, "mismatch-heads", "heads"), (2, "mismatch-causal", "causal ("),
    (2, "softmax-mismatch-dv", "value_dim"), (4, "mismatch-value-dim", "value_dim")])
def test_ranks_that_disagree_all_raise_a_clear_value_error(ranks, world_size, name, words):
    for rank, res in enumerate(ranks(world_size)):
        kind, message = res[name]
        assert kind == "ValueError", f"rank {rank} got {kind}"
        assert f"disagree on {words}" in message and "rank 0:" in message and "rank 1:" in message


def test_a_rank_with_invalid_inputs_raises_its_own_error_and_the_others_name_it(ranks):
    (kind0, msg0), (kind1, msg1) = (res["invalid-on-rank-1"] for res in ranks(2))
    assert kind0 == kind1 == "ValueError"
    assert "q must be 4-D" in msg1
    assert "rank(s) [1] rejected their inputs" in msg0


def test_the_group_still_works_after_a_mismatch(ranks):
    case = CASES[4]["after-mismatch"]
    out, _ = _reference_linear("after-mismatch", case)
    for rank, res in enumerate(ranks(4)):
        _close(res["after-mismatch"]["out"], out[:, :, _slice(case["lengths"], rank)], f"rank {rank}")


OPTION_IDS = [name for name, c in CASES[2].items() if c["kind"] == "options"]


@pytest.mark.parametrize("name", OPTION_IDS)
def test_which_options_the_ranks_must_agree_on(ranks, name):
    case = CASES[2][name]
    results = [res[name] for res in ranks(2)]
    if "expect" in case:
        expect = case["expect"] if isinstance(case["expect"], list) else [case["expect"]] * len(results)
        for rank, ((kind, words), (got_kind, message)) in enumerate(zip(expect, results)):
            assert got_kind == kind, f"rank {rank} got {got_kind}: {message}"
            for word in words:
                assert word in message, f"rank {rank}: {word!r} not in {message!r}"
        return
    q, k, v, _, _ = _inputs(name, case)
    opts = {key: value for key, value in case["per_rank"][0].items() if key not in ("state_exchange", "method")}
    want = linattn.linear_attention(q, k, v, **opts)
    for rank, (kind, out) in enumerate(results):
        assert kind == "ok", f"rank {rank} raised {kind}: {out}"
        _close(out, want[:, :, _slice(case["lengths"], rank)], f"rank {rank} output")


@pytest.mark.parametrize("causal", [True, False])
def test_return_state(ranks, causal):
    name = f"return-state-{'causal' if causal else 'noncausal'}"
    q, k, v, _, _ = _inputs(name, CASES[2][name])
    _, full = linattn.linear_attention(q, k, v, causal=causal, return_state=True)
    _, first = linattn.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, return_state=True)
    results = ranks(2)
    for rank, res in enumerate(results):
        want = first if (causal and rank == 0) else full
        _close(res[name]["S"], want.S, f"rank {rank} S")
        _close(res[name]["z"], want.z, f"rank {rank} z")


def test_autocast_changes_no_number(ranks):
    """linattn computes in float32 (float64 kept) in and out of an autocast region: the same
    outputs, states and gradients, for float32 and bfloat16 inputs."""
    for rank, res in enumerate(ranks(2)):
        assert len(res["autocast"]) == 8
        for call, verdict in res["autocast"].items():
            assert verdict == "equal", f"rank {rank}, {call}: {verdict}"


STATE_IDS = [name for name, c in CASES[2].items() if c["kind"] == "state" and "method" in c]


@pytest.mark.parametrize("name", STATE_IDS)
def test_returned_states_are_contiguous_and_own_their_memory(ranks, name):
    case = CASES[2][name]
    q, k, v, _, _ = _inputs(name, case)
    _, full = linattn.linear_attention(q, k, v, causal=case["causal"], return_state=True)
    _, first = linattn.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, return_state=True)
    for rank, res in enumerate(ranks(2)):
        layout = res[name]["layout"]
        assert layout == dict(contiguous=(True, True), owns=(True, True), distinct=True), f"rank {rank}: {layout}"
        want = first if (case["causal"] and rank == 0) else full
        _close(res[name]["S"], want.S, f"rank {rank} S")
        _close(res[name]["z"], want.z, f"rank {rank} z")


# ---------------------------------------------------------------------------------------
# In this process (no spawning)
# ---------------------------------------------------------------------------------------


def test_without_a_process_group_the_error_says_what_to_do():
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 3, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sequence_parallel_linear_attention(x, x, x)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_softmax_attention(x, x, x)


def test_local_state_is_the_state_linear_attention_returns():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, B, H, 9, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, 9, DV, generator=g, dtype=torch.float64)
    mask = torch.rand(B, 9, generator=g) > 0.5
    _, want = linattn.linear_attention(q, k, v, causal=True, attention_mask=mask, return_state=True)
    got = local_state(k, v, attention_mask=mask)
    _close(got.S, want.S, "S")
    _close(got.z, want.z, "z")
    assert local_state(k.half(), v.half()).S.dtype == torch.float32
    with pytest.raises(ValueError, match="share batch, heads and seq"):
        local_state(k, v[:, :, :5])


def test_local_state_is_the_same_under_autocast():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, H, 9, D, generator=g)
    v = torch.randn(B, H, 9, DV, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        want = local_state(k.to(dtype), v.to(dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = local_state(k.to(dtype), v.to(dtype))
        assert got.S.dtype == got.z.dtype == torch.float32
        assert torch.equal(got.S, want.S) and torch.equal(got.z, want.z), dtype


def test_local_state_passes_the_offset_to_a_position_dependent_map():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(B, H, 12, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, 12, DV, generator=g, dtype=torch.float64)
    for max_len in (12, 20, None):
        phi = _cosformer(max_len)
        feats = phi(k)                                               # positions 0..11 of the whole sequence
        want_S, want_z = feats.transpose(-1, -2) @ v, feats.sum(dim=2)
        if max_len is None:                                          # only a slice at offset 0 is defined
            got = local_state(k, v, feature_map=phi)
        else:
            parts = [local_state(k[:, :, a:b], v[:, :, a:b], feature_map=phi, offset=a)
                     for a, b in ((0, 5), (5, 6), (6, 12))]
            got = linattn.LinearAttentionState(sum(p.S for p in parts), sum(p.z for p in parts))
        _close(got.S, want_S, f"S, max_len={max_len}")
        _close(got.z, want_z, f"z, max_len={max_len}")
    # a map that does not depend on the position ignores the offset
    assert torch.equal(local_state(k, v, offset=7).S, local_state(k, v).S)
    with pytest.raises(ValueError, match="local_state with offset=5: feature_map .* depends on the position and "
                                         "has max_len=None"):
        local_state(k[:, :, 5:], v[:, :, 5:], feature_map=_cosformer(None), offset=5)
    with pytest.raises(ValueError, match="exceed max_len"):
        local_state(k, v, feature_map=_cosformer(12), offset=1)
    with pytest.raises(ValueError, match="offset must be >= 0 .*, got -1"):
        local_state(k, v, offset=-1)
    with pytest.raises(TypeError, match="offset must be an int .*, got float"):
        local_state(k, v, offset=1.0)


def test_the_masked_weighted_sum_leaves_masked_pairs_out():
    from linattn.distributed.ring import _visible_weighted_sum
    g = torch.Generator().manual_seed(2)
    p = torch.rand(B, H, 11, 11, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, 11, 4, generator=g, dtype=torch.float64)    # 11 // 4: two tokens a step
    visible = torch.ones(11, 11, dtype=torch.bool).tril()
    p = p * visible                                                # masked weights are 0, as exp(-inf) gives
    v[0, 1, 3, 0], v[1, 2, 7, 1], v[1, 0, 8] = float("nan"), float("inf"), float("-inf")
    v[:, :, 10, 0] = float("nan")                                  # more bad tokens than one step takes
    want = torch.stack([sum(p[..., i, j, None] * v[..., j, :] for j in range(i + 1)) for i in range(11)], dim=2)
    got = _visible_weighted_sum(p, v, visible)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isfinite(got[:, :, :3]).all()
    ok = torch.isfinite(want)
    _close(got[ok], want[ok], "finite entries")
    clean = torch.randn(B, H, 11, 4, generator=g, dtype=torch.float64)
    assert torch.equal(_visible_weighted_sum(p, clean, visible), p @ clean)   # no NaN: the plain matmul


def _top_level(x):
    return x


class _CallableObject:
    def __call__(self, x):
        return x


def test_feature_maps_are_identified_by_name_arguments_or_configuration():
    from linattn.distributed.agreement import _feature_map_name
    from linattn.feature_maps import CosFormerFeatures, TaylorFeatures, resolve_feature_map
    assert _feature_map_name(resolve_feature_map(" ELU+1")) == "linattn.feature_maps.elu_plus_one"
    assert _feature_map_name(linattn.elu_plus_one) == "linattn.feature_maps.elu_plus_one"
    assert _feature_map_name(torch.nn.functional.elu) == "torch.nn.functional.elu"
    assert _feature_map_name(None) == "None (q and k are features)"
    # modules: class and configuration (so two cosFormer lengths differ), not parameters
    assert _feature_map_name(CosFormerFeatures(max_len=16)) == (
        "linattn.feature_maps.CosFormerFeatures instance: CosFormerFeatures(max_len=16)")
    assert _feature_map_name(CosFormerFeatures(max_len=16)) != _feature_map_name(CosFormerFeatures(max_len=32))
    assert _feature_map_name(resolve_feature_map("performer")).startswith(
        "linattn.feature_maps.PerformerFeatures instance: PerformerFeatures(")
    assert _feature_map_name(TaylorFeatures().forward) == (
        "linattn.feature_maps.TaylorFeatures.forward bound to "
        "linattn.feature_maps.TaylorFeatures instance: TaylorFeatures(scale=None)")
    assert _feature_map_name(_CallableObject()) == f"{__name__}._CallableObject instance"
    # partials: the function and its plain arguments
    one, two = (functools.partial(_scaled_elu, scale=s) for s in (1.0, 2.0))
    assert _feature_map_name(one) == f"{_PARTIAL}1.0)"
    assert _feature_map_name(one) != _feature_map_name(two)
    assert _feature_map_name(one) == _feature_map_name(functools.partial(_scaled_elu, scale=1.0))
    assert _feature_map_name(functools.partial(_scaled_elu, (1, None, "a"))) == (
        f"functools.partial({__name__}._scaled_elu, (1, None, 'a'))")
    # what no name identifies: refused
    for phi, words in [(lambda x: x, "every lambda has the same name, <lambda>"),
                       (_child_feature_map("<nested: elu+1>"), "is defined inside a function"),
                       (functools.partial(lambda x, s: x * s, s=2.0), "every lambda"),
                       (functools.partial(_scaled_elu, scale=torch.tensor(2.0)), "argument of type torch.Tensor "
                                                                                 "is not a plain value"),
                       (functools.partial(_scaled_elu, scale=(1, [torch.ones(1)])), "not a plain value"),
                       (torch.ones(3).mul, "bound to a torch.Tensor, whose value is not compared")]:
        with pytest.raises(TypeError, match="cannot be compared across processes: .*" + words):
            _feature_map_name(phi)


def test_run_on_ranks_rejects_what_cannot_be_spawned():
    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(lambda: 0, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_on_ranks(_top_level, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_on_ranks(_top_level, 1, timeout=-1.0)
    with pytest.raises(TypeError, match="threads must be an int, got float"):
        run_on_ranks(_top_level, 1, threads=1.5)
    with pytest.raises(ValueError, match=r"backend must be 'gloo' \(CPU\) or 'nccl' \(one GPU per rank\), "
                                         r"got 'nonsense'"):
        run_on_ranks(_top_level, 1, backend="nonsense")
    with pytest.raises(TypeError, match="backend must be a str, 'gloo' or 'nccl', got NoneType"):
        run_on_ranks(_top_level, 1, backend=None)
    with pytest.raises(ValueError, match="state_exchange must be one of"):
        measure_sequence_parallel(2, [dict(kind="linear", T=8, state_exchange="tree")])
    with pytest.raises(ValueError, match="each case needs 'kind' and 'T'"):
        measure_sequence_parallel(2, [dict(kind="linear")])
    with pytest.raises(ValueError, match="case kind must be one of"):
        measure_sequence_parallel(2, [dict(kind="retention", T=8)])


# ---------------------------------------------------------------------------------------
# The process machinery itself
# ---------------------------------------------------------------------------------------


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()          # rank 0 waits for a peer that never comes


def _rank_1_hangs(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)  # not in a collective: only rank 0's collective timeout can end this
    dist.barrier()


def test_a_worker_exception_reaches_the_parent_and_the_blocked_peer_is_stopped():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised ValueError: boom on rank 1") as info:
        run_on_ranks(_fail_on_rank_1, 2, timeout=60.0)
    assert info.value.failures[1][:2] == ("ValueError", "boom on rank 1")
    assert time.monotonic() - start < 45.0     # not the 60 s timeout: the waiting rank was stopped


def test_a_collective_that_waits_past_the_timeout_fails_and_the_run_ends():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_rank_1_hangs, 2, 120.0, timeout=3.0)
    assert 0 in info.value.failures            # rank 0's barrier timed out; rank 1 was then stopped
    assert time.monotonic() - start < 60.0     # not rank 1's 120 s


def test_measure_sequence_parallel_counts_bytes_and_times():
    T, P = 64, 2
    records = measure_sequence_parallel(P, [
        dict(kind="linear", T=T, causal=True, state_exchange="Ring", backward=True),
        dict(kind="linear", T=T, causal=True, communication_only=True),
        dict(kind="softmax", T=T, causal=True),
        dict(kind="softmax", T=T + 1, causal=True, communication_only=True),
        dict(kind="linear", T=T, causal=True, communication_only=True, state_exchange="scan", block=3),
        dict(kind="gated_delta", T=T, backward=True, state_exchange="allgather"),
        dict(kind="gated_delta", T=T, communication_only=True, state_exchange="ring"),
        dict(kind="softmax", T=T, causal=True, backward=True),
    ], repeats=1, timeout=60.0)
    s = 1 * 2 * 16 * 17 * 4                     # float32 state of B=1, H=2, M=16, Dv+1=17
    hs = 15 * 8                                 # the other rank's row of 15 int64
    assert records[0]["bytes_sent"] == [hs + s, hs + s] and records[0]["handshake_bytes"] == [hs, hs]
    assert records[1]["bytes_sent"] == [s, s]
    kv = 1 * 2 * (16 + 16) * 4                  # bytes of one token's key and value
    assert records[2]["bytes_sent"] == [hs + 32 * kv, hs + 32 * kv]
    assert records[3]["bytes_sent"] == [33 * kv, 32 * kv]   # slices of 33 and 32 tokens
    assert records[4]["bytes_sent"] == [s, 0] and records[4]["block"] == 3 and records[0]["block"] is None
    a_map, state = 1 * 2 * 16 * (16 + 16) * 4, 1 * 2 * 16 * 16 * 4   # a transition and a state; a state
    assert records[5]["bytes_sent"] == [hs + a_map + state] * 2        # the maps forward, the states backward
    assert records[6]["bytes_sent"] == [state, 0]                      # the chain: one state, to the right
    assert records[7]["bytes_sent"] == [hs + 32 * kv + 3 * 32 * kv] * 2   # the blocks, then blocks and gradients
    assert all(r["seconds"] > 0 and r["world_size"] == P for r in records)
