// The inner kernels of the CPU paged attention (paged_attention.cpp): the query rows of one task (its kv
// heads x the GQA group x its query tokens) against one chunk of keys, carrying the online-softmax state.
// Two implementations of one contract: PortableKernels (plain C++, any compiler and ISA; also the head sizes
// that are not a multiple of 8) and, on x86-64 GCC / clang, Avx2Kernels (AVX2 + FMA intrinsics in
// LIVEMOE_AVX2 functions, chosen at run time by use_avx2(); both from vec_math.h, as is exp).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec_math.h"

namespace livemoe_attn {

// One chunk of n keys for `heads` kv heads. Row r = h * head_rows + i is a query of head h (already times the
// softmax scale) that sees the first vis[i] keys of the chunk (causal; vis[i] <= n, the same for every head).
// Key j of head h: K row k + h * head_stride + off[j], V row v + h * head_stride + off[j] (cache rows in place,
// or a widened copy). off holds round_up(n, 8) entries, the padding being valid keys, so that kernels may
// read keys in groups of 8; their scores are computed but never used.
struct Chunk {
  const float* q;  // [rows, d]
  int64_t heads, head_rows, d;
  const float* k;
  const float* v;
  int64_t head_stride;
  const int64_t* off;
  int64_t n;
  const int64_t* vis;  // [head_rows]
  float* s;            // [rows, lds] scratch: scores, then probabilities; lds >= round_up(n, 8)
  int64_t lds;
  float* m;    // [rows] running maximum of the scores
  float* l;    // [rows] running sum of exp(score - m)
  float* acc;  // [rows, d] running sum of exp(score - m) * v
};

// The chunk raised row r's maximum to mx: what was summed under the old maximum is scaled down to it.
inline void raise_max(const Chunk& c, int64_t r, float mx) {
  if (!(mx > c.m[r])) return;
  if (c.l[r] > 0.f) {  // nothing summed yet (first chunk): acc and l are 0, nothing to rescale
    const float corr = std::exp(c.m[r] - mx);
    c.l[r] *= corr;
    float* a = c.acc + r * c.d;
    for (int64_t i = 0; i < c.d; ++i) a[i] *= corr;
  }
  c.m[r] = mx;
}

struct PortableKernels {
  template <int64_t kD>
  static void attend_chunk(const Chunk& c) {
    const int64_t d = kD ? kD : c.d;
    for (int64_t h = 0; h < c.heads; ++h) {
      const float* kh = c.k + h * c.head_stride;
      const float* vh = c.v + h * c.head_stride;
      for (int64_t i = 0; i < c.head_rows; ++i) {
        const int64_t r = h * c.head_rows + i, vr = c.vis[i];
        if (vr == 0) continue;
        const float* qr = c.q + r * d;
        float* sr = c.s + r * c.lds;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < vr; ++j) {
          const float* kr = kh + c.off[j];
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < d; ++x) dot += qr[x] * kr[x];
          sr[j] = dot;
          mx = std::max(mx, dot);
        }
        raise_max(c, r, mx);
        c.l[r] += exp_shifted(sr, vr, c.m[r]);
        float* ar = c.acc + r * d;
        for (int64_t j = 0; j < vr; ++j) {
          const float e = sr[j];
          const float* vj = vh + c.off[j];
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) ar[x] += e * vj[x];
        }
      }
    }
  }

  // the keys' rows (heads x d elements each) at src + off[j], j < n, into dst [heads][n][d] (head stride hs)
  template <typename T>
  static void widen(const T* src, const int64_t* off, int64_t n, int64_t heads, int64_t d, float* dst, int64_t hs) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < d; ++i) dst[h * hs + j * d + i] = static_cast<float>(src[off[j] + h * d + i]);
  }
};

#ifdef LIVEMOE_X86_AVX2

// Head sizes a multiple of 8 (one __m256 per 8 elements of a row). Scores: tiles of 2 rows x 4 keys (1 row x
// 8 keys for an odd last row), whose 8 partial-product vectors one shuffle tree reduces (reduce8) instead of
// a horizontal sum per key. Softmax: the maxima of all rows, then their exps (independent rows in flight).
// Probabilities x V: tiles of up to 4 rows x 16 columns held in registers over the chunk's keys, each V load
// shared by the tile's rows.
struct Avx2Kernels {
  // lanes 0-3: the totals of a[0..3], lanes 4-7: the totals of a[4..7]
  static LIVEMOE_AVX2_INLINE __m256 reduce8(const __m256* a) {
    __m256 t[4];
    for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a0 a1 a0 a1] partial sums of the pair (2i, 2i + 1)
      t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    // per lane: [a0 a1 a2 a3], [a4 a5 a6 a7]
    const __m256 u0 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x44), _mm256_shuffle_ps(t[0], t[1], 0xEE));
    const __m256 u1 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], 0x44), _mm256_shuffle_ps(t[2], t[3], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  // lanes < n set, the others clear
  static LIVEMOE_AVX2_INLINE __m256 lane_mask(int64_t n) {
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }

  static LIVEMOE_AVX2_INLINE float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }

  static LIVEMOE_AVX2_INLINE float hmax(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }

  // scores of query rows q, q + d (RB = 2, 4 keys per step) or q (RB = 1, 8 keys per step) against keys
  // [0, jmax) of k + off[j], into s (row stride lds)
  template <int RB, int64_t kD>
  static LIVEMOE_AVX2_INLINE void scores(const float* q, int64_t d_rt, const float* k, const int64_t* off, float* s,
                                         int64_t lds, int64_t jmax) {
    constexpr int KB = 8 / RB;
    const int64_t d = kD ? kD : d_rt;
    for (int64_t j = 0; j < jmax; j += KB) {
      const float* kr[KB];
      for (int b = 0; b < KB; ++b) kr[b] = k + off[j + b];
      __m256 a[8];
      for (int b = 0; b < 8; ++b) a[b] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(q + i);
        if constexpr (RB == 2) {
          const __m256 x1 = _mm256_loadu_ps(q + d + i);
          for (int b = 0; b < 4; ++b) {
            const __m256 y = _mm256_loadu_ps(kr[b] + i);
            a[b] = _mm256_fmadd_ps(x0, y, a[b]);
            a[4 + b] = _mm256_fmadd_ps(x1, y, a[4 + b]);
          }
        } else {
          for (int b = 0; b < 8; ++b) a[b] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(kr[b] + i), a[b]);
        }
      }
      const __m256 sums = reduce8(a);
      if constexpr (RB == 2) {
        _mm_storeu_ps(s + j, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(s + lds + j, _mm256_extractf128_ps(sums, 1));
      } else {
        _mm256_storeu_ps(s + j, sums);
      }
    }
  }

  // the maximum of s[0, vis) (vis > 0)
  static LIVEMOE_AVX2_INLINE float row_max(const float* s, int64_t vis) {
    const int64_t full = vis & ~int64_t{7};
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 m0 = ninf, m1 = ninf;
    int64_t j = 0;
    for (; j + 16 <= full; j += 16) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(s + j + 8));
    }
    if (j < full) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(s + j));
    if (full < vis) m1 = _mm256_max_ps(m1, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + full), lane_mask(vis - full)));
    return hmax(_mm256_max_ps(m0, m1));
  }

  // s[0, vis) = exp(s - m), s[vis, end) = 0 (end a multiple of 8); returns the sum
  static LIVEMOE_AVX2_INLINE float row_exp(float* s, int64_t vis, int64_t end, float m) {
    const int64_t full = vis & ~int64_t{7};
    const __m256 mv = _mm256_set1_ps(m);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= full; j += 16) {
      const __m256 e0 = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
      const __m256 e1 = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), mv));
      _mm256_storeu_ps(s + j, e0);
      _mm256_storeu_ps(s + j + 8, e1);
      s0 = _mm256_add_ps(s0, e0);
      s1 = _mm256_add_ps(s1, e1);
    }
    if (j < full) {
      const __m256 e = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
      _mm256_storeu_ps(s + j, e);
      s0 = _mm256_add_ps(s0, e);
    }
    j = full;
    if (j < vis) {
      const __m256 e = _mm256_and_ps(exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), lane_mask(vis - j));
      _mm256_storeu_ps(s + j, e);
      s1 = _mm256_add_ps(s1, e);
      j += 8;
    }
    for (; j < end; j += 8) _mm256_storeu_ps(s + j, _mm256_setzero_ps());
    return hsum(_mm256_add_ps(s0, s1));
  }

  // acc[RB rows, 8 DV columns] += p[RB rows, :jmax] x V[:jmax, the columns], the tile in registers. A tile of
  // at most 4 accumulators keeps a second set for odd keys, so that enough FMAs are in flight.
  template <int RB, int DV>
  static LIVEMOE_AVX2_INLINE void pv_tile(const float* p, int64_t lds, const float* v, const int64_t* off,
                                          int64_t jmax, float* acc, int64_t d) {
    constexpr bool kTwo = RB * DV <= 4;
    constexpr int kSets = kTwo ? 2 : 1;
    __m256 a[kSets * RB * DV];  // [set][row][column vector]
#pragma GCC unroll 16
    for (int t = 0; t < kSets * RB * DV; ++t) a[t] = _mm256_setzero_ps();
    int64_t j = 0;
    if constexpr (kTwo) {
      for (; j + 2 <= jmax; j += 2) {
        const float* v0 = v + off[j];
        const float* v1 = v + off[j + 1];
#pragma GCC unroll 4
        for (int x = 0; x < RB; ++x) {
          const __m256 p0 = _mm256_broadcast_ss(p + x * lds + j), p1 = _mm256_broadcast_ss(p + x * lds + j + 1);
#pragma GCC unroll 2
          for (int y = 0; y < DV; ++y) {
            a[x * DV + y] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * y), a[x * DV + y]);
            a[RB * DV + x * DV + y] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * y), a[RB * DV + x * DV + y]);
          }
        }
      }
    }
    for (; j < jmax; ++j) {
      const float* v0 = v + off[j];
#pragma GCC unroll 4
      for (int x = 0; x < RB; ++x) {
        const __m256 p0 = _mm256_broadcast_ss(p + x * lds + j);
#pragma GCC unroll 2
        for (int y = 0; y < DV; ++y) a[x * DV + y] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * y), a[x * DV + y]);
      }
    }
#pragma GCC unroll 4
    for (int x = 0; x < RB; ++x)
#pragma GCC unroll 2
      for (int y = 0; y < DV; ++y) {
        float* o = acc + x * d + 8 * y;
        __m256 t = _mm256_add_ps(_mm256_loadu_ps(o), a[x * DV + y]);
        if constexpr (kTwo) t = _mm256_add_ps(t, a[RB * DV + x * DV + y]);
        _mm256_storeu_ps(o, t);
      }
  }

  // rows [i, i + RB) of head h: all their columns
  template <int RB>
  static LIVEMOE_AVX2_INLINE void pv_rows(const Chunk& c, int64_t h, int64_t i) {
    int64_t jmax = 0;
    for (int x = 0; x < RB; ++x) jmax = std::max(jmax, c.vis[i + x]);
    if (jmax == 0) return;
    const int64_t r = h * c.head_rows + i, d = c.d;
    const float* p = c.s + r * c.lds;
    const float* v = c.v + h * c.head_stride;
    float* acc = c.acc + r * d;
    int64_t x = 0;
    for (; x + 16 <= d; x += 16) pv_tile<RB, 2>(p, c.lds, v + x, c.off, jmax, acc + x, d);
    if (x < d) pv_tile<RB, 1>(p, c.lds, v + x, c.off, jmax, acc + x, d);
  }

  template <int64_t kD>
  static LIVEMOE_AVX2 void attend_chunk(const Chunk& chunk) {
    const Chunk c = chunk;  // a local copy: the intrinsics' stores (may_alias) cannot change its fields
    const int64_t d = kD ? kD : c.d, hr = c.head_rows, end = (c.n + 7) & ~int64_t{7};
    for (int64_t h = 0; h < c.heads; ++h) {
      const float* k = c.k + h * c.head_stride;
      const int64_t r = h * hr;
      int64_t i = 0;
      for (; i + 2 <= hr; i += 2)
        scores<2, kD>(c.q + (r + i) * d, d, k, c.off, c.s + (r + i) * c.lds, c.lds, std::max(c.vis[i], c.vis[i + 1]));
      if (i < hr) scores<1, kD>(c.q + (r + i) * d, d, k, c.off, c.s + (r + i) * c.lds, c.lds, c.vis[i]);
    }
    // softmax: first every row's maximum, then the exps (the rows are independent chains)
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < hr; ++i)
        if (c.vis[i] > 0) raise_max(c, h * hr + i, row_max(c.s + (h * hr + i) * c.lds, c.vis[i]));
    for (int64_t h = 0; h < c.heads; ++h)
      for (int64_t i = 0; i < hr; ++i) {
        const int64_t r = h * hr + i;
        c.l[r] += row_exp(c.s + r * c.lds, c.vis[i], end, c.m[r]);
      }
    for (int64_t h = 0; h < c.heads; ++h) {
      int64_t i = 0;
      for (; i + 4 <= hr; i += 4) pv_rows<4>(c, h, i);
      for (; i + 2 <= hr; i += 2) pv_rows<2>(c, h, i);
      if (i < hr) pv_rows<1>(c, h, i);
    }
  }

  template <typename T>
  static LIVEMOE_AVX2 void widen(const T* src, const int64_t* off, int64_t n, int64_t heads, int64_t d, float* dst,
                                 int64_t hs) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16: the high half of an fp32
      for (int64_t j = 0; j < n; ++j) {
        const T* row = src + off[j];
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < d; i += 8) {
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + h * d + i));
            _mm256_storeu_ps(dst + h * hs + j * d + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)));
          }
      }
    } else if constexpr (std::is_same_v<T, c10::Half>) {  // fp16: F16C's exact conversion, 8 lanes at a time
      for (int64_t j = 0; j < n; ++j) {
        const T* row = src + off[j];
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(dst + h * hs + j * d + i,
                             _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + h * d + i))));
      }
    } else {
      PortableKernels::widen(src, off, n, heads, d, dst, hs);
    }
  }
};
#endif  // LIVEMOE_X86_AVX2

}  // namespace livemoe_attn
