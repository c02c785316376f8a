"""On a CUDA machine: linattn against flash-linear-attention (fla-core), one shape per operator.

    python scripts/gpu_peers.py --json peers.json          # skips itself when fla is not importable

Pairs (B=1, T=4096, H=8, D=Dv=64, bfloat16 inputs, causal, no scaling of q): linear attention
(elu+1 features, normalised) against ``fla.ops.linear_attn.chunk_linear_attn``, GLA against
``fla.ops.gla.chunk_gla`` and the gated delta rule (one gate per head, unit keys) against
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``. Each pair gets the same numbers (fla in its
(B, T, H, D) layout, made before timing); the forward and forward+backward passes of the two are
timed interleaved (linattn.bench.interleaved_times, CUDA synchronised), and the largest relative
difference of their outputs is printed as a cross-check. No autotuning sweeps beyond what fla does
on its first call (absorbed by the warm-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import linattn
from linattn.bench import interleaved_times, machine_info, paired_ratios


def _pairs(B, T, H, D, dtype, device):
    g = torch.Generator().manual_seed(0)
    q, k, v, x = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    kn = F.normalize(k, dim=-1)
    log_g = F.logsigmoid(x) / 16                                     # (B, H, T, D)
    beta = torch.sigmoid(x[..., 0])                                   # (B, H, T)
    ours = lambda t: t.to(device, dtype).requires_grad_()            # noqa: E731  (B, H, T, ·)
    theirs = lambda t: t.transpose(1, 2).contiguous().to(device, dtype).requires_grad_()  # noqa: E731
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.linear_attn import chunk_linear_attn

    elu1 = linattn.elu_plus_one
    yield ("linear", (ours(q), ours(k), ours(v)),
           lambda q, k, v: linattn.linear_attention(q, k, v, causal=True),
           (theirs(q), theirs(k), theirs(v)),
           lambda q, k, v: chunk_linear_attn(elu1(q), elu1(k), v, scale=1.0, normalize=True)[0])
    g_ours, g_theirs = ours(log_g).detach(), theirs(log_g).detach()
    yield ("gla", (ours(q), ours(k), ours(v)),
           lambda q, k, v: linattn.gated_linear_attention(q, k, v, g_ours),
           (theirs(q), theirs(k), theirs(v)),
           lambda q, k, v: chunk_gla(q, k, v, g=g_theirs, scale=1.0)[0])
    gh_ours = log_g[..., 0].to(device, dtype)                         # (B, H, T)
    gh_theirs = log_g[..., 0].transpose(1, 2).contiguous().to(device, dtype)   # (B, T, H)
    b_ours, b_theirs = beta.to(device, dtype), beta.transpose(1, 2).contiguous().to(device, dtype)
    yield ("gated_delta", (ours(q), ours(kn), ours(v)),
           lambda q, k, v: linattn.gated_delta_rule(q, k, v, gh_ours, b_ours),
           (theirs(q), theirs(kn), theirs(v)),
           lambda q, k, v: chunk_gated_delta_rule(q, k, v, g=gh_theirs, beta=b_theirs, scale=1.0)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    try:
        import fla  # noqa: F401
    except ImportError as err:
        print(f"fla-core is not importable ({err}): no flash-linear-attention peers")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA: no flash-linear-attention peers")
        return 0
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, ours_in, ours_fn, theirs_in, theirs_fn in _pairs(1, args.seq_len, 8, 64, dtype, device):
        grad = torch.randn_like(ours_in[2])
        grad_t = grad.transpose(1, 2).contiguous()
        with torch.no_grad():
            a = ours_fn(*ours_in).float()
            b = theirs_fn(*theirs_in).float().transpose(1, 2)
        diff = ((a - b).abs().max() / b.abs().max()).item()

        def fwd(fn, x):
            def run():
                with torch.no_grad():
                    fn(*x)
            return run

        def fwd_bwd(fn, x, g):
            return lambda: torch.autograd.grad(fn(*x), x, g)

        t_f = interleaved_times({"linattn": fwd(ours_fn, ours_in), "fla": fwd(theirs_fn, theirs_in)},
                                repeats=args.repeats, warmup=3, device=device)
        t_b = interleaved_times({"linattn": fwd_bwd(ours_fn, ours_in, grad), "fla": fwd_bwd(theirs_fn, theirs_in, grad_t)},
                                repeats=args.repeats, warmup=3, device=device)
        row = {"op": name, "seq_len": args.seq_len, "dtype": "bfloat16", "max_rel_diff": diff,
               "fwd_ms": {k: 1e3 * statistics.median(v) for k, v in t_f.items()},
               "fwd_bwd_ms": {k: 1e3 * statistics.median(v) for k, v in t_b.items()},
               "fwd_linattn_over_fla": paired_ratios(t_f["linattn"], t_f["fla"]),
               "fwd_bwd_linattn_over_fla": paired_ratios(t_b["linattn"], t_b["fla"]),
               "times": {"fwd": t_f, "fwd_bwd": t_b}}
        rows.append(row)
        print(f"{name:>12}: fwd linattn {row['fwd_ms']['linattn']:.3f} ms, fla {row['fwd_ms']['fla']:.3f} ms "
              f"(x{row['fwd_linattn_over_fla']['median']:.2f}); f+b linattn {row['fwd_bwd_ms']['linattn']:.3f} ms, "
              f"fla {row['fwd_bwd_ms']['fla']:.3f} ms (x{row['fwd_bwd_linattn_over_fla']['median']:.2f}); "
              f"outputs differ by {diff:.1e} (relative)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(device), "fla_version": getattr(fla, "__version__", None),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
