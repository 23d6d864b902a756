// Paged-KV attention on the CPU: the decoder's CPU path (same contract as livemoe/kernels/attention/reference.py).
//
// paged_attention: q [N, Hq, D] holds the new tokens of S sequences (cu_seqlens_q [S + 1]; None: one per
// sequence, i.e. decode); query i of a sequence with q_len new tokens sits at position
// context_len - q_len + i and sees the cached positions <= its own (causal, bottom-right aligned). K/V are
// read in place from the paged cache [num_blocks, block_size, Hkv, D] through block_tables [S, W]: no
// gathered copy. One task = (sequence, tile of queries, kv heads: all, or one when tasks are too few for
// several threads); the GQA group's query heads and the tile's tokens are rows of the task, so one pass over
// K/V serves them all (a verification's k + 1 tokens too).
// A task walks its keys in chunks (the whole context of a short decode): all scores of a chunk, then the
// softmax with one rescale per chunk (online softmax across chunks, in fp32), then probabilities x V; the
// kernels are in attention_cpu.h (AVX2 + FMA where the CPU has it and D % 8 == 0, else portable C++).
// fp32, bf16 and fp16 caches (a 16-bit chunk is widened to fp32 once, all heads); exp by a vectorised
// polynomial (relative error ~1e-7). context_len 0: output 0 (as Triton).
//
// store_kvcache: k/v [N, Hkv, D] into the caches at flat slots (slot -1: a padded row, skipped).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "attention_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using livemoe_attn::Chunk;
using livemoe_attn::PortableKernels;

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

// Per thread, kept across calls (grown, never shrunk: bounded by the chunk sizes of attend).
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> off, woff, vis;
};

inline int64_t round_up8(int64_t n) { return (n + 7) & ~int64_t{7}; }
inline int64_t round_up16(int64_t n) { return (n + 15) & ~int64_t{15}; }

template <typename T>
T* grown(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(n);
  return v.data();
}

// One task: its query rows, row h * head_rows + t * group + g = (kv head h0 + h, token t0 + t, query head g of
// the GQA group); the keys [0, pos0 + t1) that its last token sees, in chunks.
// kD: the head size at compile time (0: p.d at run time).
template <class Kernels, typename scalar_t, int64_t kD>
void attend(const Problem& p, const Task& task, const scalar_t* k_cache, const scalar_t* v_cache, Scratch& sc) {
  constexpr bool kWiden = !std::is_same_v<scalar_t, float>;
  const int64_t d = kD ? kD : p.d, bs = p.block_size, group = p.hq / p.hkv, nh = task.h1 - task.h0;
  const int64_t first = p.cu ? p.cu[task.seq] : task.seq;
  const int64_t q_len = p.cu ? p.cu[task.seq + 1] - first : 1;
  const int64_t tokens = task.t1 - task.t0, head_rows = tokens * group, rows = nh * head_rows;
  const int64_t pos0 = p.ctx[task.seq] - q_len;  // position of the sequence's first new token
  const int64_t num_keys = pos0 + task.t1;
  // keys per chunk, a multiple of 8: scores [rows, chunk] within ~32 KiB, a widened K + V chunk ~256 KiB. Sized
  // by all Hkv heads, not the task's: a row's sums then do not depend on whether the heads were split over
  // tasks (which depends on the thread count). Float divisions: an integer one per task shows at decode.
  const float all_rows = static_cast<float>(p.hkv * head_rows);
  int64_t chunk = std::max<int64_t>(static_cast<int64_t>(8192.f / all_rows), 32);
  if (kWiden) chunk = std::min(chunk, std::max<int64_t>(static_cast<int64_t>(32768.f / static_cast<float>(p.hkv * d)), 32));
  chunk = std::min(chunk & ~int64_t{7}, round_up8(num_keys));
  // the float buffers at 64-byte boundaries (a vector load then never splits a cache line)
  const int64_t lds = chunk, wide = kWiden ? nh * chunk * d : 0, qd = round_up16(rows * d), rr = round_up16(rows);
  float* qs = grown(sc.f, 2 * qd + 2 * rr + round_up16(rows * lds) + 2 * wide + 16);  // [rows, d] queries x scale
  qs += (64 - reinterpret_cast<uintptr_t>(qs) % 64) % 64 / sizeof(float);
  float* acc = qs + qd;   // [rows, d]
  float* m = acc + qd;    // [rows]
  float* l = m + rr;
  float* s = l + rr;      // [rows, lds]
  float* wk = s + round_up16(rows * lds);  // [nh, chunk, d] widened K / V (16-bit caches)
  float* wv = wk + wide;
  int64_t* vis = grown(sc.vis, head_rows);
  const int64_t token_stride = p.hkv * d;  // between consecutive tokens of a cache block
  for (int64_t t = 0; t < tokens; ++t) {  // a token's query heads of kv heads [h0, h1) are adjacent
    const float* src = p.q + ((first + task.t0 + t) * p.hq + task.h0 * group) * d;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t x = 0; x < group * d; ++x) qs[(h * head_rows + t * group) * d + x] = src[h * group * d + x] * p.scale;
  }
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  // cache offset of every key's row (kv head h0), padded to a multiple of 8 with the last key
  int64_t* off = grown(sc.off, round_up8(num_keys));
  const int* table = p.tables + task.seq * p.table_width;
  for (int64_t j0 = 0, b = 0; j0 < num_keys; j0 += bs, ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs * token_stride + task.h0 * d;
    const int64_t n = std::min(bs, num_keys - j0);
    for (int64_t j = 0; j < n; ++j) off[j0 + j] = base + j * token_stride;
  }
  std::fill(off + num_keys, off + round_up8(num_keys), off[num_keys - 1]);
  int64_t* woff = nullptr;
  if (kWiden) {
    woff = grown(sc.woff, chunk);
    for (int64_t j = 0; j < chunk; ++j) woff[j] = j * d;
  }
  for (int64_t c0 = 0; c0 < num_keys; c0 += chunk) {
    const int64_t n = std::min(chunk, num_keys - c0);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t v = std::clamp<int64_t>(pos0 + task.t0 + t + 1 - c0, 0, n);  // causal
      for (int64_t g = 0; g < group; ++g) vis[t * group + g] = v;
    }
    Chunk c{qs, nh, head_rows, d, nullptr, nullptr, 0, off + c0, n, vis, s, lds, m, l, acc};
    if constexpr (kWiden) {
      Kernels::widen(k_cache, off + c0, round_up8(n), nh, d, wk, chunk * d);
      Kernels::widen(v_cache, off + c0, round_up8(n), nh, d, wv, chunk * d);
      c.k = wk, c.v = wv, c.head_stride = chunk * d, c.off = woff;
    } else {
      c.k = k_cache, c.v = v_cache, c.head_stride = d;
    }
    Kernels::template attend_chunk<kD>(c);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    float* dst = p.out + ((first + task.t0 + t) * p.hq + task.h0 * group) * d;
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = h * head_rows + t * group + g;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t x = 0; x < d; ++x) dst[(h * group + g) * d + x] = acc[r * d + x] * inv;
      }
  }
}

// tasks [begin, end) with the kernels' head-size specialisations: the common head sizes at compile time
template <class Kernels, typename scalar_t>
void run_tasks(const Problem& p, const std::vector<Task>& tasks, int64_t begin, int64_t end, const scalar_t* kc,
               const scalar_t* vc, Scratch& sc) {
  auto run = [&](auto attend_fn) {
    for (int64_t i = begin; i < end; ++i) attend_fn(p, tasks[i], kc, vc, sc);
  };
  switch (p.d) {
    case 16: run(attend<Kernels, scalar_t, 16>); break;
    case 32: run(attend<Kernels, scalar_t, 32>); break;
    case 64: run(attend<Kernels, scalar_t, 64>); break;
    case 128: run(attend<Kernels, scalar_t, 128>); break;
    default: run(attend<Kernels, scalar_t, 0>);
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
  auto qf = q.contiguous().to(at::kFloat);
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  const int64_t row_elems = hq * q.size(2);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu_p ? cu_p[s + 1] - cu_p[s] : 1;
    const int64_t c = ctx_p[s];
    TORCH_CHECK(q_len >= 0 && (c == 0 || q_len <= c), "paged_attention: sequence ", s, " has ", q_len,
                " new tokens but context_len ", c);
    if (c == 0 || q_len == 0) {  // no keys: output 0 (every other row is written by its task)
      const int64_t first = cu_p ? cu_p[s] : s;
      std::fill(out.data_ptr<float>() + first * row_elems, out.data_ptr<float>() + (first + q_len) * row_elems, 0.f);
      continue;
    }
    const int64_t used = (c + bs - 1) / bs;
    TORCH_CHECK(used <= width, "paged_attention: sequence ", s, " needs ", used, " blocks, block_tables has ", width);
    for (int64_t b = 0; b < used; ++b) {
      const int id = tab_p[s * width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_attention: sequence ", s, " block ", b, " is ", id,
                  ", outside [0, ", num_blocks, ")");
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) tasks.push_back({s, 0, hkv, t0, std::min(q_len, t0 + kQueryTile)});
  }
  // all kv heads per task reads each cache block front to back once (a token's rows of all heads are
  // adjacent); split the heads over tasks only when there are too few (sequence, query tile) tasks to keep
  // several threads busy (a long decode at small batch). One thread: never, the split only adds strided reads.
  const int64_t threads = at::get_num_threads();
  if (hkv > 1 && threads > 1 && static_cast<int64_t>(tasks.size()) < 4 * threads) {
    std::vector<Task> split;
    for (const Task& t : tasks)
      for (int64_t h = 0; h < hkv; ++h) split.push_back({t.seq, h, h + 1, t.t0, t.t1});
    tasks.swap(split);
  }
  Problem p{qf.data_ptr<float>(), out.data_ptr<float>(), cu_p, ctx_p, tab_p, width, hq, hkv, q.size(2), bs,
            static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch sc;
#ifdef LIVEMOE_X86_AVX2
      if (use_avx2() && p.d % 8 == 0) {
        run_tasks<livemoe_attn::Avx2Kernels>(p, tasks, begin, end, kc, vc, sc);
        return;
      }
#endif
      run_tasks<PortableKernels>(p, tasks, begin, end, kc, vc, sc);
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
