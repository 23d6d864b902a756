// The MoE expert computation for inference on the CPU, in one call: what kernels/moe/sorted_moe.py does
// with about twenty PyTorch ops per layer (a decode step of a small model pays ~10 us of dispatch for each).
//
// out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]
//
// 1. a stable counting sort of the (token, slot) pairs by expert (moe_sort.h, shared with moe_align);
// 2. per expert with pairs: its rows of x gathered once, one GEMM for gate||up, SiLU(gate) * up in fp32,
//    one GEMM for down (BLAS for long segments, a skinny fp32 kernel for decode-sized ones); experts in
//    parallel;
// 3. per token, the k weighted rows summed in expert order in fp32 (deterministic, no atomics).
// No autograd: the Python dispatch calls it only where no gradient is needed (the decoder, rollouts).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "moe_sort.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Segments this short (a decode step's share of an expert) skip BLAS: its packing of the weight costs
// more than the product. Longer ones (prefill) go to at::mm.
constexpr int64_t kSkinnyRows = 16;

// out[r, j] = a[r] . w[j] for r < n, j < m (a [n, K], w [m, K], out [n, m], all row-major fp32): each
// weight row is read once from memory and reused from L1 for every row of a; four weight rows at a time,
// so one load of a serves four multiply-adds.
LIVEMOE_SIMD_CLONES void skinny_gemm_nt(const float* a, int64_t n, const float* w, int64_t m, int64_t K, float* out) {
  int64_t j = 0;
  for (; j + 4 <= m; j += 4) {
    const float *w0 = w + j * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a + r * K;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t i = 0; i < K; ++i) {
        const float x = ar[i];
        s0 += x * w0[i];
        s1 += x * w1[i];
        s2 += x * w2[i];
        s3 += x * w3[i];
      }
      float* o = out + r * m + j;
      o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
    }
  }
  for (; j < m; ++j) {
    const float* wj = w + j * K;
    for (int64_t r = 0; r < n; ++r) {
      const float* ar = a + r * K;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < K; ++i) s += ar[i] * wj[i];
      out[r * m + j] = s;
    }
  }
}

// out = a @ w.T for one expert's segment
void expert_gemm(const at::Tensor& a, const at::Tensor& w, at::Tensor& out) {
  if (a.scalar_type() == at::kFloat && a.size(0) <= kSkinnyRows) {
    skinny_gemm_nt(a.data_ptr<float>(), a.size(0), w.data_ptr<float>(), w.size(0), w.size(1), out.data_ptr<float>());
  } else {
    at::mm_out(out, a, w.t());
  }
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [T, H], got ", x.sizes());
  TORCH_CHECK(w_gate_up.dim() == 3 && w_down.dim() == 3, "moe_experts: w_gate_up must be [E, 2I, H] and w_down "
              "[E, H, I], got ", w_gate_up.sizes(), " and ", w_down.sizes());
  const int64_t T = x.size(0), H = x.size(1), E = w_gate_up.size(0), I2 = w_gate_up.size(1), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && w_gate_up.size(2) == H, "moe_experts: w_gate_up ", w_gate_up.sizes(),
              " does not match [E, 2I, H] with H = ", H);
  TORCH_CHECK(w_down.size(0) == E && w_down.size(1) == H && w_down.size(2) == I, "moe_experts: w_down ",
              w_down.sizes(), " does not match [E, H, I] = [", E, ", ", H, ", ", I, "]");
  TORCH_CHECK(x.scalar_type() == w_gate_up.scalar_type() && x.scalar_type() == w_down.scalar_type(),
              "moe_experts: x and the weights must share a dtype, got ", x.scalar_type(), ", ",
              w_gate_up.scalar_type(), ", ", w_down.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_ids and topk_weights must both be [T = ", T, ", k], got ", topk_ids.sizes(),
              " and ", topk_weights.sizes());
  const int64_t k = topk_ids.size(1), pairs = T * k;
  auto ids = topk_ids.contiguous().to(at::kLong);
  auto weights = topk_weights.contiguous().to(at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();

  // 1. stable counting sort: rank[p] = position of pair p in expert order, order its inverse
  const std::vector<int64_t> counts = count_pairs_per_expert(id, pairs, E, "moe_experts");
  std::vector<int64_t> offs(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offs[e + 1] = offs[e] + counts[e];
  std::vector<int64_t> order(pairs), rank(pairs);
  place_pairs_by_expert(id, pairs, std::vector<int64_t>(offs.begin(), offs.end() - 1), [&](int64_t p, int64_t pos) {
    rank[p] = pos;
    order[pos] = p;
  });

  auto xc = x.contiguous();
  auto wgu = w_gate_up.contiguous();
  auto wd = w_down.contiguous();
  auto opts = x.options();
  auto xs = at::empty({pairs, H}, opts);    // x rows in expert order
  auto pre = at::empty({pairs, I2}, opts);  // gate || up
  auto act = at::empty({pairs, I}, opts);
  auto y = at::empty({pairs, H}, opts);
  auto out = at::empty({T, H}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    scalar_t* xs_p = xs.data_ptr<scalar_t>();
    const scalar_t* pre_p = pre.data_ptr<scalar_t>();
    scalar_t* act_p = act.data_ptr<scalar_t>();
    // 2. experts in parallel; each writes only its own rows of xs, pre, act, y
    at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
      // the GEMMs below are plain kernels: no autograd (its mode is thread-local, so set in every worker)
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t s = offs[e], n = offs[e + 1] - s;
        if (n == 0) continue;
        for (int64_t r = s; r < s + n; ++r) std::memcpy(xs_p + r * H, src + (order[r] / k) * H, H * sizeof(scalar_t));
        auto pre_e = pre.narrow(0, s, n);
        expert_gemm(xs.narrow(0, s, n), wgu[e], pre_e);
        for (int64_t r = s; r < s + n; ++r) {
          const scalar_t* g = pre_p + r * I2;
          scalar_t* a = act_p + r * I;
          for (int64_t i = 0; i < I; ++i) {
            const float gf = static_cast<float>(g[i]);
            a[i] = static_cast<scalar_t>(gf / (1.f + std::exp(-gf)) * static_cast<float>(g[I + i]));
          }
        }
        auto y_e = y.narrow(0, s, n);
        expert_gemm(act.narrow(0, s, n), wd[e], y_e);
      }
    });
    // 3. per token, its k rows weighted and summed (fp32)
    const scalar_t* y_p = y.data_ptr<scalar_t>();
    const float* w = weights.data_ptr<float>();
    scalar_t* out_p = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(H);
      std::vector<int64_t> slots;
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        // in expert order, as transformers' loop over experts adds them (fp32 parity to rounding)
        slots.clear();
        for (int64_t j = 0; j < k; ++j) slots.push_back(t * k + j);
        std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return rank[a] < rank[b]; });
        for (const int64_t p : slots) {
          const float wp = w[p];
          const scalar_t* row = y_p + rank[p] * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += wp * static_cast<float>(row[h]);
        }
        for (int64_t h = 0; h < H; ++h) out_p[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("moe_experts(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, Tensor topk_ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("moe_experts", &moe_experts_cpu); }
