// Causal linear attention on the CPU: the recurrence with its state held in vector registers.
//
// One pass computes, for every head and token t (or, in reverse, with s >= t),
//
//     out_t = a_tᵀ X_t,      X_t = X_init + Σ_{s <= t} b_s c_sᵀ      (X: Da × Dc)
//
// and leaves the final X in the state buffer. The forward pass of normalised linear attention is
// one such pass (a, b, c = φ(q), φ(k), v) plus the normaliser d_t = a_tᵀ z_t, z_t = z_init + Σ b_s;
// each of the three gradients is another pass (see linattn/kernels/cpu.py).
//
// Loops: tokens in blocks of C (the chunk length); in a block, the state is cut into tiles of
// R rows × NV vectors that stay in registers while the block's tokens stream through them. The
// state is summed in two levels, as in the chunkwise form: a tile accumulates the block's terms
// from zero and is added to the state before the block only once the block ends, so a state
// entry is a sum of at most C terms plus one term per block (not of T terms in a row).
//
// Plain C++ with GCC/Clang vector extensions as wide as the target's registers (cpu_vector.h: 64
// bytes with AVX-512, 32 with AVX2, 16 elsewhere); no -ffast-math, so NaN and
// infinity propagate as IEEE says, and a token never reaches an output before it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <pthread.h>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vector.h"

namespace {

using linattn_simd::load;
using linattn_simd::Simd;
using linattn_simd::store;

// A tile of ROWS × NVEC vectors holds 2·ROWS·NVEC registers (the block's running sums and the state
// before it) plus NVEC of c_t and NVEC of the output: 20 of AVX-512's or NEON's 32 registers, 12 of
// AVX2's or SSE2's 16.
constexpr int ROWS = linattn_simd::vector_registers >= 32 ? 4 : 2;
constexpr int NVEC = 2;

// One tile: rows i0..i0+R of the state, columns j0..j0+NV*lanes, over n tokens of one block.
// a, b point at (first token of the block, i0); c, out at (first token, j0); X at (i0, j0).
template <typename T, int R, int NV, bool REV>
inline void tile(const T* __restrict a, const T* __restrict b, const T* __restrict c, T* __restrict out,
                 int64_t n, int64_t Da, int64_t Dc, T* __restrict X, bool first) {
    using V = typename Simd<T>::type;
    constexpr int L = Simd<T>::lanes;
    V S[R][NV], acc[R][NV];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NV; ++u) {
            S[r][u] = load<V>(X + r * Dc + u * L);
            acc[r][u] = V{} ;
        }
    for (int64_t s = 0; s < n; ++s) {
        const int64_t t = REV ? n - 1 - s : s;
        const T* at = a + t * Da;
        const T* bt = b + t * Da;
        const T* ct = c + t * Dc;
        T* ot = out + t * Dc;
        V cv[NV], o[NV];
        for (int u = 0; u < NV; ++u) cv[u] = load<V>(ct + u * L);
        for (int r = 0; r < R; ++r) {
            const T br = bt[r];
            for (int u = 0; u < NV; ++u) acc[r][u] += br * cv[u];
        }
        for (int u = 0; u < NV; ++u) o[u] = first ? V{} : load<V>(ot + u * L);
        for (int r = 0; r < R; ++r) {
            const T ar = at[r];
            for (int u = 0; u < NV; ++u) o[u] += ar * (S[r][u] + acc[r][u]);
        }
        for (int u = 0; u < NV; ++u) store(ot + u * L, o[u]);
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NV; ++u) store(X + r * Dc + u * L, S[r][u] + acc[r][u]);
}

// All tiles of one block of n tokens (Dc is a multiple of the vector length). With ea, eb
// (one number per token) the state has one more row Xe: out_t += ea_t · (Xe + Σ eb_s c_s).
template <typename T, bool REV>
void block(const T* a, const T* b, const T* c, T* out, int64_t n, int64_t Da, int64_t Dc, T* X,
           const T* ea, const T* eb, T* Xe) {
    constexpr int L = Simd<T>::lanes;
    int64_t j0 = 0;
    for (; j0 + NVEC * L <= Dc; j0 += NVEC * L) {
        int64_t i0 = 0;
        for (; i0 + ROWS <= Da; i0 += ROWS)
            tile<T, ROWS, NVEC, REV>(a + i0, b + i0, c + j0, out + j0, n, Da, Dc, X + i0 * Dc + j0, i0 == 0);
        for (; i0 < Da; ++i0)
            tile<T, 1, NVEC, REV>(a + i0, b + i0, c + j0, out + j0, n, Da, Dc, X + i0 * Dc + j0, i0 == 0);
        if (Xe != nullptr)
            tile<T, 1, NVEC, REV>(ea, eb, c + j0, out + j0, n, 1, Dc, Xe + j0, Da == 0);
    }
    for (; j0 < Dc; j0 += L) {
        int64_t i0 = 0;
        for (; i0 + ROWS <= Da; i0 += ROWS)
            tile<T, ROWS, 1, REV>(a + i0, b + i0, c + j0, out + j0, n, Da, Dc, X + i0 * Dc + j0, i0 == 0);
        for (; i0 < Da; ++i0)
            tile<T, 1, 1, REV>(a + i0, b + i0, c + j0, out + j0, n, Da, Dc, X + i0 * Dc + j0, i0 == 0);
        if (Xe != nullptr)
            tile<T, 1, 1, REV>(ea, eb, c + j0, out + j0, n, 1, Dc, Xe + j0, Da == 0);
    }
}

// The sum of L per-lane partial sums in a fixed tree (so a result never depends on the threads).
template <typename T, int L>
inline T lane_sum(T (&part)[L]) {
    for (int width = L / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) part[l] += part[l + width];
    return part[0];
}

// The normaliser of one block: z += b_t, d_t = a_tᵀ z (two-level sums as the state), then
// out_t /= d_t where d_t > 0 and finite, else out_t /= eps (linattn._numerics.guarded_normaliser).
template <typename T>
void normalise_block(const T* a, const T* b, T* out, int64_t n, int64_t Da, int64_t Dc, T* z, T* zacc,
                     T* den, uint8_t* ok, T eps) {
    constexpr int L = Simd<T>::lanes;
    std::fill(zacc, zacc + Da, T(0));
    for (int64_t t = 0; t < n; ++t) {
        const T* at = a + t * Da;
        const T* bt = b + t * Da;
        T part[L] = {};
        int64_t i = 0;
        for (; i + L <= Da; i += L)
            for (int l = 0; l < L; ++l) {
                zacc[i + l] += bt[i + l];
                part[l] += at[i + l] * (z[i + l] + zacc[i + l]);
            }
        for (; i < Da; ++i) {
            zacc[i] += bt[i];
            part[0] += at[i] * (z[i] + zacc[i]);
        }
        const T d = lane_sum(part);
        if (den != nullptr) {
            const bool good = d > T(0) && d < std::numeric_limits<T>::infinity();
            const T used = good ? d : eps;
            den[t] = used;
            ok[t] = good;
            T* ot = out + t * Dc;
            for (int64_t j = 0; j < Dc; ++j) ot[j] = ot[j] / used;
        }
    }
    for (int64_t i = 0; i < Da; ++i) z[i] += zacc[i];
}

template <typename T>
void head(const T* a, const T* b, const T* c, T* out, T* X, T* z, T* den, uint8_t* ok, T eps,
          const T* ea, const T* eb, T* Xe, int64_t Tn, int64_t Da, int64_t Dc, int64_t C, bool rev) {
    const int64_t nblocks = (Tn + C - 1) / C;
    std::vector<T> zacc(z != nullptr ? Da : 0);
    for (int64_t k = 0; k < nblocks; ++k) {
        const int64_t blk = rev ? nblocks - 1 - k : k;
        const int64_t t0 = blk * C;
        const int64_t n = std::min(C, Tn - t0);
        const T* ea_t = Xe != nullptr ? ea + t0 : nullptr;
        const T* eb_t = Xe != nullptr ? eb + t0 : nullptr;
        if (rev)
            block<T, true>(a + t0 * Da, b + t0 * Da, c + t0 * Dc, out + t0 * Dc, n, Da, Dc, X, ea_t, eb_t, Xe);
        else
            block<T, false>(a + t0 * Da, b + t0 * Da, c + t0 * Dc, out + t0 * Dc, n, Da, Dc, X, ea_t, eb_t, Xe);
        if (z != nullptr)
            normalise_block<T>(a + t0 * Da, b + t0 * Da, out + t0 * Dc, n, Da, Dc, z + 0, zacc.data(),
                               den != nullptr ? den + t0 : nullptr, ok != nullptr ? ok + t0 : nullptr, eps);
    }
}

template <typename T>
int run(const T* a, const T* b, const T* c, T* out, T* X, T* z, T* den, uint8_t* ok, T eps, const T* ea,
        const T* eb, T* Xe, int64_t BH, int64_t Tn, int64_t Da, int64_t Dc, int64_t C, int rev, int threads) {
    if (Dc % Simd<T>::lanes != 0 || C < 1 || Tn < 1) return 1;
    if (Xe != nullptr && (ea == nullptr || eb == nullptr)) return 2;
    auto work = [&](int64_t h) {
        head<T>(a + h * Tn * Da, b + h * Tn * Da, c + h * Tn * Dc, out + h * Tn * Dc, X + h * Da * Dc,
                z != nullptr ? z + h * Da : nullptr, den != nullptr ? den + h * Tn : nullptr,
                ok != nullptr ? ok + h * Tn : nullptr, eps, Xe != nullptr ? ea + h * Tn : nullptr,
                Xe != nullptr ? eb + h * Tn : nullptr, Xe != nullptr ? Xe + h * Dc : nullptr, Tn, Da, Dc, C,
                rev != 0);
    };
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, BH));
    if (nt == 1) {
        for (int64_t h = 0; h < BH; ++h) work(h);
        return 0;
    }
    auto body = [&](int64_t w) { for (int64_t h = w; h < BH; h += nt) work(h); };
    return linattn_parallel::run_workers(nt, body) ? 0 : 3;
}

// The rows [w·n/nt, (w+1)·n/nt) of n on worker w of nt: elementwise work split in contiguous parts.
template <typename F>
int split_rows(int64_t n, int threads, F&& part) {
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(threads, n / 4096 + 1));
    auto body = [&](int64_t w) { part(n * w / nt, n * (w + 1) / nt); };
    return linattn_parallel::run_workers(nt, body) ? 0 : 3;
}

// phi += max(x, 0): elu(x) + 1 = exp(min(x, 0)) + max(x, 0) (linattn.elu_plus_one's arithmetic)
// with the exponential already in phi; one pass and no temporary for the second half.
template <typename T>
int add_relu(T* phi, const T* x, int64_t n, int threads) {
    return split_rows(n, threads, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) phi[i] += std::max(x[i], T(0));
    });
}

// The normaliser's share of the backward pass of y = o / den, per row t of (rows, Dv):
//     g_den[t] = -(Σ_j g[t, j] y[t, j]) / den[t] where ok[t] (0 where den was replaced by eps),
//     g_out[t, :] = g[t, :] / den[t]
// (one pass over g and y instead of four; the sum over j in a fixed order).
template <typename T>
int normaliser_grad(const T* g, const T* y, const T* den, const uint8_t* ok, T* g_out, T* g_den, int64_t rows,
                    int64_t Dv, int threads) {
    return split_rows(rows, threads, [&](int64_t t0, int64_t t1) {
        constexpr int L = Simd<T>::lanes;
        for (int64_t t = t0; t < t1; ++t) {
            const T* gt = g + t * Dv;
            const T* yt = y + t * Dv;
            T* ot = g_out + t * Dv;
            T part[L] = {};
            int64_t j = 0;
            for (; j + L <= Dv; j += L)
                for (int l = 0; l < L; ++l) part[l] += gt[j + l] * yt[j + l];
            for (; j < Dv; ++j) part[0] += gt[j] * yt[j];
            const T d = den[t];
            g_den[t] = ok[t] ? -(lane_sum(part) / d) : T(0);
            for (j = 0; j < Dv; ++j) ot[j] = gt[j] / d;
        }
    });
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 if Dc is not a multiple of the vector length (the caller pads), 2 if
// the extra row Xe comes without its per-token numbers ea, eb, 3 if a thread could not be started.
int linattn_causal_pass_f32(const float* a, const float* b, const float* c, float* out, float* X, float* z,
                            float* den, uint8_t* ok, float eps, const float* ea, const float* eb, float* Xe,
                            int64_t BH, int64_t T, int64_t Da, int64_t Dc, int64_t C, int rev, int threads) {
    return run<float>(a, b, c, out, X, z, den, ok, eps, ea, eb, Xe, BH, T, Da, Dc, C, rev, threads);
}

int linattn_causal_pass_f64(const double* a, const double* b, const double* c, double* out, double* X,
                            double* z, double* den, uint8_t* ok, double eps, const double* ea, const double* eb,
                            double* Xe, int64_t BH, int64_t T, int64_t Da, int64_t Dc, int64_t C, int rev,
                            int threads) {
    return run<double>(a, b, c, out, X, z, den, ok, eps, ea, eb, Xe, BH, T, Da, Dc, C, rev, threads);
}

// g *= min(phi, 1): the chain rule through elu(x) + 1 = exp(min(x, 0)) + max(x, 0), whose
// derivative e^x (x <= 0) or 1 (x > 0) equals min(phi(x), 1).
void linattn_elu_grad_f32(float* g, const float* phi, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] *= std::min(phi[i], 1.0f);
}

void linattn_elu_grad_f64(double* g, const double* phi, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] *= std::min(phi[i], 1.0);
}

int linattn_add_relu_f32(float* phi, const float* x, int64_t n, int threads) {
    return add_relu<float>(phi, x, n, threads);
}

int linattn_add_relu_f64(double* phi, const double* x, int64_t n, int threads) {
    return add_relu<double>(phi, x, n, threads);
}

// Returns 0, or 3 if a thread could not be started.
int linattn_normaliser_grad_f32(const float* g, const float* y, const float* den, const uint8_t* ok, float* g_out,
                                float* g_den, int64_t rows, int64_t Dv, int threads) {
    return normaliser_grad<float>(g, y, den, ok, g_out, g_den, rows, Dv, threads);
}

int linattn_normaliser_grad_f64(const double* g, const double* y, const double* den, const uint8_t* ok,
                                double* g_out, double* g_den, int64_t rows, int64_t Dv, int threads) {
    return normaliser_grad<double>(g, y, den, ok, g_out, g_den, rows, Dv, threads);
}

int linattn_vector_bytes() { return linattn_simd::vector_bytes; }

// The OpenMP runtime to run the heads on (GOMP_parallel, omp_get_thread_num, omp_get_num_threads of
// the one PyTorch loaded; see cpu_parallel.h), or three nulls: std::threads of our own.
void linattn_set_openmp(void* parallel, void* thread_num, void* num_threads) {
    // libgomp's threads do not survive fork(): a child that used them would wait for ever (as
    // PyTorch's own parallel operations do there), so a forked child starts threads of its own.
    static const int registered = pthread_atfork(nullptr, nullptr, [] { linattn_parallel::openmp() = {}; });
    (void)registered;
    auto& omp = linattn_parallel::openmp();
    const bool all = parallel != nullptr && thread_num != nullptr && num_threads != nullptr;
    omp.parallel = all ? reinterpret_cast<linattn_parallel::ParallelFn>(parallel) : nullptr;
    omp.thread_num = all ? reinterpret_cast<linattn_parallel::IntFn>(thread_num) : nullptr;
    omp.num_threads = all ? reinterpret_cast<linattn_parallel::IntFn>(num_threads) : nullptr;
}

}  // extern "C"
