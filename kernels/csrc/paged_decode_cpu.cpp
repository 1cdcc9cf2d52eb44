// Decode attention over a paged KV cache, for CPUs.
//
// One query token per sequence attends to its first seq_len cached tokens, read in
// place through the block table: no gather, each K/V row is read once and shared by
// the G query heads of its KV head. Online softmax in fp32. Three kernels share one
// driver (paged_decode_driver.h: the work items, the walk over their blocks, the
// prefetch of the next block): bf16 dot products (paged_decode_dpbf16.h), fp32 at
// the native vector width (paged_decode_wide.h), and the generic one below, which
// also reads the int8 and fp8 caches (rows of D codes and an fp16 scale,
// kernels/kv_quant.py):
// q . (s k) = s (q . k) and p (s v) = (p s) v, so a row's scale multiplies its score,
// and its probability before the P @ V update.
//
//   q            [B, H, D]                      rows (H, D) contiguous, any batch stride
//   k/v cache    [num_blocks, block, KVH, D]    any strides, last dim contiguous
//                (int8 / fp8: [num_blocks, block, KVH, D + 2], each head's row contiguous)
//   block_table  [B, max_blocks]                int32 or int64
//   seq_lens     [B]                            int32 or int64
//   out          [B, H, D]                      contiguous, same dtype as q
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_args.h"
#include "ops_cpu.h"

#include "paged_decode_dpbf16.h"
#include "paged_decode_wide.h"
#include "vec16.h"

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace dvec;

// The scale of a cache row of D values: 1 for float caches, the fp16 after the codes
// for int8 and fp8 ones.
template <typename KV>
inline float row_scale(const KV* row, int64_t D) {
  if constexpr (sizeof(KV) == 1) {
    c10::Half s;
    std::memcpy(&s, row + D, sizeof(s));
    return static_cast<float>(s);
  } else {
    return 1.f;
  }
}

// The generic kernel, for every shape and dtype the register-tiled ones do not take
// (any GQA group, head dims that are multiples of 16 up to 256, fp16, int8 and fp8
// caches):
// 16-lane vectors whatever the CPU, accumulators in memory. Per block and KV head:
// scores for runs of up to 16 tokens reduced sixteen at a time, the online-softmax
// update, then P @ V.
template <typename T, typename KV = T>
struct GenericWorker {
  int64_t G, D, C, R, bs;
  float scale;
  std::vector<v16f> qv, acc, part;  // [R][C], [R][C], [G][16]
  std::vector<float> m, l, p;       // [R], [R], [R][bs]
  v16f row[16];

  GenericWorker(int64_t hs, int64_t G_, int64_t D_, int64_t bs_, float scale_)
      : G(G_), D(D_), C(D_ / W), R(hs * G_), bs(bs_), scale(scale_), qv(R * C), acc(R * C),
        part(G_ * W), m(R), l(R), p(R * bs_) {}

  void begin(const T* q) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        qv[r * C + c] = load16(q + r * D + c * W) * scale;
        acc[r * C + c] = v16f{};
      }
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.f;
    }
  }

  void block(int64_t hh, const KV* kb, const KV* vb, int64_t kst, int64_t vst, int64_t t0,
             int64_t t1, pattn::Prefetcher& pf) {
    const int64_t r0 = hh * G;
    for (int64_t c0 = t0; c0 < t1; c0 += W) {
      const int64_t c1 = std::min<int64_t>(c0 + W, t1);
      for (int64_t t = c0; t < c1; ++t) {
        pf.step(pattn::kStep);
        for (int64_t c = 0; c < C; ++c) row[c] = load16(kb + t * kst + c * W);
        for (int64_t g = 0; g < G; ++g) {
          const v16f* qr = qv.data() + (r0 + g) * C;
          v16f s = qr[0] * row[0];
          for (int64_t c = 1; c < C; ++c) s += qr[c] * row[c];
          part[g * W + (t - c0)] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        v16f* pr = part.data() + g * W;
        for (int64_t t = c1 - c0; t < W; ++t) pr[t] = v16f{};
        const v16f sums = hsum16(pr);
        for (int64_t t = c0; t < c1; ++t)
          p[(r0 + g) * bs + t] = sums[t - c0] * row_scale(kb + t * kst, D);
      }
    }
    // online softmax over this block, 16 scores at a time
    const int64_t nt = t1 - t0;
    for (int64_t r = r0; r < r0 + G; ++r) {
      float* sc = p.data() + r * bs + t0;
      float mx = m[r];
      for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, sc[t]);
      const float corr = std::exp(m[r] - mx);
      v16f vsum = v16f{};
      int64_t t = 0;
      for (; t + W <= nt; t += W) {
        const v16f e = vexp(load16(sc + t) - mx);
        store16(sc + t, e);
        vsum += e;
      }
      float sum = l[r] * corr + hsum(vsum);
      for (; t < nt; ++t) {
        sc[t] = std::exp(sc[t] - mx);
        sum += sc[t];
      }
      m[r] = mx;
      l[r] = sum;
      if (corr != 1.f)
        for (int64_t c = 0; c < C; ++c) acc[r * C + c] *= corr;
    }
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < C; ++c) row[c] = load16(vb + t * vst + c * W);
      const float vs = row_scale(vb + t * vst, D);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = r0 + g;
        const float w = p[r * bs + t] * vs;
        for (int64_t c = 0; c < C; ++c) acc[r * C + c] += w * row[c];
      }
    }
  }

  void end(T* out) {
    for (int64_t r = 0; r < R; ++r) {
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t c = 0; c < C; ++c) store16(out + r * D + c * W, acc[r * C + c] * inv);
    }
  }
};

template <typename T, typename I, typename KV = T>
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
            const at::Tensor& table, const at::Tensor& lens, double scale, int64_t window,
            at::Tensor& out) {
  const int64_t G = q.size(1) / kc.size(2), D = q.size(2), bs = kc.size(1);
  const float s = static_cast<float>(scale);
  pattn::run_items<T, I, KV>(q, kc, vc, table, lens, window, out, [=](int64_t hs) {
    return GenericWorker<T, KV>(hs, G, D, bs, s);
  });
}

}  // namespace

namespace diptych_cpu {

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            at::Tensor out) {
  const auto [q8, f8] = dattn::check_query_and_caches("B", q, k_cache, v_cache, out);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
                  block_table.stride(1) == 1,
              "block_table must be [B, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "seq_lens must be contiguous [B]");
  TORCH_CHECK(block_table.scalar_type() == seq_lens.scalar_type(),
              "block_table and seq_lens must share an index dtype (int32 or int64)");
  TORCH_CHECK(!q.is_cuda(), "this kernel runs on CPU tensors");
  const auto idx = block_table.scalar_type();
  TORCH_CHECK(idx == at::kInt || idx == at::kLong, "index tensors must be int32 or int64");
#define DISPATCH_INDEX(T, KV)                                                                \
  if (idx == at::kInt)                                                                      \
    decode<T, int32_t, KV>(q, k_cache, v_cache, block_table, seq_lens, scale, window, out); \
  else                                                                                      \
    decode<T, int64_t, KV>(q, k_cache, v_cache, block_table, seq_lens, scale, window, out);
#define DISPATCH_CODES(KV)                                                  \
  switch (q.scalar_type()) {                                                \
    case at::kFloat: { DISPATCH_INDEX(float, KV) break; }                   \
    case at::kBFloat16: { DISPATCH_INDEX(c10::BFloat16, KV) break; }        \
    case at::kHalf: { DISPATCH_INDEX(c10::Half, KV) break; }                \
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());     \
  }                                                                         \
  return;
  if (q8) { DISPATCH_CODES(int8_t) }
  if (f8) { DISPATCH_CODES(c10::Float8_e4m3fn) }
#undef DISPATCH_CODES
  // DIPTYCH_ATTN_KERNEL=wide skips the bf16 dot-product kernel, =generic both
  // register-tiled ones (read per call, so tests can compare them)
  const char* which = std::getenv("DIPTYCH_ATTN_KERNEL");
  const int skip = !which ? 0 : which[0] == 'w' ? 1 : which[0] == 'g' ? 2 : 0;
  const float s = static_cast<float>(scale);
  const bool i32 = idx == at::kInt;
#ifdef DIPTYCH_HAVE_AVX512_BF16
  if (skip < 1 && q.scalar_type() == at::kBFloat16 &&
      (i32 ? dpattn::dispatch<int32_t>(q, k_cache, v_cache, block_table, seq_lens, s, window, out)
           : dpattn::dispatch<int64_t>(q, k_cache, v_cache, block_table, seq_lens, s, window, out)))
    return;
#endif
  if (skip < 2) {
#define WIDE(T)                                                                          \
  (i32 ? wattn::dispatch<T, int32_t>(q, k_cache, v_cache, block_table, seq_lens, s, window, out) \
       : wattn::dispatch<T, int64_t>(q, k_cache, v_cache, block_table, seq_lens, s, window, out))
    if (q.scalar_type() == at::kBFloat16 && WIDE(c10::BFloat16)) return;
    if (q.scalar_type() == at::kFloat && WIDE(float)) return;
#undef WIDE
  }
  switch (q.scalar_type()) {
    case at::kFloat: { DISPATCH_INDEX(float, float) break; }
    case at::kBFloat16: { DISPATCH_INDEX(c10::BFloat16, c10::BFloat16) break; }
    case at::kHalf: { DISPATCH_INDEX(c10::Half, c10::Half) break; }
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
#undef DISPATCH_INDEX
}

}  // namespace diptych_cpu


TORCH_LIBRARY(diptych_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("paged_decode_attention", &diptych_cpu::paged_decode_attention);
}
