// The MoE block for inference on the CPU, in one call: what livemoe/kernels/moe/sorted_moe.py does with about twenty
// PyTorch ops per layer (a decode step of a small model pays ~10 us of dispatch for each), plus the routing.
//
// moe_forward(x, w_gate_up, w_down, router_logits, top_k, renormalize): Qwen3-MoE routing, then the experts;
// moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids): the experts for a given routing.
// out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]
//
// 0. (moe_forward) per token: softmax of the logits in fp32, the top_k experts, optional renormalisation;
// 1. a stable counting sort of the (token, slot) pairs by expert (moe_sort.h, shared with moe_align);
// 2. per expert with pairs, those experts in parallel: gate||up = x_rows @ w_gate_up[e].T, act = SiLU(gate) * up
//    in place, y = routing weight * (act @ w_down[e].T), on the expert's x rows gathered (widened) into the
//    workspace; a skinny fp32 kernel for decode-sized segments (AVX2 where the CPU has it; each weight read once
//    for all the expert's rows, the next weights prefetched meanwhile), BLAS (at::mm) for long ones (prefill);
// 3. per token, its k rows of y summed in expert order in fp32 (deterministic, no atomics): transformers'
//    loop over experts adds `down(...) * weight` in that order, so fp32 results match it to GEMM rounding.
// Everything between the input and the output is fp32 (one workspace): 16-bit x is widened once, 16-bit
// weights are widened in the kernel's registers (or per expert for BLAS); the output is rounded once. One
// exception: large bf16 experts with a few rows, on a CPU with bf16 dot products (AVX512-BF16), go to BLAS
// in bf16 with the activations rounded to bf16 (transformers' bf16 numerics), where that is faster.
// No autograd: the Python dispatch calls these only where no gradient is needed (the decoder, rollouts).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "moe_sort.h"
#include "skinny_gemm.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using livemoe_gemm::skinny_gemm;
using livemoe_gemm::widen;

// Segments this short (a decode step's share of an expert) run the skinny kernel; longer ones (prefill) go to
// at::mm, whose packing of the weight pays off from there on (the two measured even at 32-33 rows).
constexpr int64_t kSkinnyRows = 32;

// bf16 experts with at least this many rows and this many gate||up weights go to BLAS in bf16 where the CPU
// has bf16 dot products (AVX512-BF16): only there does it beat the skinny kernel, and only on large experts
// (a small one would pay the ~10 tensor ops per expert of that path)
constexpr int64_t kBf16DotRows = 3, kBf16DotWeights = int64_t{1} << 20;

bool cpu_has_bf16_dot() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
  static const bool ok = __builtin_cpu_supports("avx512bf16") && !portable_forced();
  return ok;
#else
  return false;
#endif
}

#ifdef LIVEMOE_X86_AVX2
// g[i] = silu(g[i]) * u[i] for the first multiple of 8 of n; returns how many were done
LIVEMOE_AVX2 int64_t silu_mul_avx2(float* g, const float* u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp_poly8(_mm256_sub_ps(zero, gv));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  return i;
}

#endif

// g = silu(g) * u for each of n rows [g (I) | u (I)] at stride ld (transformers' act_fn(gate) * up, in fp32)
void silu_mul_rows(float* pre, int64_t n, int64_t I, int64_t ld) {
  for (int64_t r = 0; r < n; ++r) {
    float* g = pre + r * ld;
    const float* u = g + I;
    int64_t i = 0;
#ifdef LIVEMOE_X86_AVX2
    if (use_avx2()) i = silu_mul_avx2(g, u, I);
#endif
    for (; i < I; ++i) g[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];
  }
}

// o[0..H) = y[ranks[0]] + y[ranks[1]] + ... in this order (rows of y at stride H)
LIVEMOE_SIMD_CLONES void sum_rows(const float* y, const int64_t* ranks, int64_t k, int64_t H, float* o) {
  std::memcpy(o, y + ranks[0] * H, H * sizeof(float));
  for (int64_t j = 1; j < k; ++j) {
    const float* yr = y + ranks[j] * H;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) o[h] += yr[h];
  }
}

// ---- routing (Qwen3-MoE): probabilities = softmax(logits) in fp32; the top_k experts by probability (the
// largest logits: softmax is monotonic; of equal logits the lower expert index first, where torch.topk's
// pick among ties is unspecified), in descending order; weights = their probabilities, divided by their sum
// when renormalize. id [T * k], weight [T * k] fp32, flat index t * k + slot.
void route_topk(const at::Tensor& logits, int64_t k, bool renormalize, int64_t* id, float* weight) {
  const int64_t T = logits.size(0), E = logits.size(1);
  auto lc = logits.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, lc.scalar_type(), "moe_forward routing", [&] {
    const scalar_t* lp = lc.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(E);
      std::vector<float> top(k);
      for (int64_t t = t0; t < t1; ++t) {
        int64_t* ids = id + t * k;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t e = 0; e < E; ++e) {
          buf[e] = static_cast<float>(lp[t * E + e]);
          mx = std::max(mx, buf[e]);
        }
        // insertion into the descending list top[0..n): after every equal value (ties: lower index first);
        // a NaN never compares greater, so the list is always filled with valid ids
        int64_t n = 0;
        for (int64_t e = 0; e < E; ++e) {
          const float v = buf[e];
          if (n == k && !(v > top[k - 1])) continue;
          int64_t p = n < k ? n++ : k - 1;
          for (; p > 0 && top[p - 1] < v; --p) top[p] = top[p - 1], ids[p] = ids[p - 1];
          top[p] = v;
          ids[p] = e;
        }
        const float sum = exp_shifted(buf.data(), E, mx);
        float* w = weight + t * k;
        float kept = 0.f;
        for (int64_t j = 0; j < k; ++j) {
          w[j] = buf[ids[j]] / sum;
          kept += w[j];
        }
        if (renormalize)
          for (int64_t j = 0; j < k; ++j) w[j] /= kept;
      }
    });
  });
}

void check_experts(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, H], got ", x.sizes());
  TORCH_CHECK(w_gate_up.dim() == 3 && w_down.dim() == 3, op, ": w_gate_up must be [E, 2I, H] and w_down "
              "[E, H, I], got ", w_gate_up.sizes(), " and ", w_down.sizes());
  const int64_t H = x.size(1), E = w_gate_up.size(0), I2 = w_gate_up.size(1), I = I2 / 2;
  TORCH_CHECK(I2 % 2 == 0 && w_gate_up.size(2) == H, op, ": w_gate_up ", w_gate_up.sizes(),
              " does not match [E, 2I, H] with H = ", H);
  TORCH_CHECK(w_down.size(0) == E && w_down.size(1) == H && w_down.size(2) == I, op, ": w_down ",
              w_down.sizes(), " does not match [E, H, I] = [", E, ", ", H, ", ", I, "]");
  TORCH_CHECK(x.scalar_type() == w_gate_up.scalar_type() && x.scalar_type() == w_down.scalar_type(), op,
              ": x and the weights must share a dtype, got ", x.scalar_type(), ", ", w_gate_up.scalar_type(), ", ",
              w_down.scalar_type());
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(x.device().is_cpu() && w_gate_up.device().is_cpu() && w_down.device().is_cpu(), op,
              ": all tensors must be on the CPU");
}

// Steps 1-3 above for the routing id/weight [T * k] (flat index t * k + slot); serves both ops.
at::Tensor experts_core(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                        const int64_t* id, const float* weight, int64_t k, const char* op) {
  const int64_t T = x.size(0), H = x.size(1), E = w_gate_up.size(0), I2 = w_gate_up.size(1), I = I2 / 2;
  const int64_t pairs = T * k;

  // 1. stable counting sort: rank[p] = position of pair p in expert order, order its inverse
  const std::vector<int64_t> counts = count_pairs_per_expert(id, pairs, E, op);
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
  auto out = at::empty({T, H}, x.options());
  if (pairs == 0) return out.zero_();  // T = 0 (k >= 1 for moe_forward; k = 0 would mean no expert: zeros)

  // one fp32 workspace: x rows gathered in expert order [pairs, ldx], gate||up [pairs, ldp] (act in place of
  // gate), weighted expert outputs y [pairs, H], routing weights in expert order [pairs]. Row strides padded
  // off powers of two (rows 2^12 bytes apart would share L1 sets while the kernel streams them together).
  const bool is_f32 = x.scalar_type() == at::kFloat;
  auto padded = [](int64_t n) { return (n + 15) / 16 * 16 + 16; };
  const int64_t ldx = padded(H), ldp = padded(I2);
  auto ws = at::empty({pairs * (ldx + ldp + H + 1)}, x.options().dtype(at::kFloat));
  float* xs = ws.data_ptr<float>();
  float* pre = xs + pairs * ldx;
  float* y = pre + pairs * ldp;
  float* wsorted = y + pairs * H;
  for (int64_t p = 0; p < pairs; ++p) wsorted[p] = weight[order[p]];

  auto run = [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const scalar_t* src = xc.data_ptr<scalar_t>();
    const scalar_t* wgu_p = wgu.data_ptr<scalar_t>();
    const scalar_t* wd_p = wd.data_ptr<scalar_t>();
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    // 2. experts in parallel; each writes only its own rows of xs, pre, y
    // over the experts with pairs, so that the workers share a decode step's few experts evenly
    std::vector<int64_t> used;
    for (int64_t e = 0; e < E; ++e)
      if (counts[e]) used.push_back(e);
    const auto U = static_cast<int64_t>(used.size());
    at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
      // at::mm below is a plain kernel call: no autograd (its mode is thread-local, so set in every worker)
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::vector<const float*> rows;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t e = used[u], s = offs[e], n = offs[e + 1] - s;
        const scalar_t* wgu_e = wgu_p + e * I2 * H;
        const scalar_t* wd_e = wd_p + e * H * I;
        float* xs_e = xs + s * ldx;
        float* pre_e = pre + s * ldp;
        rows.resize(n);
        for (int64_t r = 0; r < n; ++r) {
          const scalar_t* xr = src + (order[s + r] / k) * H;
          float* d = xs_e + r * ldx;
          if constexpr (std::is_same_v<scalar_t, float>) {
            std::memcpy(d, xr, H * sizeof(float));
          } else {
            for (int64_t h = 0; h < H; ++h) d[h] = static_cast<float>(xr[h]);
          }
          rows[r] = d;
        }
        auto scale_rows = [&]() {  // y rows of a BLAS product times their routing weights
          for (int64_t r = 0; r < n; ++r) {
            float* yr = y + (s + r) * H;
            const float wr = wsorted[s + r];
            for (int64_t h = 0; h < H; ++h) yr[h] = wr * yr[h];
          }
        };
        if (std::is_same_v<scalar_t, c10::BFloat16> && n >= kBf16DotRows && n <= kSkinnyRows &&
            I2 * H >= kBf16DotWeights && cpu_has_bf16_dot()) {
          // BLAS in bf16 (oneDNN's AVX512-BF16 dot products) on activations rounded to bf16, as transformers
          // computes a bf16 model: there, faster than widening the weights (1.15x at T=64 of Qwen3-30B-A3B)
          const auto b16 = at::TensorOptions().dtype(at::kBFloat16);
          auto xa = at::empty({n, H}, b16);
          auto* xa_p = xa.data_ptr<c10::BFloat16>();
          for (int64_t r = 0; r < n; ++r)
            std::memcpy(xa_p + r * H, src + (order[s + r] / k) * H, H * sizeof(c10::BFloat16));
          auto w1 = at::from_blob(const_cast<scalar_t*>(wgu_e), {I2, H}, b16);
          at::from_blob(pre_e, {n, I2}, {ldp, 1}, f32).copy_(at::mm(xa, w1.t()));
          silu_mul_rows(pre_e, n, I, ldp);
          auto act = at::from_blob(pre_e, {n, I}, {ldp, 1}, f32).to(at::kBFloat16);
          auto w2 = at::from_blob(const_cast<scalar_t*>(wd_e), {H, I}, b16);
          at::from_blob(y + s * H, {n, H}, f32).copy_(at::mm(act, w2.t()));
          scale_rows();
        } else if (n <= kSkinnyRows) {
          // each product prefetches what is read next: this expert's down projection, then this worker's next
          // expert's gate||up
          const scalar_t* wgu_next = u + 1 < u1 ? wgu_p + used[u + 1] * I2 * H : nullptr;
          skinny_gemm(rows.data(), n, wgu_e, I2, H, pre_e, ldp, nullptr, wd_e);
          silu_mul_rows(pre_e, n, I, ldp);
          for (int64_t r = 0; r < n; ++r) rows[r] = pre_e + r * ldp;
          skinny_gemm(rows.data(), n, wd_e, H, I, y + s * H, H, wsorted + s, wgu_next);
        } else {
          // BLAS in fp32: a 16-bit expert's weights are widened first (its product costs far more)
          auto weight_f32 = [&](const scalar_t* p, int64_t r0, int64_t c0) {
            auto w = at::from_blob(const_cast<scalar_t*>(p), {r0, c0}, at::TensorOptions().dtype(x.scalar_type()));
            return is_f32 ? w : w.to(at::kFloat);
          };
          auto pre_t = at::from_blob(pre_e, {n, I2}, {ldp, 1}, f32);
          at::mm_out(pre_t, at::from_blob(xs_e, {n, H}, {ldx, 1}, f32), weight_f32(wgu_e, I2, H).t());
          silu_mul_rows(pre_e, n, I, ldp);
          auto y_t = at::from_blob(y + s * H, {n, H}, f32);
          at::mm_out(y_t, at::from_blob(pre_e, {n, I}, {ldp, 1}, f32), weight_f32(wd_e, H, I).t());
          scale_rows();
        }
      }
    });
    // 3. per token, its k rows of y summed in expert order (ascending rank) in fp32
    scalar_t* out_p = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> ranks(k);
      std::vector<float> acc(is_f32 ? 0 : H);
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t j = 0; j < k; ++j) {  // insertion sort: k is small
          const int64_t v = rank[t * k + j];
          int64_t p = j;
          for (; p > 0 && ranks[p - 1] > v; --p) ranks[p] = ranks[p - 1];
          ranks[p] = v;
        }
        float* o = is_f32 ? reinterpret_cast<float*>(out_p) + t * H : acc.data();
        sum_rows(y, ranks.data(), k, H, o);
        if (!is_f32)
          for (int64_t h = 0; h < H; ++h) out_p[t * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  };
  // the dtypes check_experts lets through; the kernels widen 16-bit values to fp32 in registers
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: run(c10::Half{}); break;
  }
  return out;
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids) {
  check_experts(x, w_gate_up, w_down, "moe_experts");
  const int64_t T = x.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(),
              "moe_experts: topk_ids and topk_weights must both be [T = ", T, ", k], got ", topk_ids.sizes(),
              " and ", topk_weights.sizes());
  auto ids = topk_ids.contiguous().to(at::kLong);
  auto weights = topk_weights.contiguous().to(at::kFloat);
  return experts_core(x, w_gate_up, w_down, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), topk_ids.size(1),
                      "moe_experts");
}

at::Tensor moe_forward_cpu(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                           const at::Tensor& router_logits, int64_t top_k, bool renormalize) {
  check_experts(x, w_gate_up, w_down, "moe_forward");
  const int64_t T = x.size(0), E = w_gate_up.size(0);
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.size(0) == T && router_logits.size(1) == E,
              "moe_forward: router_logits must be [T = ", T, ", E = ", E, "], got ", router_logits.sizes());
  TORCH_CHECK(at::isFloatingType(router_logits.scalar_type()) && router_logits.device().is_cpu(),
              "moe_forward: router_logits must be a floating-point CPU tensor, got ", router_logits.scalar_type(),
              " on ", router_logits.device());
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_forward: top_k must be in [1, num_experts = ", E, "], got ", top_k);
  std::vector<int64_t> id(T * top_k);
  std::vector<float> weight(T * top_k);
  route_topk(router_logits, top_k, renormalize, id.data(), weight.data());
  return experts_core(x, w_gate_up, w_down, id.data(), weight.data(), top_k, "moe_forward");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("moe_experts(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, Tensor topk_ids) -> Tensor");
  m.def("moe_forward(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor router_logits, int top_k, bool renormalize) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) {
  m.impl("moe_experts", &moe_experts_cpu);
  m.impl("moe_forward", &moe_forward_cpu);
}
