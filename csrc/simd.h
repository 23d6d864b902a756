// Shared by the CPU ops: hot loops compiled for AVX2 + FMA as well as the baseline, picked at load time
// (the build passes no -march, so it would be SSE2 only; measured 1.3-1.6x on paged decode attention).
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LIVEMOE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LIVEMOE_SIMD_CLONES
#endif
