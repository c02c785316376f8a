// 64-byte vectors for the CPU kernels (cpu_causal.cpp, cpu_delta.cpp): GCC/Clang vector extensions,
// AVX-512 registers where the CPU has them, split into smaller ones by the compiler elsewhere.
// Loads and stores go through memcpy, so no pointer needs a vector's alignment.
#pragma once
#include <cstring>

namespace linattn_simd {

template <typename T>
struct Simd {
    typedef T type __attribute__((vector_size(64)));
    static constexpr int lanes = 64 / sizeof(T);
};

template <typename V, typename T>
inline V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
}

template <typename V, typename T>
inline void store(T* p, const V& v) {
    std::memcpy(p, &v, sizeof(V));
}

}  // namespace linattn_simd
