"""linattn's causal linear attention against fast-transformers' published CPU kernel, side by side.

The measurement behind appendix A, §A.1 (``chapters/results/ft_side_by_side.json``). The peer is
``fast_transformers/causal_product/causal_product_cpu.cpp`` from a checkout of
idiap/fast-transformers that you provide: its code is not linattn's and is not shipped here. This
script builds that one file with ``torch.utils.cpp_extension.load`` (fast-transformers' PyPI
package does not build without CUDA), wraps it as its own ``CausalDotProduct`` does (forward and
backward), adds elu+1 and its ``CausalLinearAttention``'s cumsum normaliser, checks the result
against the float64 quadratic form, and times it with :func:`linattn.bench.run_benchmark` as a
peer of ``baseline_chunk``, ``compiled_baseline``, ``chunk`` and ``chunk_cpu`` (causal,
normalised, elu+1, float32, B=1, H=8, D=Dv=64), interleaved round by round::

    git clone https://github.com/idiap/fast-transformers /tmp/fast-transformers
    python scripts/ft_side_by_side.py --ft-source /tmp/fast-transformers \\
        --threads 1 2 --seq-lens 1024 4096 16384 65536 --repeats 11 --out ft_side_by_side.json

``--ft-source`` is a checkout (a folder holding the file) or a bare git repository. The peer is
built with ``-march=native`` by default, as ``chunk_cpu`` is, so that the two loops differ in
their algorithm, not in the vector instructions the compiler may use (``--peer-flags`` to change
it). Needs a C++ compiler with OpenMP. The results file records the peer's commit, compiler and
flags, ``chunk_cpu``'s build, the machine, its load before and after, linattn's commit and the
seed of the inputs (``--seed``, default 0).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import linattn
from linattn import bench
from linattn.kernels import cpu

PEER_FILE = "fast_transformers/causal_product/causal_product_cpu.cpp"
PEER_FLAGS = ["-O3", "-fopenmp", "-ffast-math", "-march=native"]
METHODS = ["baseline_chunk", "compiled_baseline", "chunk", "chunk_cpu"]
EPS = 1e-6


def _git(source: pathlib.Path, *args: str) -> str:
    """``git`` in a checkout (``-C``) or a bare repository (``--git-dir``)."""
    where = ["-C", str(source)] if (source / ".git").exists() else ["--git-dir", str(source)]
    return subprocess.run(["git", *where, *args], capture_output=True, text=True, check=True).stdout


def peer_source(source: pathlib.Path) -> tuple[str, str]:
    """The peer's C++ text and its commit (``"unknown"`` outside git), from a checkout or a bare repo."""
    if not source.exists():
        raise FileNotFoundError(f"--ft-source {source} does not exist; clone idiap/fast-transformers there")
    path = source / PEER_FILE
    try:
        commit = _git(source, "rev-parse", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    if path.is_file():
        return path.read_text(), commit
    try:
        return _git(source, "show", f"HEAD:{PEER_FILE}"), commit
    except (OSError, subprocess.CalledProcessError):
        raise FileNotFoundError(f"--ft-source {source} holds no {PEER_FILE}") from None


def build_peer(text: str, flags: list[str], build_dir: pathlib.Path):
    """Compile the peer's file into an extension module (``causal_dot_product``, ``causal_dot_backward``)."""
    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    src = build_dir / "causal_product_cpu.cpp"
    src.write_text(text)
    return load("ft_causal_product_cpu", [str(src)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir), verbose=False)


def make_peer(module):
    """fast-transformers' causal linear attention on (B, H, T, D) tensors, as its modules compute it."""

    class CausalDotProduct(torch.autograd.Function):
        # What fast_transformers.causal_product.CausalDotProduct does on the CPU.
        @staticmethod
        def forward(ctx, Q, K, V):
            ctx.save_for_backward(Q, K, V)
            out = torch.zeros((*Q.shape[:3], V.shape[-1]), dtype=Q.dtype)
            module.causal_dot_product(Q.data, K.data, V.data, out)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            Q, K, V = ctx.saved_tensors
            gQ, gK, gV = torch.zeros_like(Q), torch.zeros_like(K), torch.zeros_like(V)
            module.causal_dot_backward(Q.data, K.data, V.data, grad_out.contiguous(), gQ, gK, gV)
            return gQ, gK, gV

    def fast_transformers(q, k, v):
        # Its CausalLinearAttention: elu+1 features, the causal product, 1 / (φ(q)·cumsum φ(k) + eps).
        # The inputs are passed in (B, H, T, D) layout, without the permutes its module makes from
        # (B, T, H, D): that favours the peer.
        Q, K = F.elu(q) + 1, F.elu(k) + 1
        Z = 1 / (torch.einsum("nhli,nhli->nhl", Q, K.cumsum(2)) + EPS)
        return CausalDotProduct.apply(Q, K, v) * Z[..., None]

    return fast_transformers


def check_peer(peer) -> float:
    """Largest |peer − float64 quadratic form| on a small causal problem (T=300)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    ref = linattn.linear_attention(q.double(), k.double(), v.double(), causal=True, method="quadratic")
    return (peer(q, k, v).double() - ref).abs().max().item()


def host_isa() -> dict:
    """The host's vector instruction sets (from /proc/cpuinfo's flags; empty where there is none)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith(("flags", "Features"))), [])
    wanted = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "avx", "sse4_2", "asimd", "sve")
    return {"vector_flags": [f for f in wanted if f in flags],
            "widest": next((w for f, w in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"),
                                           ("sve", "SVE"), ("asimd", "NEON")) if f in flags), "SSE or none")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ft-source", type=pathlib.Path, required=True,
                   help="a checkout (or bare git repository) of idiap/fast-transformers")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--seed", type=int, default=0, help="seed of the benchmark's inputs (q, k, v, the upstream gradient)")
    p.add_argument("--peer-flags", nargs="+", default=PEER_FLAGS,
                   help="compiler flags of the peer (one quoted string works too: --peer-flags='-O3 -march=haswell')")
    p.add_argument("--build-dir", type=pathlib.Path, default=None, help="default: a temporary folder")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the results file (JSON)")
    a = p.parse_args(argv)
    if os.environ.get("LINATTN_CPU_KERNEL", "0").strip() != "0":
        print("LINATTN_CPU_KERNEL ignored: chunk times the PyTorch chunk form, chunk_cpu the compiled loop",
              file=sys.stderr)
    os.environ["LINATTN_CPU_KERNEL"] = "0"      # chunk: the PyTorch chunk form (the default runs chunk_cpu's loop)
    a.peer_flags = [flag for flags in a.peer_flags for flag in flags.split()]
    if min(a.threads) < 1 or min(a.seq_lens) < 1 or a.repeats < 1:
        p.error("--threads, --seq-lens and --repeats take positive integers")
    if not 0 <= a.seed < 2 ** 63:
        p.error(f"--seed must be in [0, 2**63), got {a.seed}")
    if not cpu.cpu_kernel_available():
        p.error(f"chunk_cpu is not available here ({cpu.build_info().get('error')})")
    text, commit = peer_source(a.ft_source)
    build_dir = a.build_dir or pathlib.Path(tempfile.mkdtemp(prefix="ft_causal_product_"))
    peer = make_peer(build_peer(text, a.peer_flags, build_dir))
    err = check_peer(peer)
    if not err < 1e-4:
        raise SystemExit(f"the peer disagrees with the float64 quadratic form by {err:.3g}; not timing it")
    compiler = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True,
                              text=True).stdout.splitlines()[:1]
    machine = bench.machine_info(torch.device("cpu"))          # before the run: the code that runs
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    load_before, t0, rows = list(os.getloadavg()), time.time(), []
    for n in a.threads:
        for T in a.seq_lens:
            rows += bench.run_benchmark(METHODS, [T], device="cpu", batch=1, heads=8, head_dim=64,
                                        repeats=a.repeats, threads=n, seed=a.seed,
                                        peers={"fast_transformers": peer})
            print(f"{n} thread(s), T={T}: done after {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    doc = {
        "study": "ft_side_by_side",
        "description": ("linattn (chunk: PyTorch chunk form; chunk_cpu: the compiled CPU kernel) against "
                        "fast-transformers' published CPU causal product and torch.compile of the plain baseline; "
                        "causal, normalised, elu+1, float32, B=1, H=8, D=Dv=64"),
        "command": ((f"LINATTN_CPU_MARCH={os.environ['LINATTN_CPU_MARCH']} " if os.environ.get("LINATTN_CPU_MARCH")
                     else "") + "python scripts/ft_side_by_side.py --ft-source PATH/TO/fast-transformers --threads "
                    f"{' '.join(map(str, a.threads))} --seq-lens {' '.join(map(str, a.seq_lens))} "
                    f"--repeats {a.repeats} --seed {a.seed} --peer-flags {' '.join(a.peer_flags)} --out FILE"),
        "host_isa": host_isa(),
        "seeds": {"inputs": a.seed, "peer_check": 0},
        "peer": {"repository": "idiap/fast-transformers", "commit": commit, "file": PEER_FILE,
                 "compiler": compiler[0] if compiler else "unknown", "cflags": a.peer_flags,
                 "ldflags": ["-fopenmp"], "build": "torch.utils.cpp_extension.load",
                 "layout": "(B, H, T, D) passed directly (its causal_linear permutes from (B, T, H, D))",
                 "normaliser": "1 / (einsum(Q, K.cumsum) + eps), as its CausalLinearAttention",
                 "feature_map": "F.elu(x) + 1, as its elu_feature_map",
                 "check": f"max |peer - float64 quadratic| = {err:.1e} at T=300"},
        "chunk_cpu_build": {k: v for k, v in cpu.build_info().items() if k != "path"},
        "provenance": {"linattn_commit": machine["commit"], "machine": machine, "started": started,
                       "elapsed_s": round(time.time() - t0, 1), "load_average_before": load_before,
                       "load_average_after": list(os.getloadavg())},
        "rows": rows,
    }
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
