// RMSNorm and Qwen3's per-head q/k RMSNorm + rotary embedding on the CPU, one call each: a decode step of a
// small model is bound by op dispatch, and F.rms_norm alone is ~6 dispatched ops (pow, mean, add, rsqrt,
// mul, mul) at ~10 us per call where the arithmetic takes ~1 us. Forward only (no autograd): the Python
// dispatch (livemoe/kernels/norm.py) calls these where no gradient is needed.
//
// Numerics follow transformers' formulas op by op: x in fp32, y = x * (1 / sqrt(mean(x^2) + eps)), rounded
// to x's dtype, times the weight in x's dtype; RoPE (rotate-half) as x * cos + rotate_half(x) * sin with
// each product rounded to the dtype before the sum, so a 16-bit model rounds where transformers does. The
// mean is an fp32 sum in SIMD order (PyTorch's vectorised sum adds in another order: ~1 ulp apart).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "convert16.h"

namespace {

// 1 / sqrt(mean(x^2) + eps) of one fp32 row of n values of dtype T. fp32 sums in SIMD order; a 16-bit row in index
// order, as this op always summed it (the vectorised conversions left its bits, and so its greedy tokens, as they were)
template <typename T>
inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.f;
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  } else {
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  }
  return 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// out[i] = T(w[i] * T(x[i] * inv)), transformers' RMSNorm of one row in dtype T, computed and kept in fp32 (x, w
// and out hold values of T; out may be x)
template <typename T>
inline void norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float inv = inv_rms<T>(x, n, eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
  livemoe_cvt::round_to(out, n, T{});
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * out[i];
  livemoe_cvt::round_to(out, n, T{});
}

// n values of p as fp32: p itself for fp32, else widened into buf
inline const float* as_f32(const float* p, float*, int64_t) { return p; }
template <typename T>
inline const float* as_f32(const T* p, float* buf, int64_t n) {
  livemoe_cvt::widen(p, buf, n);
  return buf;
}

// where a row of dst is computed: dst itself for fp32, else buf (then narrowed into dst)
inline float* out_f32(float* dst, float*) { return dst; }
template <typename T>
inline float* out_f32(T*, float* buf) { return buf; }

// this thread's fp32 scratch of at least n floats (no allocation per call once grown)
inline float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(n);
  return buf.data();
}

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must be [D] with D = ",
              "the last dim of x ", x.sizes(), ", got ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), op, ": x and weight must share a dtype, got ", x.scalar_type(),
              " and ", weight.scalar_type());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dt);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", x, weight);
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto out = at::empty_like(xc);
  const int64_t d = x.size(-1), rows = d ? xc.numel() / d : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    float* buf = scratch(3 * d);
    const float* w = as_f32(wc.data_ptr<scalar_t>(), buf, d);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out_f32(dst + r * d, buf + 2 * d);
      norm_row<scalar_t>(as_f32(src + r * d, buf + d, d), w, d, static_cast<float>(eps), o);
      livemoe_cvt::narrow(o, dst + r * d, d);
    }
  });
  return out;
}

// One head row: RMSNorm, then out = T(T(x * cos) + T(rotate_half(x) * signed_sin)), where signed_sin has its first
// half negated (livemoe.engine.model.layers.RotaryEmbedding), so rotate_half(x)[i] * sin[i] == x[(i + d/2) % d] *
// signed_sin[i]. All rows fp32 holding values of T; normed and rot: d floats of scratch.
template <typename T>
inline void norm_rope_row(const float* x, const float* weight, const float* cos, const float* sin, int64_t d,
                          float eps, float* normed, float* rot, float* out) {
  norm_row<T>(x, weight, d, eps, normed);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) out[i] = normed[i] * cos[i];
  for (int64_t i = 0; i < half; ++i) rot[i] = normed[i + half] * sin[i];  // two loops: no modulo, so they vectorise
  for (int64_t i = half; i < d; ++i) rot[i] = normed[i - half] * sin[i];
  livemoe_cvt::round_to(out, d, T{});
  livemoe_cvt::round_to(rot, d, T{});
  for (int64_t i = 0; i < d; ++i) out[i] = out[i] + rot[i];
  livemoe_cvt::round_to(out, d, T{});
}

// q [..., Hq, D] and k [..., Hkv, D] (the same leading dims; any strides between tokens and heads), the norms'
// weights [D], cos and signed_sin [..., 1, D] broadcasting over the leading dims -> (q_out, k_out) of q's and
// k's shapes, contiguous. The leading dims are flattened here, not in Python: a decode step pays per op.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const at::Tensor& q_weight, const at::Tensor& k_weight,
                                                    const at::Tensor& cos_in, const at::Tensor& sin_in, double eps) {
  const int64_t nd = q_in.dim();
  TORCH_CHECK(nd >= 2 && k_in.dim() == nd && q_in.sizes().slice(0, nd - 2) == k_in.sizes().slice(0, nd - 2) &&
                  q_in.size(-1) == k_in.size(-1),
              "qk_norm_rope: q must be [..., Hq, D] and k [..., Hkv, D] with the same leading dims, got ",
              q_in.sizes(), " and ", k_in.sizes());
  const int64_t hq = q_in.size(-2), hkv = k_in.size(-2), d = q_in.size(-1);
  TORCH_CHECK(d % 2 == 0, "qk_norm_rope: the head size must be even for rotate-half RoPE, got ", d);
  check_norm_args("qk_norm_rope", q_in, q_weight);
  check_norm_args("qk_norm_rope", k_in, k_weight);
  std::vector<int64_t> rows_shape(q_in.sizes().begin(), q_in.sizes().end() - 2);
  rows_shape.insert(rows_shape.end(), {1, d});
  auto broadcasts = [&](const at::Tensor& t) {
    if (t.dim() != nd) return false;
    for (int64_t i = 0; i < nd; ++i)
      if (t.size(i) != rows_shape[i] && t.size(i) != 1) return false;
    return t.size(-1) == d;
  };
  TORCH_CHECK(broadcasts(cos_in) && broadcasts(sin_in),
              "qk_norm_rope: cos and signed_sin must broadcast to [..., 1, D] = ",
              at::IntArrayRef(rows_shape), ", got ", cos_in.sizes(), " and ", sin_in.sizes());
  TORCH_CHECK(cos_in.scalar_type() == q_in.scalar_type() && sin_in.scalar_type() == q_in.scalar_type() &&
                  k_in.scalar_type() == q_in.scalar_type(),
              "qk_norm_rope: q, k, cos and signed_sin must share a dtype, got ", q_in.scalar_type(), ", ",
              k_in.scalar_type(), ", ", cos_in.scalar_type(), ", ", sin_in.scalar_type());
  const int64_t n = hq > 0 && d > 0 ? q_in.numel() / (hq * d) : 0;
  // a decode step's q and k come contiguous with cos / sin of their rows' shape: read them as they are (each
  // reshape / expand / contiguous below is a dispatched op, and together they cost more than the arithmetic)
  const bool as_is = q_in.is_contiguous() && k_in.is_contiguous() && cos_in.is_contiguous() && sin_in.is_contiguous() &&
                     cos_in.numel() == n * d && sin_in.numel() == n * d;
  auto q = as_is ? q_in : q_in.reshape({-1, hq, d});
  auto k = as_is ? k_in : k_in.reshape({-1, hkv, d});
  auto qc = as_is || q.stride(2) == 1 ? q : q.contiguous();
  auto kc = as_is || k.stride(2) == 1 ? k : k.contiguous();
  auto cc = as_is ? cos_in : cos_in.expand(rows_shape).reshape({n, d}).contiguous();
  auto sc = as_is ? sin_in : sin_in.expand(rows_shape).reshape({n, d}).contiguous();
  auto qw = q_weight.contiguous();
  auto kw = k_weight.contiguous();
  auto q_out = at::empty(q_in.sizes(), q_in.options());
  auto k_out = at::empty(k_in.sizes(), k_in.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "qk_norm_rope", [&] {
    const scalar_t* cos_p = cc.data_ptr<scalar_t>();
    const scalar_t* sin_p = sc.data_ptr<scalar_t>();
    // fp32 scratch: the two weights, a token's cos and sin, a head row in and out, normed, rotated
    float* buf = scratch(8 * d);
    const float* qwf = as_f32(qw.data_ptr<scalar_t>(), buf, d);
    const float* kwf = as_f32(kw.data_ptr<scalar_t>(), buf + d, d);
    float *xb = buf + 4 * d, *ob = buf + 5 * d, *normed = buf + 6 * d, *rot = buf + 7 * d;
    // src: [n, heads, d] with unit stride in d (as_is: contiguous, whatever its leading dims)
    auto rotate = [&](const at::Tensor& src, int64_t heads, const float* wf, const float* cf, const float* sf,
                      int64_t t, at::Tensor& dst) {
      const scalar_t* s = src.data_ptr<scalar_t>();
      scalar_t* o = dst.data_ptr<scalar_t>();
      const int64_t st = as_is ? heads * d : src.stride(0), sh = as_is ? d : src.stride(1);
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* orow = o + (t * heads + h) * d;
        float* of = out_f32(orow, ob);
        norm_rope_row<scalar_t>(as_f32(s + t * st + h * sh, xb, d), wf, cf, sf, d, static_cast<float>(eps), normed,
                                rot, of);
        livemoe_cvt::narrow(of, orow, d);
      }
    };
    for (int64_t t = 0; t < n; ++t) {
      const float* cf = as_f32(cos_p + t * d, buf + 2 * d, d);
      const float* sf = as_f32(sin_p + t * d, buf + 3 * d, d);
      rotate(qc, hq, qwf, cf, sf, t, q_out);
      rotate(kc, hkv, kwf, cf, sf, t, k_out);
    }
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor signed_sin, "
        "float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("qk_norm_rope", &qk_norm_rope_cpu);
}
