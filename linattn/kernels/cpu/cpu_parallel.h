// Running the heads of a CPU kernel on several threads (cpu_causal.cpp, cpu_delta.cpp).
//
// Where the caller hands over the OpenMP runtime that PyTorch itself loaded (linattn_set_openmp,
// called by linattn/kernels/cpu.py), the work runs on that runtime's threads. After each parallel
// PyTorch operation those threads keep spinning for a while (libgomp's GOMP_SPINCOUNT: milliseconds)
// before they sleep; a thread of our own started meanwhile shares its core with a spinning one, and
// two threads then ran no faster than one (measured on a 2-core Xeon: the gated delta rule's forward
// pass took 5.3 ms on two threads after a torch.exp, against 2.6 ms without the gate's exp before it).
// On those threads the spinning ones simply take the work. Without a runtime (none found, another
// platform) the work runs on std::threads started for the call.
#pragma once
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

namespace linattn_parallel {

using ParallelFn = void (*)(void (*)(void*), void*, unsigned, unsigned);   // GOMP_parallel
using IntFn = int (*)();                                                  // omp_get_thread_num, ..._num_threads

struct OpenMP {
    ParallelFn parallel = nullptr;
    IntFn thread_num = nullptr, num_threads = nullptr;
};

inline OpenMP& openmp() {            // one per library (an inline function's static is shared by both files)
    static OpenMP runtime;
    return runtime;
}

// body(w) for every w in [0, workers), each on its own thread; false if some thread could not be
// started (the bodies that did start have finished). body must not throw.
template <typename F>
bool run_workers(int64_t workers, F& body) {
    if (workers <= 1) {
        body(0);
        return true;
    }
    const OpenMP& omp = openmp();
    if (omp.parallel != nullptr) {
        struct Task {
            F* body;
            int64_t workers;
            IntFn thread_num, num_threads;
        } task{&body, workers, omp.thread_num, omp.num_threads};
        // A team may be smaller than asked for (a nested region runs on one thread): every
        // thread takes the workers w = its number, + the team's size, ...
        omp.parallel(
            [](void* p) {
                const Task& t = *static_cast<const Task*>(p);
                const int64_t n = t.num_threads() < 1 ? 1 : t.num_threads();
                for (int64_t w = t.thread_num(); w < t.workers; w += n) (*t.body)(w);
            },
            &task, unsigned(workers), 0u);
        return true;
    }
    std::vector<std::thread> pool;
    bool started = true;
    try {
        for (int64_t w = 1; w < workers; ++w) pool.emplace_back([&body, w] { body(w); });
    } catch (const std::exception&) {
        started = false;
    }
    body(0);
    for (auto& th : pool) th.join();
    return started;
}

}  // namespace linattn_parallel
