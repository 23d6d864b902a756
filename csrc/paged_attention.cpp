// Paged-KV attention on the CPU: the decoder's CPU path (same contract as kernels/attention/reference.py).
//
// paged_attention: q [N, Hq, D] holds the new tokens of S sequences (cu_seqlens_q [S + 1]; None: one per
// sequence, i.e. decode); query i of a sequence with q_len new tokens sits at position
// context_len - q_len + i and sees the cached positions <= its own (causal, bottom-right aligned). K/V are
// read in place from the paged cache [num_blocks, block_size, Hkv, D] through block_tables [S, W]: no
// gathered copy. One task = (sequence, tile of queries, kv heads: all, or one when tasks are too few for
// the threads); the GQA group's query heads are rows of the task, so one pass over K/V serves the group.
// Online softmax in fp32 per cache block; fp32, bf16 and fp16 caches (a 16-bit block is widened to fp32
// once per task); exp by a vectorised polynomial (relative error ~1e-7). context_len 0: output 0 (as Triton).
//
// store_kvcache: k/v [N, Hkv, D] into the caches at flat slots (slot -1: a padded row, skipped).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;  // query tokens of one sequence per task (a prefill chunk is split)

struct Task {
  int64_t seq, h0, h1, t0, t1;  // queries [t0, t1) of sequence seq, kv heads [h0, h1)
};

struct Problem {
  const float* q;  // [N, Hq, D] fp32
  float* out;      // [N, Hq, D] fp32
  const int* cu;   // [S + 1] or nullptr (decode)
  const int* ctx;  // [S]
  const int* tables;
  int64_t table_width, hq, hkv, d, block_size;
  float scale;
};

// The hot loop: an AVX2 + FMA clone picked at load time (simd.h). AVX-512 measured slower here.

#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
#define LIVEMOE_HAS_BIT_CAST 1
#endif
#endif

inline float float_from_bits(int32_t bits) {
#ifdef LIVEMOE_HAS_BIT_CAST
  return __builtin_bit_cast(float, bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// exp(x) for the scores minus their running maximum (x <= 0), over an array so that it vectorises: Cephes'
// expf (round x / ln 2 by the 1.5 * 2^23 trick, a degree-6 polynomial, 2^k through the exponent bits);
// relative error ~1e-7. Below -87 (exp < 2^-126) it returns ~1e-38 instead of 0: nothing a sum notices.
inline float exp_sum_inplace(float* x, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.f);
    const float k = (v * 1.44269504f + 12582912.f) - 12582912.f;
    const float r = v - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const float e = p * float_from_bits((static_cast<int32_t>(k) + 127) << 23);
    x[i] = e;
    sum += e;
  }
  return sum;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One task: the query rows of tokens [t0, t1) and kv heads [h0, h1) of one sequence, row r = (token t0 +
// r / (nh * group), kv head h0 + (r / group) % nh, its query head r % group within the GQA group). A cache
// block is read once, front to back (a token's kv heads are adjacent), for all of them.
// kD: the head size at compile time (0: p.d at run time).
template <typename scalar_t, int64_t kD>
LIVEMOE_SIMD_CLONES void attend(const Problem& p, const Task& task, const scalar_t* k_cache, const scalar_t* v_cache,
                                std::vector<float>& buf) {
  const int64_t d = kD ? kD : p.d, bs = p.block_size, group = p.hq / p.hkv, nh = task.h1 - task.h0;
  const int64_t first = p.cu ? p.cu[task.seq] : task.seq;
  const int64_t q_len = p.cu ? p.cu[task.seq + 1] - first : 1;
  const int64_t ctx = p.ctx[task.seq];
  const int64_t per_token = nh * group;
  const int64_t rows = (task.t1 - task.t0) * per_token;
  const int64_t token_stride = p.hkv * d;  // between consecutive tokens of a cache block
  constexpr bool kWiden = !std::is_same_v<scalar_t, float>;
  buf.assign(rows * d + 2 * rows + bs + (kWiden ? 2 * bs * nh * d : 0), 0.f);
  float* acc = buf.data();
  float* m = acc + rows * d;
  float* l = m + rows;
  float* s = l + rows;  // [bs] scores of one row
  float* kw = s + bs;   // [bs, nh, d] widened block (16-bit caches)
  float* vw = kw + bs * nh * d;
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  const int* table = p.tables + task.seq * p.table_width;
  const int64_t pos0 = ctx - q_len;        // position of the sequence's first new token
  const int64_t num_keys = pos0 + task.t1;  // the tile's last query sees keys [0, num_keys)
  for (int64_t b0 = 0; b0 < num_keys; b0 += bs) {
    const int64_t n = std::min(bs, num_keys - b0);
    const int64_t base = (static_cast<int64_t>(table[b0 / bs]) * bs * p.hkv + task.h0) * d;
    const float *kb, *vb;
    int64_t kstride;
    if constexpr (kWiden) {
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < nh * d; ++i) {
          kw[j * nh * d + i] = static_cast<float>(k_cache[base + j * token_stride + i]);
          vw[j * nh * d + i] = static_cast<float>(v_cache[base + j * token_stride + i]);
        }
      kb = kw, vb = vw, kstride = nh * d;
    } else {
      kb = k_cache + base, vb = v_cache + base, kstride = token_stride;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = task.t0 + r / per_token;
      const int64_t visible = std::min(n, pos0 + t + 1 - b0);  // causal: keys at positions <= pos0 + t
      if (visible <= 0) continue;
      const int64_t h = (r / group) % nh;  // kv head, relative to h0
      const float* qr = p.q + ((first + t) * p.hq + (task.h0 + h) * group + r % group) * d;
      const float* kh = kb + h * d;
      const float* vh = vb + h * d;
      float* sr = s;
      float mx = m[r];
      for (int64_t j = 0; j < visible; ++j) {
        sr[j] = dot(qr, kh + j * kstride, d) * p.scale;
        mx = std::max(mx, sr[j]);
      }
      float* ar = acc + r * d;
      if (mx > m[r]) {  // rescale what was accumulated under the old maximum
        const float corr = std::exp(m[r] - mx);
        l[r] *= corr;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] *= corr;
        m[r] = mx;
      }
      for (int64_t j = 0; j < visible; ++j) sr[j] -= mx;
      const float sum = exp_sum_inplace(sr, visible);
      for (int64_t j = 0; j < visible; ++j) {
        const float e = sr[j];
        const float* vr = vh + j * kstride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ar[i] += e * vr[i];
      }
      l[r] += sum;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = task.t0 + r / per_token;
    const int64_t h = task.h0 + (r / group) % nh;
    float* o = p.out + ((first + t) * p.hq + h * group + r % group) * d;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // l == 0: no key (context_len 0)
    for (int64_t i = 0; i < d; ++i) o[i] = acc[r * d + i] * inv;
  }
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "paged attention: k_cache must be [num_blocks, block_size, Hkv, D], got ",
              k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged attention: v_cache ", v_cache.sizes(), " ", v_cache.scalar_type(), " must match k_cache ",
              k_cache.sizes(), " ", k_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged attention: the caches must be contiguous");
  auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "paged attention: cache dtype must be float32, bfloat16 or float16, got ", dt);
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const std::optional<at::Tensor>& cu_seqlens_q, const at::Tensor& context_lens,
                               const at::Tensor& block_tables, double scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k_cache.size(3), "paged_attention: q must be [N, Hq, D] with D = ",
              k_cache.size(3), ", got ", q.sizes());
  const int64_t num_seqs = context_lens.numel(), hq = q.size(1), hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(hq % hkv == 0, "paged_attention: Hq (", hq, ") must be a multiple of Hkv (", hkv, ")");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
              "paged_attention: block_tables must be [S, W] with S = ", num_seqs, ", got ", block_tables.sizes());
  auto ctx = context_lens.contiguous().to(at::kInt);
  auto tables = block_tables.contiguous().to(at::kInt);
  at::Tensor cu;
  if (cu_seqlens_q.has_value()) {
    cu = cu_seqlens_q->contiguous().to(at::kInt);
    TORCH_CHECK(cu.numel() == num_seqs + 1, "paged_attention: cu_seqlens_q must have S + 1 = ", num_seqs + 1,
                " entries, got ", cu.numel());
  }
  const int* cu_p = cu.defined() ? cu.data_ptr<int>() : nullptr;
  const int* ctx_p = ctx.data_ptr<int>();
  const int* tab_p = tables.data_ptr<int>();
  const int64_t width = tables.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(q.size(0) == (cu_p ? cu_p[num_seqs] : num_seqs), "paged_attention: q has ", q.size(0),
              " rows, cu_seqlens_q says ", cu_p ? cu_p[num_seqs] : num_seqs);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu_p ? cu_p[s + 1] - cu_p[s] : 1;
    const int64_t c = ctx_p[s];
    TORCH_CHECK(q_len >= 0 && (c == 0 || q_len <= c), "paged_attention: sequence ", s, " has ", q_len,
                " new tokens but context_len ", c);
    if (c == 0 || q_len == 0) continue;  // no keys: the output rows stay 0
    const int64_t used = (c + bs - 1) / bs;
    TORCH_CHECK(used <= width, "paged_attention: sequence ", s, " needs ", used, " blocks, block_tables has ", width);
    for (int64_t b = 0; b < used; ++b) {
      const int id = tab_p[s * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: sequence ", s, " block ", b, " is ", id,
                  ", outside [0, ", num_blocks, ")");
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) tasks.push_back({s, 0, hkv, t0, std::min(q_len, t0 + kQueryTile)});
  }
  // all kv heads per task reads each cache block front to back once; split the heads over tasks only when
  // there are too few (sequence, query tile) tasks to keep the threads busy (a long decode at small batch)
  if (hkv > 1 && static_cast<int64_t>(tasks.size()) < 4 * at::get_num_threads()) {
    std::vector<Task> split;
    for (const Task& t : tasks)
      for (int64_t h = 0; h < hkv; ++h) split.push_back({t.seq, h, h + 1, t.t0, t.t1});
    tasks.swap(split);
  }
  auto qf = q.contiguous().to(at::kFloat);
  auto out = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  Problem p{qf.data_ptr<float>(), out.data_ptr<float>(), cu_p, ctx_p, tab_p, width, hq, hkv, q.size(2), bs,
            static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      auto run = [&](auto attend_fn) {
        for (int64_t i = begin; i < end; ++i) attend_fn(p, tasks[i], kc, vc, buf);
      };
      switch (p.d) {  // the common head sizes at compile time: the loops over d unroll and vectorise
        case 16: run(attend<scalar_t, 16>); break;
        case 32: run(attend<scalar_t, 32>); break;
        case 64: run(attend<scalar_t, 64>); break;
        case 128: run(attend<scalar_t, 128>); break;
        default: run(attend<scalar_t, 0>);
      }
    });
  });
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

void store_kvcache_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3), row = hkv * d;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == hkv && k.size(2) == d && v.sizes() == k.sizes(),
              "store_kvcache: k and v must be [N, ", hkv, ", ", d, "], got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0), "store_kvcache: slot_mapping must be [",
              k.size(0), "], got ", slot_mapping.sizes());
  auto kc = k.contiguous().to(k_cache.scalar_type());
  auto vc = v.contiguous().to(k_cache.scalar_type());
  auto slots = slot_mapping.contiguous().to(at::kLong);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n = k.size(0), bytes = row * k_cache.element_size();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sl[i] >= -1 && sl[i] < num_slots, "store_kvcache: slot ", sl[i], " of row ", i, " is outside [-1, ",
                num_slots, ")");
  auto* kdst = static_cast<char*>(k_cache.data_ptr());
  auto* vdst = static_cast<char*>(v_cache.data_ptr());
  const auto* ksrc = static_cast<const char*>(kc.data_ptr());
  const auto* vsrc = static_cast<const char*>(vc.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (sl[i] < 0) continue;
    std::memcpy(kdst + sl[i] * bytes, ksrc + i * bytes, bytes);
    std::memcpy(vdst + sl[i] * bytes, vsrc + i * bytes, bytes);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(livemoe, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? cu_seqlens_q, Tensor context_lens, "
        "Tensor block_tables, float scale) -> Tensor");
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(livemoe, CPU, m) {
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("store_kvcache", &store_kvcache_cpu);
}
