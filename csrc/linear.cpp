// linear(x [..., K], w [N, K]) -> [..., N] in x's dtype, for the decode step's few rows: the skinny GEMM
// (skinny_gemm.h) reads 16-bit weights as stored and accumulates in fp32, each weight row once for all rows of x;
// x is widened to fp32 once and the output rounded once. ATen's CPU linear in fp16 / bf16 runs several times slower
// than in fp32 at these shapes on CPUs without AVX512-BF16 / AMX, where this kernel reads half the bytes of fp32.
// Weight rows are split over the intra-op threads.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "skinny_gemm.h"

namespace {

at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "linear: weight must be [N, K], got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "linear: x must be [..., K = ", K, "], got ", x.sizes());
  const auto dt = w.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "linear: dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(x.scalar_type() == dt, "linear: x and weight must share a dtype, got ", x.scalar_type(), " and ", dt);
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear: CPU tensors only");
  const int64_t M = K ? x.numel() / K : 0;
  auto xf = x.reshape({M, K}).to(at::kFloat).contiguous();
  auto wc = w.contiguous();
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  std::vector<const float*> rows(M);
  for (int64_t r = 0; r < M; ++r) rows[r] = xf.data_ptr<float>() + r * K;
  float* o = out.data_ptr<float>();
  auto run = [&](auto zero) {
    using W = decltype(zero);
    const W* wp = reinterpret_cast<const W*>(wc.data_ptr());
    // chunks of >= 64 weight rows: one thread's share stays well above the fork cost
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      livemoe_gemm::skinny_gemm(rows.data(), M, wp + begin * K, end - begin, K, o + begin, N, nullptr);
    });
  };
  if (M > 0 && N > 0) {
    switch (dt) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(c10::BFloat16{}); break;
      default: run(c10::Half{}); break;
    }
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.to(dt).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) { m.def("linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("linear", &linear_cpu); }
