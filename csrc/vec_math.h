// Elementwise fp32 exp shared by the CPU ops, without a libm call so that loops over it vectorise:
// Cephes' expf (x / ln 2 rounded by the 1.5 * 2^23 trick, a degree-6 polynomial of the remainder, 2^k through
// the exponent bits), relative error ~1e-7. The polynomial of paged_attention.cpp's exp_sum_inplace, with the
// input clamped on both sides (to [-87, 88]: 2^k stays a normal float) so that it also serves SiLU: below,
// ~1e-38 instead of 0; above, ~1.6e38 instead of inf; neither changes a softmax or a SiLU. NaN stays NaN.
// exp_poly: scalar (a `#pragma omp simd` loop vectorises it only where its clamps if-convert, which GCC's
// default -ftrapping-math forbids); exp_poly8: the same on 8 lanes for AVX2 code
// (__attribute__((target("avx2,fma"))) functions).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace livemoe_exp {
constexpr float kLo = -87.f, kHi = 88.f, kLog2e = 1.44269504f, kRound = 12582912.f, kLn2Hi = 0.693359375f,
                kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace livemoe_exp

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

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp_poly8(__m256 x) {
  using namespace livemoe_exp;
  // max/min return their second operand for a NaN: x second keeps it
  const __m256 v = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), x));
  const __m256 k = _mm256_sub_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(kLog2e), _mm256_set1_ps(kRound)),
                                 _mm256_set1_ps(kRound));
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), v));
  __m256 p = _mm256_set1_ps(kP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
