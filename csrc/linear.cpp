// linear(x [..., K], w [N, K]) -> [..., N] in x's dtype, for the decode step's few rows (linear.h): the skinny GEMM
// (skinny_gemm.h) reads 16-bit weights as stored and accumulates in fp32, each weight row once for all rows of x;
// x is widened to fp32 once and the output rounded once. ATen's CPU linear in fp16 / bf16 runs several times slower
// than in fp32 at these shapes on CPUs without AVX512-BF16 / AMX, where this kernel reads half the bytes of fp32;
// in fp32 at 1-8 rows it still beats ATen's GEMM (no packing of the weight, no call chain). Weight rows are split
// over the intra-op threads.
#include "linear.h"

#include <torch/library.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <vector>

#include "convert16.h"
#include "skinny_gemm.h"

namespace livemoe_linear {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "linear: weight must be [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear: x must be [..., K = ", K, "], got ", x.sizes());
  const auto dt = w.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "linear: dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(x.scalar_type() == dt, "linear: x and weight must share a dtype, got ", x.scalar_type(), " and ", dt);
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear: CPU tensors only");
  const int64_t M = K ? x.numel() / K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  const bool f32 = dt == at::kFloat;
  auto wc = w.is_contiguous() ? w : w.contiguous();
  auto out = at::empty(shape, x.options());
  if (K == 0) return out.zero_();  // an empty sum
  if (M == 0 || N == 0) return out;
  // fp32: x read and the output written in place. 16-bit: x widened into, and the output rounded from, this
  // thread's fp32 scratch (the same conversions as ATen's .to(), vectorised, without two more dispatched ops per call)
  thread_local std::vector<float> scratch;
  const float* x0;
  float* o;
  at::Tensor xc;
  if (f32) {
    xc = x.is_contiguous() ? x : x.contiguous();
    x0 = xc.data_ptr<float>();
    o = out.data_ptr<float>();
  } else {
    if (scratch.size() < static_cast<size_t>(M * (K + N))) scratch.resize(M * (K + N));
    xc = x.is_contiguous() ? x : x.contiguous();
    float* xw = scratch.data();
    AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "linear widen", [&] { livemoe_cvt::widen(xc.data_ptr<scalar_t>(), xw, M * K); });
    x0 = xw;
    o = xw + M * K;
  }
  const float* one_row[1] = {x0};
  std::vector<const float*> many;
  if (M > 1) {
    many.resize(M);
    for (int64_t r = 0; r < M; ++r) many[r] = x0 + r * K;
  }
  const float* const* rows = M > 1 ? many.data() : one_row;
  auto run = [&](auto zero) {
    using W = decltype(zero);
    const W* wp = reinterpret_cast<const W*>(wc.data_ptr());
    // chunks of >= 64 weight rows: one thread's share stays well above the fork cost
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      livemoe_gemm::skinny_gemm(rows, M, wp + begin * K, end - begin, K, o + begin, N, nullptr);
    });
  };
  switch (dt) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: run(c10::Half{}); break;
  }
  if (!f32) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "linear round", [&] { livemoe_cvt::narrow(o, out.data_ptr<scalar_t>(), M * N); });
  }
  return out;
}

}  // namespace livemoe_linear

TORCH_LIBRARY_FRAGMENT(livemoe, m) { m.def("linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("linear", &livemoe_linear::linear); }
