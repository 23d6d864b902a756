// The inner kernels of the CPU paged attention (paged_attention.cpp): one kv head's query rows against one
// chunk of keys, with the running online-softmax state. Two implementations of the same contract:
// PortableKernels (plain C++, any compiler and ISA; also the head sizes that are not a multiple of 8) and,
// on x86-64 GCC / clang, Avx2Kernels (AVX2 + FMA intrinsics in target("avx2,fma") functions, picked at run
// time by use_avx2(): the build passes no -march).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <c10/util/BFloat16.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define LIVEMOE_ATTN_AVX2 1
#include <immintrin.h>
#endif

namespace livemoe_attn {

// One kv head x one chunk of n keys. Row r is a query (already multiplied by the softmax scale) that sees
// the first vis[r] keys of the chunk (causal; vis[r] <= n). Keys are addressed through off: key j's K row is
// k + off[j], its V row v + off[j] (cache rows in place, or a widened copy); off holds round_up(n, 8)
// entries, the padding repeating a valid key, so that kernels may read keys in groups of 8.
struct HeadChunk {
  const float* q;  // [rows, d]
  int64_t rows, d;
  const float* k;
  const float* v;
  const int64_t* off;
  int64_t n;
  const int64_t* vis;  // [rows]
  float* s;            // [rows, lds] scratch for scores / probabilities, lds >= round_up(n, 8)
  int64_t lds;
  float* m;    // [rows] running maximum (scaled scores)
  float* l;    // [rows] running sum of exp(score - m)
  float* acc;  // [rows, d] running sum of exp(score - m) * v
};

// A new chunk raised row r's maximum to mx: what was summed under the old maximum is scaled down to it.
inline void raise_max(const HeadChunk& c, int64_t r, float mx) {
  if (!(mx > c.m[r])) return;
  if (c.l[r] > 0.f) {  // nothing summed yet (first chunk): acc and l are 0, no rescale
    const float corr = std::exp(c.m[r] - mx);
    c.l[r] *= corr;
    float* a = c.acc + r * c.d;
    for (int64_t i = 0; i < c.d; ++i) a[i] *= corr;
  }
  c.m[r] = mx;
}

// exp(x) for x <= 0 (scores minus their maximum), Cephes' expf: round x / ln 2 to k, exp of the remainder
// by a degree-6 polynomial, 2^k through the exponent bits; relative error ~1e-7. Below -87 (exp < 2^-126)
// it returns ~1e-38 instead of 0: nothing a sum notices. The AVX2 exp256 below is the same computation.
constexpr float kExpLo = -87.f, kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float float_from_bits(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct PortableKernels {
  // x[i] = exp(x[i] - mx) for i < n (vectorised by the compiler); returns their sum
  static float exp_sum(float* x, int64_t n, float mx) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::max(x[i] - mx, kExpLo);
      const float k = (v * kLog2e + 12582912.f) - 12582912.f;  // round to nearest by the 1.5 * 2^23 trick
      const float r = v - k * kLn2Hi - k * kLn2Lo;
      float p = kExpP[0];
      p = p * r + kExpP[1];
      p = p * r + kExpP[2];
      p = p * r + kExpP[3];
      p = p * r + kExpP[4];
      p = p * r + kExpP[5];
      p = p * r * r + r + 1.f;
      const float e = p * float_from_bits((static_cast<int32_t>(k) + 127) << 23);
      x[i] = e;
      sum += e;
    }
    return sum;
  }

  template <int64_t kD>
  static void attend_chunk(const HeadChunk& c) {
    const int64_t d = kD ? kD : c.d;
    for (int64_t r = 0; r < c.rows; ++r) {
      const int64_t vr = c.vis[r];
      if (vr == 0) continue;
      const float* qr = c.q + r * d;
      float* sr = c.s + r * c.lds;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < vr; ++j) {
        const float* kr = c.k + c.off[j];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qr[i] * kr[i];
        sr[j] = dot;
        mx = std::max(mx, dot);
      }
      raise_max(c, r, mx);
      c.l[r] += exp_sum(sr, vr, c.m[r]);
      float* ar = c.acc + r * d;
      for (int64_t j = 0; j < vr; ++j) {
        const float e = sr[j];
        const float* vj = c.v + c.off[j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] += e * vj[i];
      }
    }
  }

  // n rows of d elements at src + off[j] (a 16-bit cache) into dst [n, d] fp32
  template <typename T>
  static void widen(const T* src, const int64_t* off, int64_t n, int64_t d, float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < d; ++i) dst[j * d + i] = static_cast<float>(src[off[j] + i]);
  }
};

#ifdef LIVEMOE_ATTN_AVX2
#define LIVEMOE_AVX2 __attribute__((target("avx2,fma")))
#define LIVEMOE_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

inline bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// Head sizes a multiple of 8 (one __m256 per 8 elements of a row). Scores: tiles of 2 rows x 4 keys (1 row x
// 8 keys for an odd last row), 8 partial-product vectors reduced by one hadd tree (reduce8) instead of a
// horizontal sum per key; probabilities x V: tiles of up to 4 rows x 16 columns held in registers over the
// chunk's keys, each V load shared by the tile's rows.
struct Avx2Kernels {
  // lanes 0-3: the sums of a0..a3, lanes 4-7: the sums of a4..a7
  static LIVEMOE_AVX2_INLINE __m256 reduce8(const __m256* a) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
  }

  static LIVEMOE_AVX2_INLINE __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(kExpLo));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kExpP[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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

  // scores of rows r, r + 1 (RB = 2, 4 keys per step) or row r (RB = 1, 8 keys per step), keys [0, jmax)
  template <int RB, int64_t kD>
  static LIVEMOE_AVX2_INLINE void scores(const HeadChunk& c, int64_t r, int64_t jmax) {
    constexpr int KB = 8 / RB;
    const int64_t d = kD ? kD : c.d;
    const float* q0 = c.q + r * d;
    const float* q1 = RB == 2 ? q0 + d : q0;
    float* s0 = c.s + r * c.lds;
    for (int64_t j = 0; j < jmax; j += KB) {
      const float* kr[KB];
      for (int b = 0; b < KB; ++b) kr[b] = c.k + c.off[j + b];
      __m256 a[8];
      for (int b = 0; b < 8; ++b) a[b] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(q0 + i);
        if constexpr (RB == 2) {
          const __m256 x1 = _mm256_loadu_ps(q1 + i);
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
        _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(s0 + c.lds + j, _mm256_extractf128_ps(sums, 1));
      } else {
        _mm256_storeu_ps(s0 + j, sums);
      }
    }
  }

  // row r's scores [0, vis) -> probabilities under the raised maximum, 0 from vis to round_up(n, 8)
  static LIVEMOE_AVX2_INLINE void softmax_row(const HeadChunk& c, int64_t r) {
    float* sr = c.s + r * c.lds;
    const int64_t vr = c.vis[r], full = vr & ~int64_t{7}, end = (c.n + 7) & ~int64_t{7};
    if (vr > 0) {
      const __m256 tail = lane_mask(vr - full);
      const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      __m256 mx = ninf;
      for (int64_t j = 0; j < full; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
      if (full < vr) mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + full), tail));
      raise_max(c, r, hmax(mx));
      const __m256 m = _mm256_set1_ps(c.m[r]);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < full; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + j), m));
        _mm256_storeu_ps(sr + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      if (full < vr) {
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sr + full), m)), tail);
        _mm256_storeu_ps(sr + full, e);
        sum = _mm256_add_ps(sum, e);
      }
      c.l[r] += hsum(sum);
    }
    for (int64_t j = (vr + 7) & ~int64_t{7}; j < end; j += 8) _mm256_storeu_ps(sr + j, _mm256_setzero_ps());
  }

  // acc[r .. r + RB, i .. i + 8 DV) += p[r .. r + RB, :jmax] x V[:jmax, i .. i + 8 DV), the tile in registers.
  // A tile of at most 4 accumulators keeps a second set for odd keys, so that enough FMAs are in flight.
  template <int RB, int DV>
  static LIVEMOE_AVX2_INLINE void pv_tile(const HeadChunk& c, int64_t r, int64_t i, int64_t jmax) {
    constexpr bool kTwo = RB * DV <= 4;
    constexpr int kSets = kTwo ? 2 : 1;
    const int64_t d = c.d, lds = c.lds;
    const float* p = c.s + r * lds;
    __m256 a[kSets * RB * DV];  // [set][row][column vector]
#pragma GCC unroll 16
    for (int t = 0; t < kSets * RB * DV; ++t) a[t] = _mm256_setzero_ps();
    int64_t j = 0;
    if constexpr (kTwo) {
      for (; j + 2 <= jmax; j += 2) {
        const float* v0 = c.v + c.off[j] + i;
        const float* v1 = c.v + c.off[j + 1] + i;
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
      const float* v0 = c.v + c.off[j] + i;
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
        float* o = c.acc + (r + x) * d + i + 8 * y;
        __m256 t = _mm256_add_ps(_mm256_loadu_ps(o), a[x * DV + y]);
        if constexpr (kTwo) t = _mm256_add_ps(t, a[RB * DV + x * DV + y]);
        _mm256_storeu_ps(o, t);
      }
  }

  template <int RB>
  static LIVEMOE_AVX2_INLINE void pv_rows(const HeadChunk& c, int64_t r) {
    int64_t jmax = 0;
    for (int x = 0; x < RB; ++x) jmax = std::max(jmax, c.vis[r + x]);
    if (jmax == 0) return;
    int64_t i = 0;
    for (; i + 16 <= c.d; i += 16) pv_tile<RB, 2>(c, r, i, jmax);
    if (i < c.d) pv_tile<RB, 1>(c, r, i, jmax);
  }

  template <int64_t kD>
  static LIVEMOE_AVX2 void attend_chunk(const HeadChunk& c) {
    int64_t r = 0;
    for (; r + 2 <= c.rows; r += 2) scores<2, kD>(c, r, std::max(c.vis[r], c.vis[r + 1]));
    if (r < c.rows) scores<1, kD>(c, r, c.vis[r]);
    for (r = 0; r < c.rows; ++r) softmax_row(c, r);
    r = 0;
    for (; r + 4 <= c.rows; r += 4) pv_rows<4>(c, r);
    for (; r + 2 <= c.rows; r += 2) pv_rows<2>(c, r);
    if (r < c.rows) pv_rows<1>(c, r);
  }

  template <typename T>
  static LIVEMOE_AVX2 void widen(const T* src, const int64_t* off, int64_t n, int64_t d, float* dst) {
    if constexpr (sizeof(T) == 2 && std::is_same_v<T, c10::BFloat16>) {  // bf16: the high half of an fp32
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < d; i += 8) {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + off[j] + i));
          _mm256_storeu_ps(dst + j * d + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
    } else {
      PortableKernels::widen(src, off, n, d, dst);
    }
  }
};
#undef LIVEMOE_AVX2
#undef LIVEMOE_AVX2_INLINE
#endif  // LIVEMOE_ATTN_AVX2

}  // namespace livemoe_attn
