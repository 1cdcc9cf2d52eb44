// Decode attention over a paged KV cache, for CPUs.
//
// One query token per sequence attends to its first seq_len cached tokens, read in
// place through the block table: no gather, each K/V row is read once and shared by
// the G query heads of its KV head. Online softmax in fp32. Work is split over
// (sequence, kv head) pairs with ATen's thread pool.
//
//   q            [B, H, D]                      rows (H, D) contiguous, any batch stride
//   k/v cache    [num_blocks, block, KVH, D]    any strides, last dim contiguous
//   block_table  [B, max_blocks]                int32 or int64
//   seq_lens     [B]                            int32 or int64
//   out          [B, H, D]                      contiguous, same dtype as q
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// 16 fp32 lanes via GCC/Clang vector extensions: AVX-512 where the CPU has it,
// pairs of AVX2/NEON registers elsewhere.
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline v16f load16(const c10::BFloat16* p) {
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline v16f load16(const c10::Half* p) {
  float tmp[W];
  for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}
inline float hsum(v16f v) {
  float s = 0.f;
  for (int64_t i = 0; i < W; ++i) s += v[i];
  return s;
}

template <typename T, typename I>
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
            const at::Tensor& table, const at::Tensor& lens, double scale_d,
            int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH, C = D / W;
  const int64_t ksb = kc.stride(0), kst = kc.stride(1), ksh = kc.stride(2);
  const int64_t vsb = vc.stride(0), vst = vc.stride(1), vsh = vc.stride(2);
  const int64_t tstride = table.stride(0), qs = q.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const I* tp = table.data_ptr<I>();
  const I* lp = lens.data_ptr<I>();
  T* op = out.data_ptr<T>();
  const float scale = static_cast<float>(scale_d);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<v16f> qv(G * C), acc(G * C), row(C);
    std::vector<float> m(G), l(G), p(G * bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = static_cast<int64_t>(lp[b]);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t g = 0; g < G; ++g) {
        const T* qrow = qp + b * qs + (h * G + g) * D;
        for (int64_t c = 0; c < C; ++c) {
          qv[g * C + c] = load16(qrow + c * W) * scale;
          acc[g * C + c] = v16f{};
        }
        m[g] = neg_inf;
        l[g] = 0.f;
      }
      for (int64_t j = first / bs; j * bs < len; ++j) {
        const int64_t blk = static_cast<int64_t>(tp[b * tstride + j]);
        const int64_t t0 = std::max<int64_t>(first - j * bs, 0);
        const int64_t t1 = std::min<int64_t>(len - j * bs, bs);
        const T* kb = kp + blk * ksb + h * ksh;
        const T* vb = vp + blk * vsb + h * vsh;
        for (int64_t t = t0; t < t1; ++t) {
          const T* kr = kb + t * kst;
          for (int64_t c = 0; c < C; ++c) row[c] = load16(kr + c * W);
          for (int64_t g = 0; g < G; ++g) {
            v16f s = qv[g * C] * row[0];
            for (int64_t c = 1; c < C; ++c) s += qv[g * C + c] * row[c];
            p[g * bs + t] = hsum(s);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float mx = m[g];
          for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, p[g * bs + t]);
          const float corr = std::exp(m[g] - mx);
          float sum = l[g] * corr;
          for (int64_t t = t0; t < t1; ++t) {
            const float e = std::exp(p[g * bs + t] - mx);
            p[g * bs + t] = e;
            sum += e;
          }
          m[g] = mx;
          l[g] = sum;
          if (corr != 1.f)
            for (int64_t c = 0; c < C; ++c) acc[g * C + c] *= corr;
        }
        for (int64_t t = t0; t < t1; ++t) {
          const T* vr = vb + t * vst;
          for (int64_t c = 0; c < C; ++c) row[c] = load16(vr + c * W);
          for (int64_t g = 0; g < G; ++g) {
            const float w = p[g * bs + t];
            for (int64_t c = 0; c < C; ++c) acc[g * C + c] += w * row[c];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        T* o = op + (b * H + h * G + g) * D;
        for (int64_t c = 0; c < C; ++c) {
          const v16f a = acc[g * C + c] * inv;
          for (int64_t i = 0; i < W; ++i) o[c * W + i] = static_cast<T>(a[i]);
        }
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [B, H, D] with each token's heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() &&
                  out.scalar_type() == q.scalar_type(),
              "out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [blocks, block, KVH, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head dims differ");
  TORCH_CHECK(q.size(2) % W == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
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
#define DISPATCH_INDEX(T)                                                                   \
  if (idx == at::kInt)                                                                     \
    decode<T, int32_t>(q, k_cache, v_cache, block_table, seq_lens, scale, window, out);    \
  else                                                                                     \
    decode<T, int64_t>(q, k_cache, v_cache, block_table, seq_lens, scale, window, out);
  switch (q.scalar_type()) {
    case at::kFloat: { DISPATCH_INDEX(float) break; }
    case at::kBFloat16: { DISPATCH_INDEX(c10::BFloat16) break; }
    case at::kHalf: { DISPATCH_INDEX(c10::Half) break; }
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
#undef DISPATCH_INDEX
}

}  // namespace

TORCH_LIBRARY(diptych_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
