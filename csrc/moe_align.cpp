// MoE routing align on the CPU: groups the (token, slot) pairs of topk_ids by expert, pads each
// expert's segment to a multiple of block_size with a sentinel (= T*k), and lists the expert of every
// block. Same contract as livemoe/kernels/moe/align.py (the PyTorch reference). Within an expert the pairs are
// in ascending flat index (token * k + slot), so the result is deterministic.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "moe_sort.h"

#include <algorithm>
#include <vector>

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_align_cpu(
    const at::Tensor& topk_ids, int64_t num_experts, int64_t block_size) {
  TORCH_CHECK(topk_ids.dim() == 2, "moe_align: topk_ids must be [T, k], got ", topk_ids.dim(), " dims");
  TORCH_CHECK(num_experts > 0 && block_size > 0, "moe_align: num_experts and block_size must be > 0");
  auto ids = topk_ids.contiguous().to(at::kLong);
  const int64_t n = ids.numel();
  const int64_t max_padded = n + std::min(num_experts, n) * (block_size - 1);  // <= min(E, n) non-empty experts
  const int64_t num_blocks = (max_padded + block_size - 1) / block_size;
  auto opts = topk_ids.options().dtype(at::kInt);
  auto sorted_token_ids = at::full({num_blocks * block_size}, static_cast<int>(n), opts);
  auto expert_ids = at::full({num_blocks}, -1, opts);
  auto tokens_per_expert = at::zeros({num_experts}, opts);
  auto num_post_padded = at::zeros({1}, opts);

  const int64_t* id = ids.data_ptr<int64_t>();
  const std::vector<int64_t> counts = count_pairs_per_expert(id, n, num_experts, "moe_align");
  int* counts_out = tokens_per_expert.data_ptr<int>();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) {
    counts_out[e] = static_cast<int>(counts[e]);
    const int64_t padded = (counts[e] + block_size - 1) / block_size * block_size;
    start[e + 1] = start[e] + padded;
  }
  int* eid = expert_ids.data_ptr<int>();
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t b = start[e] / block_size; b < start[e + 1] / block_size; ++b) eid[b] = static_cast<int>(e);
  int* sorted = sorted_token_ids.data_ptr<int>();
  place_pairs_by_expert(id, n, std::vector<int64_t>(start.begin(), start.end() - 1),
                        [&](int64_t i, int64_t pos) { sorted[pos] = static_cast<int>(i); });
  num_post_padded.data_ptr<int>()[0] = static_cast<int>(start[num_experts]);
  return {sorted_token_ids, expert_ids, tokens_per_expert, num_post_padded};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("moe_align(Tensor topk_ids, int num_experts, int block_size) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("moe_align", &moe_align_cpu); }
