// Vectors for the CPU kernels (cpu_causal.cpp, cpu_delta.cpp): GCC/Clang vector extensions as wide
// as the target's registers, chosen when the library is compiled: 64 bytes with AVX-512, 32 with
// AVX (AVX2 machines), 16 elsewhere (SSE2, NEON, or plain code the compiler lowers). A vector type
// wider than the registers is not split into registers: GCC keeps it in memory and every operation
// goes through the stack (a 64-byte type on an AVX2 target ran the causal pass ten times slower).
// Loads and stores go through memcpy, so no pointer needs a vector's alignment.
#pragma once
#include <cstring>

#if defined(__AVX512F__)
#define LINATTN_VECTOR_BYTES 64
#define LINATTN_VECTOR_REGISTERS 32
#elif defined(__AVX__)
#define LINATTN_VECTOR_BYTES 32
#define LINATTN_VECTOR_REGISTERS 16
#elif defined(__aarch64__)
#define LINATTN_VECTOR_BYTES 16
#define LINATTN_VECTOR_REGISTERS 32
#else
#define LINATTN_VECTOR_BYTES 16
#define LINATTN_VECTOR_REGISTERS 16
#endif

namespace linattn_simd {

constexpr int vector_bytes = LINATTN_VECTOR_BYTES;
constexpr int vector_registers = LINATTN_VECTOR_REGISTERS;

template <typename T>
struct Simd {
    typedef T type __attribute__((vector_size(vector_bytes)));
    static constexpr int lanes = vector_bytes / sizeof(T);
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
