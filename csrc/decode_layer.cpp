// The decoder's CPU step from C++ (CPU, inference): the embedding, the rotary cos / sin, every Qwen3 decoder layer of a
// paged step and the final norm in one call. A small model's decode step is bound by Python module calls and per-op
// dispatch, not arithmetic; this call makes a step's ~25 torch calls per layer from C++ instead. It calls the very
// same kernels in the same order as the modules (the livemoe ops, at::cos / sin, the linears by the rule of
// linear.h), and does the exact steps between them (the embedding's row copy, the rotary halves and rounding, the
// residual adds, views) in plain loops, so its hidden states are bitwise the Python path's (tested).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "convert16.h"
#include "linear.h"

namespace {

using TensorList = std::vector<at::Tensor>;

// the livemoe ops this layer calls, looked up once
const auto& rms_norm_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const auto& qk_norm_rope_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::qk_norm_rope", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                 double)>();
  return op;
}

const auto& store_kvcache_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::store_kvcache", "")
                       .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

const auto& paged_attention_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::paged_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const auto& moe_forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::moe_forward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, bool)>();
  return op;
}

// x [..., K] @ w.T: the skinny kernel at a decode step's few rows (linear.h's rule, as livemoe.kernels.linear picks
// it in the module path); else for fp32 the mm at::linear ends in (it folds x to 2-D and calls mm on w.t()),
// without the linear -> matmul -> reshape calls around it
at::Tensor lin(const at::Tensor& x, const at::Tensor& w) {
  const int64_t K = x.size(-1);
  if (x.numel() <= livemoe_linear::skinny_rows(w.scalar_type()) * K) return livemoe_linear::linear(x, w);
  if (!x.is_contiguous() || w.scalar_type() != at::kFloat) return at::linear(x, w);
  auto out = at::mm(x.view({-1, K}), w.t());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  return out.view(shape);
}

// a + b for same-shaped contiguous tensors: elementwise in fp32 and rounded once to their dtype, as at::add does it
// (an IEEE add is an IEEE add, and a 16-bit sum computed in fp32 and rounded is the 16-bit sum), without
// TensorIterator's set-up, which costs more than the add at a decode step's sizes
at::Tensor add_same(const at::Tensor& a, const at::Tensor& b) {
  const auto dt = a.scalar_type();
  if (b.scalar_type() != dt || !a.is_contiguous() || !b.is_contiguous() || a.sizes() != b.sizes() ||
      (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16))
    return at::add(a, b);
  auto out = at::empty_like(a);
  const int64_t n = a.numel();
  if (dt == at::kFloat) {
    const float* pa = a.data_ptr<float>();
    const float* pb = b.data_ptr<float>();
    float* po = out.data_ptr<float>();
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
    return out;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(dt, "add_same", [&] {
    constexpr int64_t kChunk = 256;  // on the stack: a decode step's rows are a few of these
    float fa[kChunk], fb[kChunk];
    const scalar_t* pa = a.data_ptr<scalar_t>();
    const scalar_t* pb = b.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t m = std::min(kChunk, n - i0);
      livemoe_cvt::widen(pa + i0, fa, m);
      livemoe_cvt::widen(pb + i0, fb, m);
      for (int64_t i = 0; i < m; ++i) fa[i] += fb[i];
      livemoe_cvt::narrow(fa, po + i0, m);
    }
  });
  return out;
}

// weights, in this order: input_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_attention_layernorm,
// then for an MoE layer (top_k > 0) gate (router), experts.gate_up_proj, experts.down_proj, and for a dense one
// gate_proj, up_proj, down_proj
enum { kInNorm, kQ, kK, kV, kO, kQNorm, kKNorm, kPostNorm, kMlp0, kMlp1, kMlp2, kNumWeights };

// One decoder layer of a paged step: what DecoderLayer.forward does with a StepContext, op for op, on the step's
// rows x [N, H] (the modules carry a leading 1: every kernel here works row by row, so the bits are the same);
// w: its kNumWeights weights in the order above
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor* w, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const std::optional<at::Tensor>& cu_seqlens_q,
                        const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& cos,
                        const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        int64_t top_k, bool renormalize) {
  const int64_t N = x.size(0);
  const int64_t d = w[kQNorm].size(0);
  // attention: the same calls as SelfAttention.forward and Attention.paged_forward
  auto h = rms_norm_op().call(x, w[kInNorm], eps);
  auto q = lin(h, w[kQ]).view({N, num_heads, d});
  auto k = lin(h, w[kK]).view({N, num_kv_heads, d});
  auto v = lin(h, w[kV]).view({N, num_kv_heads, d});
  auto qk = qk_norm_rope_op().call(q, k, w[kQNorm], w[kKNorm], cos, signed_sin, eps);
  store_kvcache_op().call(std::get<1>(qk), v, k_cache, v_cache, slot_mapping);
  auto attn = paged_attention_op().call(std::get<0>(qk), k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                                        scale);
  auto out = add_same(x, lin(attn.view({N, -1}), w[kO]));
  // the MLP: SparseMoeBlock.forward (router, then the routed experts) or MLP.forward
  auto h2 = rms_norm_op().call(out, w[kPostNorm], eps);
  at::Tensor mlp;
  if (top_k > 0) {
    auto router_logits = lin(h2, w[kMlp0]);
    mlp = moe_forward_op().call(h2, w[kMlp1], w[kMlp2], router_logits, top_k, renormalize);
  } else {
    mlp = lin(at::mul(at::silu(lin(h2, w[kMlp0])), lin(h2, w[kMlp1])), w[kMlp2]);
  }
  return add_same(out, mlp);
}

// RotaryEmbedding.forward's plain path: cos / signed_sin [N, 1, D] of positions [N] in dtype dt. The frequencies
// float(position) * inv_freq and their cos / sin are computed as there (an fp32 product, then ATen's cos and sin
// over a tensor of the same shape); the halves, the negation and the rounding to dt, exact, in one loop each
// instead of eight dispatched ops
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dt) {
  const int64_t N = positions.numel(), half = inv_freq.numel();
  auto inv = inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() ? inv_freq
                                                                              : inv_freq.to(at::kFloat).contiguous();
  auto pos = positions.scalar_type() == at::kLong && positions.is_contiguous() ? positions
                                                                               : positions.to(at::kLong).contiguous();
  auto freqs = at::empty({1, N, 1, half}, inv.options());
  const float* f = inv.data_ptr<float>();
  const int64_t* p = pos.data_ptr<int64_t>();
  float* fr = freqs.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < half; ++j) fr[n * half + j] = static_cast<float>(p[n]) * f[j];
  auto c = freqs.cos(), s = freqs.sin();
  auto cos = at::empty({N, 1, 2 * half}, inv.options().dtype(dt));
  auto sin = at::empty({N, 1, 2 * half}, inv.options().dtype(dt));
  std::vector<float> row(2 * half);
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "rotary", [&] {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < half; ++j) row[j] = row[half + j] = cp[n * half + j];
      livemoe_cvt::narrow(row.data(), cos.data_ptr<scalar_t>() + n * 2 * half, 2 * half);
      for (int64_t j = 0; j < half; ++j) row[j] = -sp[n * half + j], row[half + j] = sp[n * half + j];
      livemoe_cvt::narrow(row.data(), sin.data_ptr<scalar_t>() + n * 2 * half, 2 * half);
    }
  });
  return {cos, sin};
}

// at::embedding's rows (an index_select: a copy) of ids [N] -> [N, H]
at::Tensor embed_rows(const at::Tensor& embed, const at::Tensor& ids) {
  if (!embed.is_contiguous() || embed.dim() != 2 || ids.scalar_type() != at::kLong || !ids.is_contiguous())
    return at::embedding(embed, ids.reshape({-1}));
  const int64_t N = ids.numel(), V = embed.size(0), H = embed.size(1), bytes = H * embed.element_size();
  auto out = at::empty({N, H}, embed.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(embed.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(id[n] >= 0 && id[n] < V, "decode_step: token id ", id[n], " is out of the embedding's range [0, ", V,
                ")");
    std::memcpy(dst + n * bytes, src + id[n] * bytes, bytes);
  }
  return out;
}

// Qwen3ForCausalLM.forward_hidden of a paged step: input_ids and positions [1, N] -> the final hidden states
// [1, N, H]. weights: each layer's decode_layer weights, layer after layer; kv_caches: each layer's K then V;
// top_k: each layer's (0: a dense MLP).
at::Tensor decode_step_cpu(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& embed,
                           const at::Tensor& inv_freq, const at::Tensor& final_norm, const TensorList& weights,
                           const TensorList& kv_caches, const at::Tensor& slot_mapping,
                           const std::optional<at::Tensor>& cu_seqlens_q, const at::Tensor& context_lens,
                           const at::Tensor& block_tables, at::IntArrayRef top_k, int64_t num_heads,
                           int64_t num_kv_heads, double eps, double scale, bool renormalize) {
  const auto L = static_cast<int64_t>(top_k.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kNumWeights && static_cast<int64_t>(kv_caches.size()) == 2 * L,
              "decode_step: expected ", L * kNumWeights, " weights and ", 2 * L, " caches for ", L, " layers, got ",
              weights.size(), " and ", kv_caches.size());
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.size(0) == 1 && positions.sizes() == input_ids.sizes(),
              "decode_step: input_ids and positions must be one flattened row [1, N], got ", input_ids.sizes(), " and ",
              positions.sizes());
  auto x = embed_rows(embed, input_ids);
  auto [cos, sin] = rotary(positions, inv_freq, x.scalar_type());
  for (int64_t l = 0; l < L; ++l) {
    x = decode_layer(x, weights.data() + l * kNumWeights, kv_caches[2 * l], kv_caches[2 * l + 1], slot_mapping,
                     cu_seqlens_q, context_lens, block_tables, cos, sin, num_heads, num_kv_heads, eps, scale, top_k[l],
                     renormalize);
  }
  return rms_norm_op().call(x, final_norm, eps).unsqueeze(0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("decode_step(Tensor input_ids, Tensor positions, Tensor embed, Tensor inv_freq, Tensor final_norm, "
        "Tensor[] weights, Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor? cu_seqlens_q, Tensor context_lens, "
        "Tensor block_tables, int[] top_k, int num_heads, int num_kv_heads, float eps, float scale, bool renormalize) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("decode_step", &decode_step_cpu); }
