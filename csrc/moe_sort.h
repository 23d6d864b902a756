// The stable counting sort of the (token, slot) pairs of topk_ids by expert, shared by the CPU ops that
// group pairs per expert: moe_align (segments padded to a block) and moe_experts (unpadded). Within an
// expert the pairs keep ascending flat index (token * k + slot), so every result is deterministic.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

// Pairs per expert; every id checked against [0, num_experts) (`op` names the caller in the error).
inline std::vector<int64_t> count_pairs_per_expert(const int64_t* id, int64_t n, int64_t num_experts,
                                                   const char* op) {
  std::vector<int64_t> counts(num_experts, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_experts, op, ": expert id ", id[i], " at flat index ", i,
                " is outside [0, ", num_experts, ")");
    ++counts[id[i]];
  }
  return counts;
}

// place(i, pos) for every pair i: pos runs up from start[e] over the pairs of expert e, in pair order.
template <typename Place>
inline void place_pairs_by_expert(const int64_t* id, int64_t n, std::vector<int64_t> start, Place&& place) {
  for (int64_t i = 0; i < n; ++i) place(i, start[id[i]]++);
}
