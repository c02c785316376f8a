// The gated delta rule token by token, forward and backward, for linattn.kernels.cpu.
//
// Per head, with the state S (Dk rows x Dv columns, row-major) in the L1 cache and a_t the
// gate (1 without gates, one number per head, or one per key channel, i.e. per row of S):
//
//     S' = diag(a_t) S_{t-1},   r_t = v_t - S'^T k_t,   u_t = beta_t r_t,
//     S_t = S' + k_t u_t^T,     o_t = S_t^T q_t
//
// (Schlag, Irie & Schmidhuber, 2021; Yang, Kautz & Hatamizadeh, 2025, eq. 10). Two passes over
// the state per token forward. The forward pass also copies the state at the start of every
// block of C tokens; the backward pass walks the blocks last to first, recomputes each block's
// states from its copy (C states of Dk x Dv: in the L2 cache for C = 64, D = 64) and goes back
// through its tokens with the gradient dS of the state, two passes per token (it keeps S_{t-1} and
// applies a_t where S' is read: a per-row factor of the row's sums, never an extra pass):
//
//     dS += q_t do_t^T,  dq_t = S_t do_t,  du = dS^T k_t,  dk_t = dS u_t - S' (beta_t du)
//     dv_t = beta_t du,  dbeta_t = du . r_t,  dS' = dS - k_t (beta_t du)^T,
//     d log a_t = rows of S' (.) dS' summed along Dv (and over rows for one gate per head),
//     dS_{t-1} = diag(a_t) dS'.
//
// Without the delta correction (retention, GLA: S_t = diag(a_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t;
// Sun et al., 2023, sec. 2.1; Yang, Wang, Shen, Panda & Kim, 2024) the same loops make one pass per
// token forward, and backward one pass to recompute a block's states S_{t-1} and one per token back:
//
//     dS += q_t do_t^T,  dq_t = S_t do_t,  dk_t = dS v_t,  dv_t = dS^T k_t,
//     d a_t = rows of S_{t-1} (.) dS summed along Dv (and over rows for one gate per head),
//     dS_{t-1} = diag(a_t) dS.
//
// GCC/Clang vector extensions along Dv (as wide as the target's registers, cpu_vector.h: 64 bytes
// with AVX-512, 32 with AVX2, 16 elsewhere; Dv is padded to whole vectors by the caller, with zero
// columns that stay zero); no -ffast-math, so NaN and infinity propagate
// as IEEE arithmetic says, and a token reaches only the outputs at and after it.
#include <atomic>
#include <cstdint>
#include <new>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vector.h"

namespace {

// vectors per row of the state at most: Dv <= 256 float32, <= 128 float64, whatever the vector width
constexpr int MAXV = 1024 / linattn_simd::vector_bytes;

using linattn_simd::load;
using linattn_simd::Simd;
using linattn_simd::store;

// The sum of a vector's lanes as a tree of halves (a fixed order; about log2(lanes) adds, where
// a lane-by-lane loop is a chain of `lanes` dependent adds).
template <typename R, int N>
struct Half {
    typedef R type __attribute__((vector_size(N * sizeof(R))));
    static R sum(const type& x) {
        typedef typename Half<R, N / 2>::type H;
        H lo, hi;
        std::memcpy(&lo, &x, sizeof(H));
        std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(H), sizeof(H));
        return Half<R, N / 2>::sum(lo + hi);
    }
};

template <typename R>
struct Half<R, 2> {
    typedef R type __attribute__((vector_size(2 * sizeof(R))));
    static R sum(const type& x) { return x[0] + x[1]; }
};

template <typename R>
inline R hsum(const typename Half<R, linattn_simd::vector_bytes / sizeof(R)>::type& x) {
    return Half<R, linattn_simd::vector_bytes / sizeof(R)>::sum(x);
}

// Work buffers on 64-byte boundaries, like the tensors: a vector that straddles two cache lines costs
// two accesses (std::vector's default allocator gives 16 bytes, and a large block from mmap sits 16
// bytes past a page: every load and store of the backward's states then crossed a line).
template <typename R>
struct Aligned64 {
    using value_type = R;
    Aligned64() = default;
    template <typename U>
    Aligned64(const Aligned64<U>&) {}
    R* allocate(size_t n) { return static_cast<R*>(::operator new(n * sizeof(R), std::align_val_t(64))); }
    void deallocate(R* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
    template <typename U>
    bool operator==(const Aligned64<U>&) const { return true; }
    template <typename U>
    bool operator!=(const Aligned64<U>&) const { return false; }
};

template <typename R>
using Work = std::vector<R, Aligned64<R>>;

template <typename R>
struct DeltaArgs {
    const R *q, *k, *v, *beta, *alpha;   // (BH, T, Dk), (BH, T, Dk), (BH, T, Dv), (BH, T), gates or null
    R *S;                                // (BH, Dk, Dv): the initial state in, the final state out
    R *out, *ck;                         // (BH, T, Dv), (BH, N, Dk, Dv) or null (forward: no copies kept)
    const R *dout;                       // backward: (BH, T, Dv)
    R *dq, *dk, *dv, *dbeta, *dlog;      // backward outputs; S holds dS_final in and dS0 out
    int64_t BH, T, Dk, Dv, C;
    int gate;                            // 0: none, 1: one per head (BH, T), 2: one per key channel (BH, T, Dk)
    bool delta;                          // false: no delta correction (beta, dbeta unused; dlog holds d a)
};

template <typename R>
inline R gate_of(int gate, const R* alpha, int64_t t, int64_t Dk, int64_t i) {
    return gate == 0 ? R(1) : (gate == 1 ? alpha[t] : alpha[t * Dk + i]);
}

// One token forward: r = v - (diag(a) S)^T k, u = beta r (both stored), S <- diag(a) S + k u^T, and
// o = S^T q when o is not null; keep (when not null) gets S_{t-1}. The gate scales S in the second
// pass only: the first pass reads S (r needs k's entries times a) and stores nothing but keep.
// NVT vectors per row (0: nv, known at run time only).
template <typename R, int NVT>
inline void step(int gate, const R* __restrict alpha, int64_t t, int64_t Dk, int64_t nv, const R* __restrict kt,
                 const R* __restrict vt, R b, R* __restrict S, R* __restrict r, R* __restrict u,
                 const R* __restrict qt, R* __restrict o, R* __restrict keep = nullptr) {
    using V = typename Simd<R>::type;
    constexpr int L = Simd<R>::lanes;
    const int64_t NV = NVT > 0 ? NVT : nv, Dv = NV * L;
    V acc[NVT > 0 ? NVT : MAXV], uu[NVT > 0 ? NVT : MAXV];
    for (int64_t j = 0; j < NV; ++j) acc[j] = V{};
    for (int64_t i = 0; i < Dk; ++i) {
        const R kai = kt[i] * gate_of(gate, alpha, t, Dk, i);
        const R* Si = S + i * Dv;
        for (int64_t j = 0; j < NV; ++j) {
            const V s = load<V>(Si + j * L);
            if (keep != nullptr) store(keep + i * Dv + j * L, s);
            acc[j] += kai * s;
        }
    }
    for (int64_t j = 0; j < NV; ++j) {
        const V rj = load<V>(vt + j * L) - acc[j];
        store(r + j * L, rj);
        uu[j] = b * rj;
        store(u + j * L, uu[j]);
        acc[j] = V{};
    }
    for (int64_t i = 0; i < Dk; ++i) {
        const R ai = gate_of(gate, alpha, t, Dk, i), ki = kt[i];
        R* Si = S + i * Dv;
        if (o != nullptr) {
            const R qi = qt[i];
            for (int64_t j = 0; j < NV; ++j) {
                const V s = ai * load<V>(Si + j * L) + ki * uu[j];
                store(Si + j * L, s);
                acc[j] += qi * s;
            }
        } else {
            for (int64_t j = 0; j < NV; ++j) store(Si + j * L, ai * load<V>(Si + j * L) + ki * uu[j]);
        }
    }
    if (o != nullptr)
        for (int64_t j = 0; j < NV; ++j) store(o + j * L, acc[j]);
}

template <typename R, int NVT>
void forward_head(const DeltaArgs<R>& a, int64_t h, R* __restrict S, R* buf) {
    const int64_t T = a.T, Dk = a.Dk, Dv = a.Dv, C = a.C, N = (T + C - 1) / C, nv = Dv / Simd<R>::lanes;
    const R *q = a.q + h * T * Dk, *k = a.k + h * T * Dk, *v = a.v + h * T * Dv, *beta = a.beta + h * T;
    const R* alpha = a.gate == 0 ? nullptr : a.alpha + h * T * (a.gate == 1 ? 1 : Dk);
    R* out = a.out + h * T * Dv;
    R* ck = a.ck == nullptr ? nullptr : a.ck + h * N * Dk * Dv;   // null: no copies (no backward pass to come)
    R *r = buf, *u = r + Dv;
    for (int64_t t = 0; t < T; ++t) {
        if (ck != nullptr && t % C == 0) std::memcpy(ck + (t / C) * Dk * Dv, S, sizeof(R) * Dk * Dv);
        step<R, NVT>(a.gate, alpha, t, Dk, nv, k + t * Dk, v + t * Dv, beta[t], S, r, u, q + t * Dk, out + t * Dv);
    }
}

template <typename R, int NVT, int GATE>
void backward_head(const DeltaArgs<R>& a, int64_t h, R* __restrict dS, R* buf) {
    using V = typename Simd<R>::type;
    constexpr int L = Simd<R>::lanes;
    const int64_t T = a.T, Dk = a.Dk, Dv = a.Dv, C = a.C, N = (T + C - 1) / C, M = Dk * Dv;
    const int64_t NV = NVT > 0 ? NVT : Dv / L;
    const int64_t off_k = h * T * Dk, off_v = h * T * Dv;
    const R *q = a.q + off_k, *k = a.k + off_k, *v = a.v + off_v, *beta = a.beta + h * T, *dout = a.dout + off_v;
    const int64_t gw = GATE == 2 ? Dk : 1;
    const R* alpha = GATE == 0 ? nullptr : a.alpha + h * T * gw;
    const R* ck = a.ck + h * N * M;
    R *dq = a.dq + off_k, *dk = a.dk + off_k, *dv = a.dv + off_v, *dbeta = a.dbeta + h * T;
    R* dlog = GATE == 0 ? nullptr : a.dlog + h * T * gw;
    R *prev = buf, *U = prev + C * M, *Rr = U + C * Dv, *S = Rr + C * Dv, *Pk = S + M;   // Pk: per row, the vector of dS u's partial sums
    V du[NVT > 0 ? NVT : MAXV], e[NVT > 0 ? NVT : MAXV], uu[NVT > 0 ? NVT : MAXV], g[NVT > 0 ? NVT : MAXV];
    for (int64_t n = N - 1; n >= 0; --n) {
        const int64_t t0 = n * C, t1 = t0 + C < T ? t0 + C : T;
        std::memcpy(S, ck + n * M, sizeof(R) * M);
        for (int64_t t = t0; t < t1; ++t) {                       // the block's states, again
            step<R, NVT>(GATE, alpha, t, Dk, NV, k + t * Dk, v + t * Dv, beta[t], S, Rr + (t - t0) * Dv,
                         U + (t - t0) * Dv, static_cast<const R*>(nullptr), static_cast<R*>(nullptr),
                         prev + (t - t0) * M);                    // keeps S_{t-1}
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const R *Sp = prev + (t - t0) * M, *r = Rr + (t - t0) * Dv;   // Sp: S_{t-1}; S' = diag(a_t) Sp
            const R *kt = k + t * Dk, *qt = q + t * Dk;
            const R b = beta[t];
            V ug{};
            for (int64_t j = 0; j < NV; ++j) {
                du[j] = V{};
                uu[j] = load<V>(U + (t - t0) * Dv + j * L);
                g[j] = load<V>(dout + t * Dv + j * L);
                ug += uu[j] * g[j];
            }
            const R u_do = hsum<R>(ug);                           // dq_t,i = a_i (S_{t-1} do)_i + k_i (u . do)
            for (int64_t i = 0; i < Dk; ++i) {                    // dS += q do^T; dq = S_t do; du = dS^T k; dS u
                const R ai = gate_of(GATE, alpha, t, Dk, i), ki = kt[i], qi = qt[i];
                const R* Spi = Sp + i * Dv;
                R* dSi = dS + i * Dv;
                V gq{}, gk{};
                for (int64_t j = 0; j < NV; ++j) {
                    const V d = load<V>(dSi + j * L) + qi * g[j];
                    store(dSi + j * L, d);
                    gq += load<V>(Spi + j * L) * g[j];
                    du[j] += ki * d;
                    gk += d * uu[j];
                }
                dq[t * Dk + i] = ai * hsum<R>(gq) + ki * u_do;
                store(Pk + i * L, gk);                           // summed once, with pass B's part
            }
            V gb{};
            for (int64_t j = 0; j < NV; ++j) {
                e[j] = b * du[j];
                store(dv + t * Dv + j * L, e[j]);
                gb += du[j] * load<V>(r + j * L);
            }
            dbeta[t] = hsum<R>(gb);
            V g_head{};
            for (int64_t i = 0; i < Dk; ++i) {                    // dS' = dS - k e^T; dk; d log a; dS_{t-1}
                const R ai = gate_of(GATE, alpha, t, Dk, i), ki = kt[i];
                const R* Spi = Sp + i * Dv;
                R* dSi = dS + i * Dv;
                V se{}, ga{};                                     // S_{t-1} e and S_{t-1} (.) dS', times a_i after
                for (int64_t j = 0; j < NV; ++j) {
                    const V s = load<V>(Spi + j * L);
                    const V d = load<V>(dSi + j * L) - ki * e[j];
                    se += s * e[j];
                    if (GATE != 0) ga += s * d;
                    store(dSi + j * L, ai * d);
                }
                dk[t * Dk + i] = hsum<R>(load<V>(Pk + i * L) - ai * se);
                if (GATE == 2) dlog[t * Dk + i] = ai * hsum<R>(ga);
                if (GATE == 1) g_head += ga;
            }
            if (GATE == 1) dlog[t] = gate_of(GATE, alpha, t, Dk, 0) * hsum<R>(g_head);
        }
    }
}

// One token without the delta correction: keep <- S_{t-1} (when keep is not null), S <- diag(a) S + k v^T,
// o = S^T q (when o is not null): one pass over the state.
template <typename R, int NVT>
inline void decay_step(int gate, const R* __restrict alpha, int64_t t, int64_t Dk, int64_t nv, const R* __restrict kt,
                       const R* __restrict vt, R* __restrict S, const R* __restrict qt, R* __restrict o,
                       R* __restrict keep = nullptr) {
    using V = typename Simd<R>::type;
    constexpr int L = Simd<R>::lanes;
    const int64_t NV = NVT > 0 ? NVT : nv, Dv = NV * L;
    V acc[NVT > 0 ? NVT : MAXV], vv[NVT > 0 ? NVT : MAXV];
    for (int64_t j = 0; j < NV; ++j) {
        acc[j] = V{};
        vv[j] = load<V>(vt + j * L);
    }
    for (int64_t i = 0; i < Dk; ++i) {
        const R ai = gate_of(gate, alpha, t, Dk, i), ki = kt[i], qi = o != nullptr ? qt[i] : R(0);
        R* Si = S + i * Dv;
        for (int64_t j = 0; j < NV; ++j) {
            const V s0 = load<V>(Si + j * L);
            if (keep != nullptr) store(keep + i * Dv + j * L, s0);
            const V s = ai * s0 + ki * vv[j];
            store(Si + j * L, s);
            if (o != nullptr) acc[j] += qi * s;
        }
    }
    if (o != nullptr)
        for (int64_t j = 0; j < NV; ++j) store(o + j * L, acc[j]);
}

template <typename R, int NVT>
void decay_forward_head(const DeltaArgs<R>& a, int64_t h, R* __restrict S) {
    const int64_t T = a.T, Dk = a.Dk, Dv = a.Dv, C = a.C, N = (T + C - 1) / C, nv = Dv / Simd<R>::lanes;
    const R *q = a.q + h * T * Dk, *k = a.k + h * T * Dk, *v = a.v + h * T * Dv;
    const R* alpha = a.gate == 0 ? nullptr : a.alpha + h * T * (a.gate == 1 ? 1 : Dk);
    R* out = a.out + h * T * Dv;
    R* ck = a.ck == nullptr ? nullptr : a.ck + h * N * Dk * Dv;   // null: no copies (no backward pass to come)
    for (int64_t t = 0; t < T; ++t) {
        if (ck != nullptr && t % C == 0) std::memcpy(ck + (t / C) * Dk * Dv, S, sizeof(R) * Dk * Dv);
        decay_step<R, NVT>(a.gate, alpha, t, Dk, nv, k + t * Dk, v + t * Dv, S, q + t * Dk, out + t * Dv);
    }
}

// The backward pass without the delta correction; dbeta holds d a_t (the gradient of the gate itself:
// (BH, T) for one gate per head, (BH, T, Dk) per key channel).
template <typename R, int NVT, int GATE>
void decay_backward_head(const DeltaArgs<R>& a, int64_t h, R* __restrict dS, R* buf) {
    using V = typename Simd<R>::type;
    constexpr int L = Simd<R>::lanes;
    const int64_t T = a.T, Dk = a.Dk, Dv = a.Dv, C = a.C, N = (T + C - 1) / C, M = Dk * Dv;
    const int64_t NV = NVT > 0 ? NVT : Dv / L;
    const int64_t off_k = h * T * Dk, off_v = h * T * Dv;
    const R *q = a.q + off_k, *k = a.k + off_k, *v = a.v + off_v, *dout = a.dout + off_v;
    const int64_t gw = GATE == 2 ? Dk : 1;
    const R* alpha = GATE == 0 ? nullptr : a.alpha + h * T * gw;
    const R* ck = a.ck + h * N * M;
    R *dq = a.dq + off_k, *dk = a.dk + off_k, *dv = a.dv + off_v;
    R* dgate = GATE == 0 ? nullptr : a.dlog + h * T * gw;
    R *prev = buf, *S = prev + C * M;
    V g[NVT > 0 ? NVT : MAXV], vv[NVT > 0 ? NVT : MAXV], e[NVT > 0 ? NVT : MAXV];
    for (int64_t n = N - 1; n >= 0; --n) {
        const int64_t t0 = n * C, t1 = t0 + C < T ? t0 + C : T;
        std::memcpy(S, ck + n * M, sizeof(R) * M);
        for (int64_t t = t0; t < t1; ++t)                         // the block's states, again: keeps S_{t-1}
            decay_step<R, NVT>(GATE, alpha, t, Dk, NV, k + t * Dk, v + t * Dv, S, static_cast<const R*>(nullptr),
                               static_cast<R*>(nullptr), prev + (t - t0) * M);
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const R *Sp = prev + (t - t0) * M, *kt = k + t * Dk, *qt = q + t * Dk;
            V vg{};
            for (int64_t j = 0; j < NV; ++j) {
                g[j] = load<V>(dout + t * Dv + j * L);
                vv[j] = load<V>(v + t * Dv + j * L);
                e[j] = V{};
                vg += vv[j] * g[j];
            }
            const R v_do = hsum<R>(vg);                           // dq_t,i = a_i (S_{t-1} do)_i + k_i (v . do)
            V g_head{};
            for (int64_t i = 0; i < Dk; ++i) {                    // dS += q do^T; dq; dk; dv; d a; dS_{t-1}
                const R ai = gate_of(GATE, alpha, t, Dk, i), ki = kt[i], qi = qt[i];
                const R* Spi = Sp + i * Dv;
                R* dSi = dS + i * Dv;
                V gq{}, gk{}, ga{};
                for (int64_t j = 0; j < NV; ++j) {
                    const V d = load<V>(dSi + j * L) + qi * g[j];
                    const V s0 = load<V>(Spi + j * L);
                    gq += s0 * g[j];
                    e[j] += ki * d;
                    gk += d * vv[j];
                    if (GATE != 0) ga += s0 * d;
                    store(dSi + j * L, ai * d);
                }
                dq[t * Dk + i] = ai * hsum<R>(gq) + ki * v_do;
                dk[t * Dk + i] = hsum<R>(gk);
                if (GATE == 2) dgate[t * Dk + i] = hsum<R>(ga);
                if (GATE == 1) g_head += ga;
            }
            for (int64_t j = 0; j < NV; ++j) store(dv + t * Dv + j * L, e[j]);
            if (GATE == 1) dgate[t] = hsum<R>(g_head);
        }
    }
}

// One head, its state (forward) or the gradient of its state (backward) held in the thread's own buffer
// meanwhile: the heads' states lie next to each other in the caller's tensor, and two cores sweeping
// neighbouring 16 KB blocks many times per token slowed each other by half (measured on a 2-core
// Xeon); the inputs and outputs are each read or written once per token and stay where they are.
template <typename R, int NVT>
void one_head(const DeltaArgs<R>& a, bool backward, int64_t h, Work<R>& work) {
    const int64_t M = a.Dk * a.Dv;
    R *own = work.data(), *buf = own + M;
    std::memcpy(own, a.S + h * M, sizeof(R) * M);
    if (!a.delta) {
        if (!backward) decay_forward_head<R, NVT>(a, h, own);
        else if (a.gate == 0) decay_backward_head<R, NVT, 0>(a, h, own, buf);
        else if (a.gate == 1) decay_backward_head<R, NVT, 1>(a, h, own, buf);
        else decay_backward_head<R, NVT, 2>(a, h, own, buf);
    } else if (!backward) forward_head<R, NVT>(a, h, own, buf);
    else if (a.gate == 0) backward_head<R, NVT, 0>(a, h, own, buf);
    else if (a.gate == 1) backward_head<R, NVT, 1>(a, h, own, buf);
    else backward_head<R, NVT, 2>(a, h, own, buf);
    std::memcpy(a.S + h * M, own, sizeof(R) * M);
}

template <typename R>
int run_heads(const DeltaArgs<R>& a, bool backward, int n_threads) {
    constexpr int L = Simd<R>::lanes;
    if (a.BH < 0 || a.T < 0 || a.Dk < 1 || a.Dv < 1 || a.C < 1 || a.gate < 0 || a.gate > 2) return 1;
    if (a.Dv % L != 0 || a.Dv / L > MAXV) return 2;          // the caller pads Dv to whole vectors
    if (a.BH == 0 || a.T == 0) return 0;
    const int64_t M = a.Dk * a.Dv;
    const size_t need = size_t(M) + (!backward ? size_t(2 * a.Dv)
                                     : a.delta ? size_t(a.C * M + 2 * a.C * a.Dv + M + a.Dk * L) : size_t(a.C * M + M));
    const int64_t nv = a.Dv / L;
    int64_t workers = n_threads < 1 ? 1 : n_threads;
    if (workers > a.BH) workers = a.BH;
    std::atomic<bool> failed{false};
    auto body = [&](int64_t first) {
        Work<R> work;
        try {
            work.resize(need);
        } catch (const std::bad_alloc&) {                     // no exception may leave a thread
            failed = true;
            return;
        }
        for (int64_t h = first; h < a.BH; h += workers) {
            switch (nv) {                                     // the usual widths unrolled
                case 1: one_head<R, 1>(a, backward, h, work); break;
                case 2: one_head<R, 2>(a, backward, h, work); break;
                case 4: one_head<R, 4>(a, backward, h, work); break;
                case 8: one_head<R, 8>(a, backward, h, work); break;
                default: one_head<R, 0>(a, backward, h, work);
            }
        }
    };
    const bool started = linattn_parallel::run_workers(workers, body);
    return failed || !started ? 3 : 0;
}

template <typename R>
int delta_forward(const R* q, const R* k, const R* v, const R* beta, const R* alpha, R* S, R* out, R* ck,
                  int64_t BH, int64_t T, int64_t Dk, int64_t Dv, int64_t C, int gate, int n_threads, bool delta) {
    DeltaArgs<R> a{q, k, v, beta, alpha, S, out, ck, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                   BH, T, Dk, Dv, C, gate, delta};
    return run_heads(a, false, n_threads);
}

template <typename R>
int delta_backward(const R* q, const R* k, const R* v, const R* beta, const R* alpha, const R* ck,
                   const R* dout, R* dS, R* dq, R* dk, R* dv, R* dbeta, R* dlog, int64_t BH, int64_t T,
                   int64_t Dk, int64_t Dv, int64_t C, int gate, int n_threads, bool delta) {
    DeltaArgs<R> a{q, k, v, beta, alpha, dS, nullptr, const_cast<R*>(ck), dout, dq, dk, dv, dbeta, dlog,
                   BH, T, Dk, Dv, C, gate, delta};
    return run_heads(a, true, n_threads);
}

}  // namespace

extern "C" {

#define LINATTN_DELTA(SUFFIX, R)                                                                              \
    int linattn_delta_forward_##SUFFIX(const R* q, const R* k, const R* v, const R* beta, const R* alpha,     \
                                       R* S, R* out, R* ck, int64_t BH, int64_t T, int64_t Dk, int64_t Dv,    \
                                       int64_t C, int gate, int n_threads) {                                  \
        return delta_forward<R>(q, k, v, beta, alpha, S, out, ck, BH, T, Dk, Dv, C, gate, n_threads, true);  \
    }                                                                                                         \
    int linattn_delta_backward_##SUFFIX(const R* q, const R* k, const R* v, const R* beta, const R* alpha,    \
                                        const R* ck, const R* dout, R* dS, R* dq, R* dk, R* dv, R* dbeta,     \
                                        R* dlog, int64_t BH, int64_t T, int64_t Dk, int64_t Dv, int64_t C,    \
                                        int gate, int n_threads) {                                            \
        return delta_backward<R>(q, k, v, beta, alpha, ck, dout, dS, dq, dk, dv, dbeta, dlog, BH, T, Dk, Dv,  \
                                 C, gate, n_threads, true);                                                   \
    }                                                                                                         \
    /* without the delta correction (retention, GLA): dalpha is the gradient of the gate a itself */          \
    int linattn_decay_forward_##SUFFIX(const R* q, const R* k, const R* v, const R* alpha, R* S, R* out,      \
                                       R* ck, int64_t BH, int64_t T, int64_t Dk, int64_t Dv, int64_t C,       \
                                       int gate, int n_threads) {                                             \
        return delta_forward<R>(q, k, v, nullptr, alpha, S, out, ck, BH, T, Dk, Dv, C, gate, n_threads,       \
                                false);                                                                       \
    }                                                                                                         \
    int linattn_decay_backward_##SUFFIX(const R* q, const R* k, const R* v, const R* alpha, const R* ck,      \
                                        const R* dout, R* dS, R* dq, R* dk, R* dv, R* dalpha, int64_t BH,     \
                                        int64_t T, int64_t Dk, int64_t Dv, int64_t C, int gate,               \
                                        int n_threads) {                                                      \
        return delta_backward<R>(q, k, v, nullptr, alpha, ck, dout, dS, dq, dk, dv, nullptr, dalpha, BH, T,   \
                                 Dk, Dv, C, gate, n_threads, false);                                          \
    }

LINATTN_DELTA(f32, float)
LINATTN_DELTA(f64, double)

}  // extern "C"
