// Rows of 16-bit values to fp32 and back, for the CPU ops that compute a 16-bit model in fp32 (norm_rope.cpp,
// linear.cpp). c10's Half <-> float conversions are a software bit routine per element in a build without -mf16c
// (ours passes no -march), which costs more than the arithmetic around it at a decode step's sizes; here fp16 goes
// through F16C eight at a time where the CPU has it (vec_math.h's use_avx2), bf16 through the same round-to-nearest-
// even bit arithmetic as c10, in loops that vectorise. Both give c10's bits: an IEEE conversion rounds one way.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace livemoe_cvt {

#ifdef LIVEMOE_X86_AVX2
LIVEMOE_AVX2 inline int64_t widen_half_avx2(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  return i;
}

LIVEMOE_AVX2 inline int64_t narrow_half_avx2(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return i;
}

LIVEMOE_AVX2 inline int64_t round_half_avx2(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  return i;
}
#endif

// c10::BFloat16's rounding of one fp32 value's bits: NaN to the canonical quiet NaN, else to nearest even
inline uint16_t bf16_bits(uint32_t u) {
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// dst[i] = float(src[i]), i < n
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const double* src, float* dst, int64_t n) {  // a double model's ops compute in fp32 too
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef LIVEMOE_X86_AVX2
  if (use_avx2()) i = widen_half_avx2(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[i] = T(src[i]), rounded to nearest even as c10 rounds, i < n
inline void narrow(const float* src, float* dst, int64_t n) {
  if (src != dst) std::memcpy(dst, src, n * sizeof(float));
}

inline void narrow(const float* src, double* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
}

inline void narrow(const float* src, c10::BFloat16* dst, int64_t n) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits(s[i]);
}

inline void narrow(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#ifdef LIVEMOE_X86_AVX2
  if (use_avx2()) i = narrow_half_avx2(src, dst, n);
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// x[i] = float(T(x[i])): the value rounded to T, kept in fp32 (where a 16-bit model rounds an intermediate)
inline void round_to(float*, int64_t, float) {}
inline void round_to(float*, int64_t, double) {}  // fp32 -> double -> fp32 is exact

inline void round_to(float* x, int64_t n, c10::BFloat16) {
  uint32_t* u = reinterpret_cast<uint32_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) u[i] = static_cast<uint32_t>(bf16_bits(u[i])) << 16;
}

inline void round_to(float* x, int64_t n, c10::Half) {
  int64_t i = 0;
#ifdef LIVEMOE_X86_AVX2
  if (use_avx2()) {
    i = round_half_avx2(x, n);
  }
#endif
  for (; i < n; ++i) x[i] = static_cast<float>(static_cast<c10::Half>(x[i]));
}

}  // namespace livemoe_cvt
