// What the CPU ops share: an elementwise fp32 exp without a libm call, so that loops over it vectorise, and
// the choice of their vector code (AVX2 kernels picked at run time, target clones of portable loops).
// exp: Cephes' expf (x / ln 2 rounded by the 1.5 * 2^23 trick, a degree-6 polynomial of the remainder, 2^k
// through the exponent bits), relative error ~1e-7, the input clamped to [-87, 88] (2^k stays a normal float)
// so that it serves softmax and SiLU alike: below, ~1e-38 instead of 0; above, ~1.6e38 instead of inf; neither
// changes a softmax or a SiLU. NaN stays NaN. exp_poly: scalar (a `#pragma omp simd` loop vectorises it only
// where its clamps if-convert, which GCC's default -ftrapping-math forbids); exp_poly8: the same on 8 lanes
// for AVX2 code.
// use_avx2(): the build passes no -march, so AVX2 code sits in LIVEMOE_AVX2 (target attribute) functions,
// chosen at run time. ATEN_CPU_CAPABILITY=default (PyTorch's own switch to its portable kernels) selects ours
// too: that is how the tests run the portable code on an AVX2 machine.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)  // GCC and clang: target attributes and the intrinsics
#define LIVEMOE_X86_AVX2 1
#include <immintrin.h>
#endif

// Portable loops (no intrinsics) compiled for AVX2 + FMA as well as the baseline, the clone picked at load time
// (without -march they would be SSE2 only): moe_experts' portable GEMM. Hand-written AVX2 kernels use
// LIVEMOE_AVX2 and use_avx2() below instead.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LIVEMOE_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LIVEMOE_SIMD_CLONES
#endif

namespace livemoe_exp {
constexpr float kLo = -87.f, kHi = 88.f, kLog2e = 1.44269504f, kRound = 12582912.f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace livemoe_exp

// PyTorch's ATEN_CPU_CAPABILITY=default: the portable kernels everywhere
inline bool portable_forced() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return cap != nullptr && std::strcmp(cap, "default") == 0;
}

inline float exp_poly(float x) {
  using namespace livemoe_exp;
  float v = x < kLo ? kLo : x;
  v = v > kHi ? kHi : v;
  const float k = (v * kLog2e + kRound) - kRound;
  const float r = v - k * kLn2Hi - k * kLn2Lo;
  float p = kP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kP[i];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#ifdef LIVEMOE_X86_AVX2
// the functions of the AVX2 code paths, and their always-inlined helpers
#define LIVEMOE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LIVEMOE_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

// k = round(x / ln 2) by adding 1.5 * 2^23 + 127: the sum's low mantissa bits are k + 127 (in [1, 254] for the
// clamped input), so one shift makes them the exponent of 2^k
LIVEMOE_AVX2_INLINE __m256 exp_poly8(__m256 x) {
  using namespace livemoe_exp;
  const __m256 magic = _mm256_set1_ps(kRound + 127.f);
  // max/min return their second operand for a NaN: x second keeps it
  const __m256 v = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), x));
  const __m256 kb = _mm256_fmadd_ps(v, _mm256_set1_ps(kLog2e), magic);
  const __m256 k = _mm256_sub_ps(kb, magic);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), v));
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(kb), 23)));
}

inline bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c") && !portable_forced();
  return ok;
}

// x[i] = exp(x[i] - max) for the first multiple of 8 of n, their sum added to *sum; returns how many were done
LIVEMOE_AVX2 inline int64_t exp_shifted_avx2(float* x, int64_t n, float max, float* sum) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int l = 0; l < 8; ++l) *sum += lanes[l];
  return i;
}
#else
inline bool use_avx2() { return false; }
#endif

// x[0..n) = exp(x - max), returns their sum: a softmax's numerators (the MoE routing, the attention's
// portable kernels); AVX2 where the CPU has it
inline float exp_shifted(float* x, int64_t n, float max) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef LIVEMOE_X86_AVX2
  if (use_avx2()) i = exp_shifted_avx2(x, n, max, &sum);
#endif
  for (; i < n; ++i) {
    x[i] = exp_poly(x[i] - max);
    sum += x[i];
  }
  return sum;
}
