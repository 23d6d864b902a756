// x [..., K] @ w [N, K].T for a decode step's few rows on the CPU (csrc/linear.cpp): the skinny GEMM of
// skinny_gemm.h, fp32 accumulation, each weight row read once for all rows of x. Declared here so that the fused
// decode layer (decode_layer.cpp) calls it directly, without the dispatcher, and both pick it by the same rule.
#pragma once

#include <ATen/ATen.h>

namespace livemoe_linear {

// Up to this many rows of x the skinny kernel beats ATen's GEMM: 16-bit weights at up to 32 rows (ATen's fp16 /
// bf16 CPU GEMM runs several times slower than its fp32 one), fp32 at up to 8 (above, BLAS's packing pays)
constexpr int64_t kSkinnyRows16 = 32, kSkinnyRowsF32 = 8;

inline int64_t skinny_rows(at::ScalarType dt) { return dt == at::kFloat ? kSkinnyRowsF32 : kSkinnyRows16; }

// x [..., K] (x's dtype = w's: fp32, bf16 or fp16) -> [..., N] in that dtype
at::Tensor linear(const at::Tensor& x, const at::Tensor& w);

}  // namespace livemoe_linear
