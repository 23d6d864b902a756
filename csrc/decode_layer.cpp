// The decoder's CPU step from C++ (CPU, inference): the embedding, the rotary cos / sin, every Qwen3 decoder layer of a
// paged step and the final norm in one call. A small model's decode step is bound by Python module calls and per-op
// dispatch, not arithmetic; this call makes a step's ~25 torch calls per layer from C++ instead. It calls the very
// same kernels in the same order as the modules (the livemoe ops, at::embedding, at::cos / sin, the linears by the
// rule of linear.h, an fp32 add), so its hidden states are bitwise the Python path's (tested).
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

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

// a + b for same-shaped contiguous tensors: fp32 elementwise as at::add does it (an IEEE add is an IEEE add), without
// TensorIterator's set-up, which costs more than the add at a decode step's sizes
at::Tensor add_fp32(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat || !a.is_contiguous() || !b.is_contiguous() ||
      a.sizes() != b.sizes())
    return at::add(a, b);
  auto out = at::empty_like(a);
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t n = a.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  return out;
}

// weights, in this order: input_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, post_attention_layernorm,
// then for an MoE layer (top_k > 0) gate (router), experts.gate_up_proj, experts.down_proj, and for a dense one
// gate_proj, up_proj, down_proj
enum { kInNorm, kQ, kK, kV, kO, kQNorm, kKNorm, kPostNorm, kMlp0, kMlp1, kMlp2, kNumWeights };

// One decoder layer of a paged step: what DecoderLayer.forward does with a StepContext, op for op; w: its kNumWeights
// weights in the order above
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor* w, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const std::optional<at::Tensor>& cu_seqlens_q,
                        const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& cos,
                        const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        int64_t top_k, bool renormalize) {
  const int64_t N = x.size(1);
  const int64_t d = w[kQNorm].size(0);
  // attention: the same calls as SelfAttention.forward and Attention.paged_forward
  auto h = rms_norm_op().call(x, w[kInNorm], eps);
  auto q = lin(h, w[kQ]).view({1, N, num_heads, d});
  auto k = lin(h, w[kK]).view({1, N, num_kv_heads, d});
  auto v = lin(h, w[kV]).view({1, N, num_kv_heads, d});
  auto qk = qk_norm_rope_op().call(q, k, w[kQNorm], w[kKNorm], cos, signed_sin, eps);
  auto q0 = std::get<0>(qk).select(0, 0);
  auto k0 = std::get<1>(qk).select(0, 0);
  store_kvcache_op().call(k0, v.select(0, 0), k_cache, v_cache, slot_mapping);
  auto attn = paged_attention_op().call(q0, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale);
  auto out = add_fp32(x, lin(attn.unsqueeze(0).reshape({1, N, -1}), w[kO]));
  // the MLP: SparseMoeBlock.forward (router, then the routed experts) or MLP.forward
  auto h2 = rms_norm_op().call(out, w[kPostNorm], eps);
  at::Tensor mlp;
  if (top_k > 0) {
    auto flat = h2.reshape({-1, h2.size(-1)});
    auto router_logits = lin(flat, w[kMlp0]);
    mlp = moe_forward_op().call(flat, w[kMlp1], w[kMlp2], router_logits, top_k, renormalize).reshape(h2.sizes());
  } else {
    mlp = lin(at::mul(at::silu(lin(h2, w[kMlp0])), lin(h2, w[kMlp1])), w[kMlp2]);
  }
  return add_fp32(out, mlp);
}


// RotaryEmbedding.forward's plain path, op for op: cos / signed_sin [1, N, 1, D] of positions [1, N] in dtype dt
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& inv_freq, at::ScalarType dt) {
  auto freqs = positions.unsqueeze(-1).unsqueeze(-1).to(at::kFloat) * inv_freq.to(at::kFloat);
  auto c = freqs.cos(), s = freqs.sin();
  return {at::cat({c, c}, -1).to(dt), at::cat({s.neg(), s}, -1).to(dt)};
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
  auto x = at::embedding(embed, input_ids);
  auto [cos, sin] = rotary(positions, inv_freq, x.scalar_type());
  for (int64_t l = 0; l < L; ++l) {
    x = decode_layer(x, weights.data() + l * kNumWeights, kv_caches[2 * l], kv_caches[2 * l + 1], slot_mapping,
                     cu_seqlens_q, context_lens, block_tables, cos, sin, num_heads, num_kv_heads, eps, scale, top_k[l],
                     renormalize);
  }
  return rms_norm_op().call(x, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("decode_step(Tensor input_ids, Tensor positions, Tensor embed, Tensor inv_freq, Tensor final_norm, "
        "Tensor[] weights, Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor? cu_seqlens_q, Tensor context_lens, "
        "Tensor block_tables, int[] top_k, int num_heads, int num_kv_heads, float eps, float scale, bool renormalize) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("decode_step", &decode_step_cpu); }
