// One Qwen3 decoder layer of a paged decoder step in one call (CPU, inference): what DecoderLayer.forward does with
// a StepContext, op for op, from C++. A small model's decode step is bound by Python module calls and per-op
// dispatch, not arithmetic; this call makes the layer's ~20 torch calls from C++ instead. It calls the very same
// kernels in the same order (at::linear, the livemoe ops, at::add), so its output is bitwise the Python path's.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

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

const auto& linear_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("livemoe::linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op;
}

// Rows up to this many take livemoe::linear for 16-bit weights (fp32 accumulation, the weights read as stored);
// fp32 keeps ATen's GEMM, so its bits stay those of the module path
constexpr int64_t kSkinnyRows = 32;

// x [..., K] @ w.T: for fp32 the mm at::linear ends in (it folds x to 2-D and calls mm on w.t()), without the
// linear -> matmul -> reshape calls around it
at::Tensor lin(const at::Tensor& x, const at::Tensor& w) {
  const int64_t K = x.size(-1);
  if (w.scalar_type() != at::kFloat && x.numel() <= kSkinnyRows * K) return linear_op().call(x, w);
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

at::Tensor decode_layer_cpu(const at::Tensor& x, const TensorList& w, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const std::optional<at::Tensor>& cu_seqlens_q,
                            const at::Tensor& context_lens, const at::Tensor& block_tables, const at::Tensor& cos,
                            const at::Tensor& signed_sin, int64_t num_heads, int64_t num_kv_heads, double eps,
                            double scale, int64_t top_k, bool renormalize) {
  TORCH_CHECK(w.size() == kNumWeights, "decode_layer: expected ", static_cast<int>(kNumWeights), " weights, got ",
              w.size());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1, "decode_layer: x must be one flattened row [1, N, H], got ", x.sizes());
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("decode_layer(Tensor x, Tensor[] weights, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? cu_seqlens_q, Tensor context_lens, Tensor block_tables, Tensor cos, Tensor signed_sin, "
        "int num_heads, int num_kv_heads, float eps, float scale, int top_k, bool renormalize) -> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) { m.impl("decode_layer", &decode_layer_cpu); }
