"""``python -m linattn.bench --decode``: the cost of one decoding step against the bare update."""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import linear_attention, linear_attention_step
from ..backends import use_backends
from ..layers import LinearMixer
from .timing import paired_ratios

__all__ = ["bare_linear_attention_step", "bare_mixer_step", "run_decode_benchmark", "format_decode_table"]

SUBJECTS = ("linear_attention_step", "compiled_step", "LinearMixer")


def bare_linear_attention_step(q: Tensor, k: Tensor, v: Tensor, S: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One step of normalised causal linear attention with elu+1 features as chapter 4 writes it by hand
    (``F.elu(x) + 1``, ``S + φ(k)vᵀ``), no checks: ``(out, S, z)``.

    ``q``, ``k`` ``(B, H, D)``, ``v`` ``(B, H, Dv)``, ``S`` ``(B, H, D, Dv)``, ``z`` ``(B, H, D)``.
    """
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1                             # (B, H, D)
    S = S + phi_k[..., :, None] * v[..., None, :]                         # (B, H, D, Dv)
    z = z + phi_k
    return (phi_q[..., None, :] @ S)[..., 0, :] / (phi_q * z).sum(-1, keepdim=True), S, z


def bare_mixer_step(m: LinearMixer, x: Tensor, S: Tensor, conv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One token through ``LinearMixer(rule="gated_delta")`` with its default options, no checks."""
    B, H, D = x.shape[0], m.n_heads, m.head_dim
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)                  # (B, 1, C)
    ext = torch.cat([conv, qkv.transpose(1, 2)], dim=2)                              # (B, C, K)
    w = m.conv.weight[:, 0]                                                          # (C, K)
    u = ext[:, :, 0] * w[:, 0]                                                       # the depthwise conv of
    for j in range(1, w.shape[1]):                                                   # one token: K multiply-adds
        u = u + ext[:, :, j] * w[:, j]
    q, k, v = (t.view(B, H, D) for t in F.silu(u).split(H * D, dim=-1))              # (B, H, D) each
    q = F.normalize(q, dim=-1, eps=1e-6) * D ** -0.5
    k = F.normalize(k, dim=-1, eps=1e-6)
    alpha = torch.exp(-m.A_log.exp() * F.softplus(m.a_proj(x)[:, 0] + m.dt_bias))     # (B, H)
    beta = torch.sigmoid(m.b_proj(x)[:, 0])                                          # (B, H)
    S = alpha[..., None, None] * S                                                   # (B, H, D, D)
    u = beta[..., None] * (v - (k.unsqueeze(-2) @ S).squeeze(-2))                    # (B, H, D)
    S = torch.addcmul(S, k.unsqueeze(-1), u.unsqueeze(-2))
    o = (q.unsqueeze(-2) @ S).squeeze(-2)                                            # (B, H, D)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.o_norm
    o = o * F.silu(m.g_proj(x)[:, 0].view(B, H, D))
    return m.out_proj(o.reshape(B, 1, H * D)), S, ext[:, :, 1:]


def _pairs(batch: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> dict:
    """For each subject: (the library's call, the bare call), on the same inputs."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, head_dim, generator=g, dtype=dtype) for _ in range(3))
    state = linear_attention_step(q, k, v)[1]
    torch.manual_seed(seed)
    mixer = LinearMixer(heads * head_dim, heads).to(dtype)
    x = torch.randn(batch, 1, heads * head_dim, generator=g, dtype=dtype)
    mixer_state = mixer(torch.randn(batch, 4, heads * head_dim, generator=g, dtype=dtype), return_state=True)[1]
    def compiled_step():
        with use_backends("cpu"):
            return linear_attention(q[:, :, None], k[:, :, None], v[:, :, None], causal=True, initial_state=state,
                                    return_state=True)

    return {
        "compiled_step": (compiled_step, lambda: bare_linear_attention_step(q, k, v, state.S, state.z)),
        "linear_attention_step": (lambda: linear_attention_step(q, k, v, state),
                                  lambda: bare_linear_attention_step(q, k, v, state.S, state.z)),
        "LinearMixer": (lambda: mixer(x, state=mixer_state, return_state=True),
                        lambda: bare_mixer_step(mixer, x, mixer_state.S, mixer_state.conv)),
    }


def _clock():
    """CPU time of the calling thread with one torch thread (time preempted by other processes on a shared
    machine is not counted), else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _round(fn, bare, calls: int) -> tuple[float, float]:
    """Seconds per call of ``fn`` and of ``bare`` over one round, the two calls alternating (so that
    both see the same state of the machine)."""
    spent, spent_bare, clock = 0.0, 0.0, _clock()
    for _ in range(calls):
        t0 = clock()
        fn()
        t1 = clock()
        bare()
        spent, spent_bare = spent + (t1 - t0), spent_bare + (clock() - t1)
    return spent / calls, spent_bare / calls


def run_decode_benchmark(*, batch: int = 1, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
                         repeats: int = 21, calls: Optional[dict] = None, warmup: int = 20, seed: int = 0,
                         subjects: Sequence[str] = SUBJECTS) -> list[dict]:
    """Time each subject and its bare update, interleaved, under ``torch.no_grad()`` on the CPU: ``linear_attention_step``,
    ``compiled_step`` (``linear_attention`` on T = 1 from the state under ``use_backends("cpu")``; a row with a
    ``status`` saying why where it cannot run) and ``LinearMixer``. Raises ValueError for an unknown subject."""
    from ..kernels.cpu import build_info, cpu_kernel_available

    for name in subjects:
        if name not in SUBJECTS:
            raise ValueError(f"unknown decode subject {name!r}; expected one of {SUBJECTS}")
    calls = {"linear_attention_step": 200, "compiled_step": 200, "LinearMixer": 20, **(calls or {})}
    rows = []
    with torch.no_grad():
        pairs = _pairs(batch, heads, head_dim, dtype, seed)
        for name in subjects:
            if name == "compiled_step" and not (cpu_kernel_available() and dtype in (torch.float32, torch.float64)):
                why = (f"{dtype} is not float32/float64" if cpu_kernel_available()
                       else f"the CPU kernel is not available ({build_info().get('error')})")
                rows.append({"subject": name, "status": f"skipped: {why}"})
                continue
            fn, bare = pairs[name]
            for _ in range(warmup):
                fn(), bare()
            times, bare_times = [], []
            for _ in range(repeats):
                t, t_bare = _round(fn, bare, calls[name])
                times.append(t)
                bare_times.append(t_bare)
            rows.append({"subject": name, "status": "ok", "batch": batch, "heads": heads, "head_dim": head_dim,
                         "clock": "thread CPU time" if _clock() is time.thread_time else "wall time",
                         "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
                         "times": times, "bare_times": bare_times, "median_s": sorted(times)[len(times) // 2],
                         "bare_median_s": sorted(bare_times)[len(bare_times) // 2],
                         "ratio": paired_ratios(times, bare_times)})
    return rows


def format_decode_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`run_decode_benchmark` as a table: µs per call and the ratio's median [min, max]."""
    skipped = [r for r in rows if r.get("status", "ok") != "ok"]
    rows = [r for r in rows if r.get("status", "ok") == "ok"]
    if not rows:
        return "\n".join(f"{r['subject']}: {r['status']}" for r in skipped)
    first = rows[0]
    lines = [f"decode step, B={first['batch']} H={first['heads']} D={first['head_dim']} {first['dtype']}, no grad, "
             f"{first['threads']} thread(s), {len(first['times'])} rounds, {first.get('clock', 'wall time')}",
             f"{'':<23}{'step (µs)':>11}{'bare (µs)':>11}   step / bare: median [min, max]"]
    for r in rows:
        ratio = r["ratio"]
        lines.append(f"{r['subject']:<23}{1e6 * r['median_s']:>11.1f}{1e6 * r['bare_median_s']:>11.1f}   "
                     f"{ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]")
    by = {r["subject"]: r for r in rows}
    if {"compiled_step", "linear_attention_step"} <= by.keys():
        lines.append(f"compiled_step / linear_attention_step, their median times (separate rounds): "
                     f"{by['compiled_step']['median_s'] / by['linear_attention_step']['median_s']:.2f}")
    lines += [f"{r['subject']}: {r['status']}" for r in skipped]
    return "\n".join(lines)
