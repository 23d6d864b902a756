// Batch-invariant CPU kernels of the exact on-policy mode (livemoe/kernels/batch_invariant). Every output value
// is computed from its own row (attention: its own query and the keys of its own context) with one fixed
// reduction order, written out here rather than left to a BLAS or a vectorised reduction that picks its
// blocking by the batch's shape or the thread count. So a token's value has the same bits whatever else is in
// the batch, however many threads run, and whether it comes in a decode step, a prefill chunk or a training
// batch. Transcendentals (exp, log, cos, sin) are the scalar libm calls for every element: PyTorch's
// vectorised loops take a SIMD exp for most elements and the scalar one for a tensor's tail, which depends on
// the tensor's size. Forward only; the Python side gives the trainer its gradients from the ordinary formulas.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

constexpr int kLanes = 16;

// sum_i a[i] * b[i] in fp32: 16 lane accumulators over the row in order, then the lanes in a fixed tree
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += static_cast<float>(a[k + l]) * static_cast<float>(b[k + l]);
  for (int l = 0; k + l < n; ++l) acc[l] += static_cast<float>(a[k + l]) * static_cast<float>(b[k + l]);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "batch_invariant: ", name, " must be a CPU tensor");
}

// x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, each output one fixed-order dot product
at::Tensor bi_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& bias_in) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1), "bi_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "bi_linear: x and w must share a dtype");
  auto x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) bias = bias_in->contiguous().to(at::kFloat);
  auto out = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bi_linear", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M * N, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / N, n = i % N;
        float v = dot(xp + m * K, wp + n * K, K);
        if (bp) v += bp[n];
        op[i] = static_cast<scalar_t>(v);
      }
    });
  });
  return out;
}

// transformers' RMSNorm per row of x [M, D]: weight * dtype(x * 1 / sqrt(mean(x^2) + eps))
at::Tensor bi_rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 1 && w_in.size(0) == x_in.size(1), "bi_rms_norm: x [M, D], w [D]");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "bi_rms_norm: x and w must share a dtype");
  auto x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bi_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* row = xp + m * D;
        const float inv = 1.f / std::sqrt(dot(row, row, D) / static_cast<float>(D) + static_cast<float>(eps));
        for (int64_t i = 0; i < D; ++i) {
          const scalar_t y = static_cast<scalar_t>(static_cast<float>(row[i]) * inv);
          op[m * D + i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(y));
        }
      }
    });
  });
  return out;
}

// dtype(dtype(silu(gate)) * up), elementwise
at::Tensor bi_silu_mul_cpu(const at::Tensor& g_in, const at::Tensor& u_in) {
  check_cpu(g_in, "gate");
  TORCH_CHECK(g_in.sizes() == u_in.sizes() && g_in.scalar_type() == u_in.scalar_type(),
              "bi_silu_mul: gate and up must share a shape and dtype");
  auto g = g_in.contiguous(), u = u_in.contiguous();
  auto out = at::empty_like(g);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "bi_silu_mul", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up = u.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, g.numel(), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t s = static_cast<scalar_t>(silu(static_cast<float>(gp[i])));
        op[i] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(up[i]));
      }
    });
  });
  return out;
}

// positions [N] int64, inv_freq [D/2] fp32 -> (cos, signed_sin) [N, D] fp32: cat(cos, cos), cat(-sin, sin)
std::tuple<at::Tensor, at::Tensor> bi_rope_cpu(const at::Tensor& pos_in, const at::Tensor& inv_in) {
  check_cpu(pos_in, "positions");
  TORCH_CHECK(pos_in.dim() == 1 && inv_in.dim() == 1, "bi_rope: positions [N], inv_freq [D/2]");
  auto pos = pos_in.to(at::kLong).contiguous(), inv = inv_in.to(at::kFloat).contiguous();
  const int64_t N = pos.size(0), half = inv.size(0), D = 2 * half;
  auto cos = at::empty({N, D}, inv.options()), sin = at::empty({N, D}, inv.options());
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* ip = inv.data_ptr<float>();
  float* cp = cos.data_ptr<float>();
  float* sp = sin.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t i = 0; i < half; ++i) {
        const float f = static_cast<float>(pp[n]) * ip[i];
        const float c = std::cos(f), s = std::sin(f);
        cp[n * D + i] = cp[n * D + half + i] = c;
        sp[n * D + i] = -s;
        sp[n * D + half + i] = s;
      }
    }
  });
  return {cos, sin};
}

// Causal attention of q [Nq, Hq, D] over a paged cache k/v [num_blocks, block_size, Hkv, D]. Sequence s has the
// queries cu_seqlens_q[s]..cu_seqlens_q[s+1] (the last of its context_lens[s] tokens: bottom-right causal) and
// its keys through block_tables[s]. Per (query, head): scores, their max, exp, the sum of the exps and the
// weighted sum of values, each over the keys in position order. A training batch is the same call with one
// block of T tokens per sequence.
at::Tensor bi_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& cu_in, const at::Tensor& ctx_in, const at::Tensor& bt_in, double scale) {
  check_cpu(q_in, "q");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "bi_attention: q [N, Hq, D], caches [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "bi_attention: caches must be contiguous");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type(), "bi_attention: q and the cache must share a dtype");
  auto q = q_in.contiguous();
  auto cu = cu_in.to(at::kLong).contiguous(), ctx = ctx_in.to(at::kLong).contiguous();
  auto bt = bt_in.to(at::kLong).contiguous();
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t S = ctx.size(0), width = bt.size(1);
  TORCH_CHECK(cu.size(0) == S + 1 && bt.size(0) == S && Hq % Hkv == 0 && k_cache.size(3) == D,
              "bi_attention: shapes do not fit");
  const int64_t group = Hq / Hkv;
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* ctxp = ctx.data_ptr<int64_t>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  std::vector<int64_t> seq_of(N, -1);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = cup[s]; i < cup[s + 1]; ++i) seq_of[i] = s;
  auto out = at::zeros_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "bi_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N * Hq, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc(D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / Hq, h = i % Hq, s = seq_of[n];
        if (s < 0) continue;
        const int64_t qlen = cup[s + 1] - cup[s];
        const int64_t last = ctxp[s] - qlen + (n - cup[s]);  // this query's position: it sees keys 0..last
        if (last < 0) continue;
        const int64_t kvh = h / group;
        const scalar_t* qrow = qp + (n * Hq + h) * D;
        auto key = [&](const scalar_t* base, int64_t j) {
          return base + ((btp[s * width + j / bs] * bs + j % bs) * Hkv + kvh) * D;
        };
        scores.resize(last + 1);
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= last; ++j) {
          scores[j] = dot(qrow, key(kp, j), D) * static_cast<float>(scale);
          mx = std::max(mx, scores[j]);
        }
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j <= last; ++j) {
          const float p = std::exp(scores[j] - mx);
          sum += p;
          const scalar_t* vrow = key(vp, j);
          for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vrow[d]);
        }
        scalar_t* orow = op + (n * Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[d] / sum);
      }
    });
  });
  return out;
}

// Qwen3-MoE routing per row of logits [M, E]: fp32 softmax, the top k (the lower index first among equal
// probabilities; or the experts of topk_ids [M, k], replayed), renormalised to sum 1 when asked
// -> (weights [M, k] fp32, ids [M, k] int64)
std::tuple<at::Tensor, at::Tensor> bi_route_cpu(const at::Tensor& logits_in, int64_t k, bool renormalize,
                                                const std::optional<at::Tensor>& replay_in) {
  check_cpu(logits_in, "router_logits");
  TORCH_CHECK(logits_in.dim() == 2, "bi_route: router_logits [M, E]");
  auto logits = logits_in.to(at::kFloat).contiguous();
  const int64_t M = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "bi_route: top_k must be in [1, num_experts]");
  auto weights = at::empty({M, k}, logits.options());
  auto ids = at::empty({M, k}, logits.options().dtype(at::kLong));
  at::Tensor replay;
  if (replay_in.has_value() && replay_in->defined()) {
    replay = replay_in->to(at::kLong).contiguous();
    TORCH_CHECK(replay.dim() == 2 && replay.size(0) == M && replay.size(1) == k, "bi_route: topk_ids [M, k]");
  }
  const int64_t* rp = replay.defined() ? replay.data_ptr<int64_t>() : nullptr;
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(E);
    std::vector<char> taken(E);
    for (int64_t m = begin; m < end; ++m) {
      const float* row = lp + m * E;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, row[e]);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(row[e] - mx));
      for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
      std::fill(taken.begin(), taken.end(), 0);
      float kept = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        if (rp) {
          best = rp[m * k + j];
          TORCH_CHECK(best >= 0 && best < E, "bi_route: replayed expert id out of range");
        } else {
          for (int64_t e = 0; e < E; ++e)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        }
        taken[best] = 1;
        ip[m * k + j] = best;
        wp[m * k + j] = probs[best];
        kept += probs[best];
      }
      if (renormalize)
        for (int64_t j = 0; j < k; ++j) wp[m * k + j] /= kept;
    }
  });
  return {weights, ids};
}

// The routed experts of each token of x [M, H], one token at a time: for j = 0..k-1 in order, expert ids[m, j]'s
// SwiGLU (gate_up [E, 2I, H], gate rows first; down [E, H, I]) rounded to the dtype as the layers round, added
// to an fp32 sum with weight weights[m, j] -> [M, H] in x's dtype
at::Tensor bi_moe_cpu(const at::Tensor& x_in, const at::Tensor& wgu_in, const at::Tensor& wd_in,
                      const at::Tensor& w_in, const at::Tensor& ids_in) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.dim() == 2 && wgu_in.dim() == 3 && wd_in.dim() == 3, "bi_moe: x [M, H], weights [E, 2I, H], [E, H, I]");
  TORCH_CHECK(x_in.scalar_type() == wgu_in.scalar_type() && x_in.scalar_type() == wd_in.scalar_type(),
              "bi_moe: x and the expert weights must share a dtype");
  auto x = x_in.contiguous(), wgu = wgu_in.contiguous(), wd = wd_in.contiguous();
  auto tw = w_in.to(at::kFloat).contiguous();
  auto ids = ids_in.to(at::kLong).contiguous();
  const int64_t M = x.size(0), H = x.size(1), E = wgu.size(0), I = wgu.size(1) / 2, k = ids.size(1);
  TORCH_CHECK(wgu.size(2) == H && wd.size(0) == E && wd.size(1) == H && wd.size(2) == I && ids.size(0) == M &&
              tw.sizes() == ids.sizes(), "bi_moe: shapes do not fit");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bi_moe", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gup = wgu.data_ptr<scalar_t>();
    const scalar_t* dp = wd.data_ptr<scalar_t>();
    const float* twp = tw.data_ptr<float>();
    const int64_t* idp = ids.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> act(I);
      std::vector<float> acc(H);
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* row = xp + m * H;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t e = idp[m * k + j];
          TORCH_CHECK(e >= 0 && e < E, "bi_moe: expert id out of range");
          const scalar_t* gu = gup + e * 2 * I * H;
          for (int64_t i = 0; i < I; ++i) {
            const scalar_t g = static_cast<scalar_t>(dot(row, gu + i * H, H));
            const scalar_t u = static_cast<scalar_t>(dot(row, gu + (I + i) * H, H));
            const scalar_t s = static_cast<scalar_t>(silu(static_cast<float>(g)));
            act[i] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(u));
          }
          const scalar_t* down = dp + e * H * I;
          const float weight = twp[m * k + j];
          for (int64_t h = 0; h < H; ++h)
            acc[h] += weight * static_cast<float>(static_cast<scalar_t>(dot(down + h * I, act.data(), I)));
        }
        for (int64_t h = 0; h < H; ++h) op[m * H + h] = static_cast<scalar_t>(acc[h]);
      }
    });
  });
  return out;
}

// log_softmax of each row of x [M, V] fp32: x - (max + log(sum exp(x - max))), the sum in vocabulary order
at::Tensor bi_log_softmax_cpu(const at::Tensor& x_in) {
  check_cpu(x_in, "logits");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "bi_log_softmax: fp32 logits [M, V]");
  auto x = x_in.contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = xp + m * V;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v]);
      float sum = 0.f;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
      const float lse = mx + std::log(sum);
      for (int64_t v = 0; v < V; ++v) op[m * V + v] = row[v] - lse;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("bi_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("bi_rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("bi_silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("bi_rope(Tensor positions, Tensor inv_freq) -> (Tensor, Tensor)");
  m.def("bi_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor context_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.def("bi_route(Tensor router_logits, int top_k, bool renormalize, Tensor? topk_ids) -> (Tensor, Tensor)");
  m.def("bi_moe(Tensor x, Tensor w_gate_up, Tensor w_down, Tensor topk_weights, Tensor topk_ids) -> Tensor");
  m.def("bi_log_softmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) {
  m.impl("bi_linear", &bi_linear_cpu);
  m.impl("bi_rms_norm", &bi_rms_norm_cpu);
  m.impl("bi_silu_mul", &bi_silu_mul_cpu);
  m.impl("bi_rope", &bi_rope_cpu);
  m.impl("bi_attention", &bi_attention_cpu);
  m.impl("bi_route", &bi_route_cpu);
  m.impl("bi_moe", &bi_moe_cpu);
  m.impl("bi_log_softmax", &bi_log_softmax_cpu);
}
