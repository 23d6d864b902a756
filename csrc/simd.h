// Portable loops (no intrinsics) compiled for AVX2 + FMA as well as the baseline, the clone picked at load time
// (the build passes no -march, so they would be SSE2 only): moe_experts' portable GEMM. The hand-written AVX2
// kernels use vec_math.h's LIVEMOE_AVX2 and use_avx2() instead.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LIVEMOE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LIVEMOE_SIMD_CLONES
#endif
