// The skinny GEMM of the CPU ops: out[r * ldo + j] = s_r * (a[r] . w[j]), fp32 rows a against a row-major weight
// [m, K] of fp32, bf16 or fp16 (widened in registers: 16-bit weights are read as they are stored), fp32
// accumulation; each weight row is read once for all n rows of a. AVX2 + FMA + F16C where the CPU has them (picked
// at run time, vec_math.h), else a portable loop. Shared by moe_experts (the experts) and linear (the decode step's
// 16-bit linears).
// A weight that does not sit in cache is read from memory at the floor only with a software prefetch: the hardware
// prefetchers stop at every 4 KB page and restart at every new expert, where this kernel's tiles begin. So while a
// tile reads its weight rows, it prefetches the rows kPrefetchTiles tiles ahead, and past the end of w the same
// span of `next` (what the caller reads after w: an expert's down projection after its gate||up, the next expert).
// A prefetch changes no value.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "vec_math.h"

namespace livemoe_gemm {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// ---- out[r * ldo + j] = s_r * (a[r] . w[j]) for r < n, j < m: a[r] an fp32 row of K, w [m, K] row-major,
// s_r = scale[r] (1 when scale is null). Each weight row is read once for all n rows of a.

// Portable version (the AVX2 one below is used where the CPU has it): four weight rows at a time, so one load
// of a serves four multiply-adds.
template <typename W>
LIVEMOE_SIMD_CLONES void skinny_gemm_portable(const float* const* a, int64_t n, const W* w, int64_t m, int64_t K,
                                              float* out, int64_t ldo, const float* scale) {
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    const W *w0 = w + j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a[r];
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t i = 0; i < K; ++i) {
        const float x = ar[i];
        s0 += x * widen(w0[i]);
        s1 += x * widen(w1[i]);
        s2 += x * widen(w2[i]);
        s3 += x * widen(w3[i]);
      }
      const float sr = scale ? scale[r] : 1.f;
      float* o = out + r * ldo + j;
      o[0] = sr * s0, o[1] = sr * s1, o[2] = sr * s2, o[3] = sr * s3;
    }
  }
  for (; j < m; ++j) {
    const W* wj = w + j * K;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a[r];
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < K; ++i) s += ar[i] * widen(wj[i]);
      out[r * ldo + j] = scale ? scale[r] * s : s;
    }
  }
}

#ifdef LIVEMOE_X86_AVX2

LIVEMOE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
LIVEMOE_AVX2 inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32: the bits shifted up by 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
LIVEMOE_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// the four horizontal sums of a, b, c, d
LIVEMOE_AVX2 inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// the cnt < 8 values at p, zero-padded to 8 (K's tail)
template <typename W>
LIVEMOE_AVX2 inline __m256 load8_tail(const W* p, int64_t cnt) {
  W buf[8] = {};
  for (int64_t i = 0; i < cnt; ++i) buf[i] = p[i];
  return load8(buf);
}

// One MR x NR tile: rows a[0..MR) against weight rows w[0..NR) (w = the first of them), MR * NR accumulators of
// 8 lanes (<= 8 + NR + 1 registers of 16), K's tail zero-padded; inlined so that the arrays stay in registers.
// pf (may be null): NR rows of K weights to prefetch, one 64-byte line per row each time the loop enters a new line.
template <typename W, int MR, int NR>
LIVEMOE_AVX2 __attribute__((always_inline)) inline void tile(const float* const* a, const W* w, int64_t K,
                                                                float* out, int64_t ldo, const float* scale,
                                                                const W* pf = nullptr) {
  constexpr int Q = MR * NR, Q4 = (Q + 3) / 4 * 4;
  constexpr int64_t kLine = 64 / sizeof(W);
  __m256 acc[Q4];
  for (int q = 0; q < Q4; ++q) acc[q] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    if (pf && i % kLine == 0)
      for (int c = 0; c < NR; ++c) _mm_prefetch(reinterpret_cast<const char*>(pf + c * K + i), _MM_HINT_T0);
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = load8(w + c * K + i);
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_loadu_ps(a[r] + i);
      for (int c = 0; c < NR; ++c) acc[r * NR + c] = _mm256_fmadd_ps(av, wv[c], acc[r * NR + c]);
    }
  }
  if (i < K) {
    __m256 wv[NR];
    for (int c = 0; c < NR; ++c) wv[c] = load8_tail(w + c * K + i, K - i);
    for (int r = 0; r < MR; ++r) {
      const __m256 av = load8_tail(a[r] + i, K - i);
      for (int c = 0; c < NR; ++c) acc[r * NR + c] = _mm256_fmadd_ps(av, wv[c], acc[r * NR + c]);
    }
  }
  for (int q = 0; q < Q4; q += 4) {
    alignas(16) float s[4];
    _mm_store_ps(s, reduce4(acc[q], acc[q + 1], acc[q + 2], acc[q + 3]));
    for (int u = 0; u < 4 && q + u < Q; ++u) {
      const int r = (q + u) / NR, c = (q + u) % NR;
      out[r * ldo + c] = scale ? scale[r] * s[u] : s[u];
    }
  }
}

// columns [j, j + NR) for all n rows: the NR weight rows stay in L1 while the rows of a stream past
template <typename W, int NR>
LIVEMOE_AVX2 inline void column_block(const float* const* a, int64_t n, const W* w, int64_t K, float* out,
                                         int64_t ldo, const float* scale) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) tile<W, 4, NR>(a + r, w, K, out + r * ldo, ldo, scale ? scale + r : nullptr);
  const float* sr = scale ? scale + r : nullptr;
  switch (n - r) {
    case 3: tile<W, 3, NR>(a + r, w, K, out + r * ldo, ldo, sr); break;
    case 2: tile<W, 2, NR>(a + r, w, K, out + r * ldo, ldo, sr); break;
    case 1: tile<W, 1, NR>(a + r, w, K, out + r * ldo, ldo, sr); break;
    default: break;
  }
}

// tiles ahead that a tile prefetches (the measured gain is flat from 1 to 4)
constexpr int64_t kPrefetchTiles = 2;

// what the tile at weight rows [j, j + NR) prefetches: the rows kPrefetchTiles tiles ahead, past w's m rows the same
// offset into next (null: nothing)
template <typename W, int NR>
inline const W* prefetch_rows(const W* w, int64_t j, int64_t m, int64_t K, const W* next) {
  const int64_t ahead = j + kPrefetchTiles * NR;
  return ahead < m ? w + ahead * K : next ? next + (ahead - m) * K : nullptr;
}

template <typename W>
LIVEMOE_AVX2 void skinny_gemm_avx2(const float* const* a, int64_t n, const W* w, int64_t m, int64_t K, float* out,
                                      int64_t ldo, const float* scale, const W* next) {
  int64_t j = 0;
  if (n == 1) {  // a matrix-vector product: eight weight rows per pass, for eight independent accumulators
    for (; j + 8 <= m; j += 8) tile<W, 1, 8>(a, w + j * K, K, out + j, ldo, scale, prefetch_rows<W, 8>(w, j, m, K, next));
  } else {
    for (; j + 4 <= m; j += 4) {  // the first pair of rows prefetches, the others find the weights in L1
      const W* pf = prefetch_rows<W, 4>(w, j, m, K, next);
      int64_t r = 0;
      for (; r + 2 <= n; r += 2, pf = nullptr)
        tile<W, 2, 4>(a + r, w + j * K, K, out + r * ldo + j, ldo, scale ? scale + r : nullptr, pf);
      if (r < n) tile<W, 1, 4>(a + r, w + j * K, K, out + r * ldo + j, ldo, scale ? scale + r : nullptr, pf);
    }
  }
  for (; j < m; ++j) column_block<W, 1>(a, n, w + j * K, K, out + j, ldo, scale);
}

#endif

// next: the weights the caller reads after w, prefetched while w's last rows are read (null: none)
template <typename W>
void skinny_gemm(const float* const* a, int64_t n, const W* w, int64_t m, int64_t K, float* out, int64_t ldo,
                 const float* scale, const W* next = nullptr) {
#ifdef LIVEMOE_X86_AVX2
  if (use_avx2()) return skinny_gemm_avx2(a, n, w, m, K, out, ldo, scale, next);
#endif
  skinny_gemm_portable(a, n, w, m, K, out, ldo, scale);
}

}  // namespace livemoe_gemm
