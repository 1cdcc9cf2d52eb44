// bf16 weights, fp32 arithmetic: y[M, N] = x[M, K] @ W[N, K]^T on any CPU.
//
// For CPUs without bf16 dot products (AVX2, AVX-512 without BF16, NEON): the weight
// stays bf16 in memory (half the bytes of fp32; decode streams it every step) and is
// widened in registers, where bf16 -> fp32 is a 16-bit shift. Written with GCC
// vector extensions, so the same code compiles to whatever the build's -march
// allows: 256-bit FMAs for avx2, 512-bit for avx512, SSE2 or NEON for generic.
//
// Packed layout (`pack_f32acc`), for L fp32 lanes per vector and NR = 2L columns per
// block: [ceil(N / NR), K, L] uint32, lane i of (block b, k) holding column
// b*NR + i in its low half and column b*NR + L + i in its high half (zero past N).
// One vector load per k then yields both halves of the block's columns:
//
//     lo = u << 16            columns b*NR + 0 .. L-1
//     hi = u & 0xffff0000     columns b*NR + L .. 2L-1
//
// A tile of MR rows keeps its 2*MR accumulators in registers (AVX2: 6 rows, 12 of 16
// ymm; AVX-512: 12 rows, 24 of 32 zmm); each k costs one weight load, two integer
// ops, MR broadcasts of an input value and 2*MR FMAs. Inputs are widened to fp32
// once per call, regrouped per tile as [K][MR], rows spread evenly over the tiles.
// Rows are taken in chunks whose fp32 copy fits L2, and threads split the column
// blocks; while a block's tiles of a chunk run, the next block's weight is prefetched
// a cache line at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vec16.h"

namespace {

constexpr int L = disa::F32ACC_LANES, MR = disa::F32ACC_ROWS;
constexpr int NR = 2 * L;
constexpr int64_t LINE = 64;
constexpr int64_t K_PER_LINE = LINE / (4 * L) > 0 ? LINE / (4 * L) : 1;
constexpr int64_t CHUNK_BYTES = 256 << 10;  // fp32 rows per chunk: this many bytes

typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));

// Rounded to nearest even (see dvec::round_to_bf16); only the first n lanes stored.
inline void store_lanes(c10::BFloat16* p, vf v, int n) {
  const vu u = dvec::round_to_bf16<vu>(v);
  alignas(64) uint32_t t[L];
  std::memcpy(t, &u, sizeof(t));
  for (int i = 0; i < n; ++i) {
    const uint16_t h = static_cast<uint16_t>(t[i] >> 16);
    std::memcpy(p + i, &h, 2);
  }
}
inline void store_lanes(float* p, vf v, int n) {
  if (n == L) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    alignas(64) float t[L];
    std::memcpy(t, &v, sizeof(t));
    std::memcpy(p, t, n * sizeof(float));
  }
}

template <int R, typename O>
inline void tile(const float* xt, int64_t K, const uint32_t* w, const float* bias, O* y,
                 int64_t ys, int ncols, const char*& pf, const char* pf_end, int64_t pf_every) {
  vf acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = vf{};
  const vu hi_mask = vu{} + 0xffff0000u;
  const char* next = pf;  // a local: the reference would be reloaded every step
  int64_t countdown = 0;  // k's until the next prefetch (no division in the loop)
  for (int64_t k = 0; k < K; ++k) {
    vu u;
    std::memcpy(&u, w + k * L, sizeof(u));
    const vf w0 = (vf)(u << 16), w1 = (vf)(u & hi_mask);
    if (--countdown <= 0 && next < pf_end) {
      __builtin_prefetch(next);
      next += LINE;
      countdown = pf_every;
    }
    const float* xk = xt + k * MR;
    for (int i = 0; i < R; ++i) {
      // scalar * vector broadcasts (vf{} + x would add a -0.0-preserving vaddss)
      const float xb = xk[i];
      acc[i][0] += xb * w0;
      acc[i][1] += xb * w1;
    }
  }
  pf = next;
  vf b0 = vf{}, b1 = vf{};
  if (bias) {
    std::memcpy(&b0, bias, sizeof(b0));
    std::memcpy(&b1, bias + L, sizeof(b1));
  }
  const int n0 = std::min(ncols, L), n1 = std::max(0, ncols - L);
  for (int i = 0; i < R; ++i) {
    store_lanes(y + i * ys, acc[i][0] + b0, n0);
    if (n1 > 0) store_lanes(y + i * ys + L, acc[i][1] + b1, n1);
  }
}

at::Tensor pack_f32acc(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && !w.is_cuda(),
              "pack_f32acc: weight must be a CPU bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), NB = (N + NR - 1) / NR;
  TORCH_CHECK(N > 0 && K > 0, "pack_f32acc: empty weight");
  const at::Tensor wc = w.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  at::Tensor out = at::zeros({NB, K, L}, w.options().dtype(at::kInt));
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int i = 0; i < NR; ++i) {
        const int64_t n = b * NR + i;
        if (n >= N) break;
        const uint16_t* row = src + n * K;
        uint32_t* col = dst + b * K * L + (i % L);
        const int shift = i < L ? 0 : 16;
        for (int64_t k = 0; k < K; ++k) col[k * L] |= static_cast<uint32_t>(row[k]) << shift;
      }
  });
  return out;
}

template <typename O>
void run(const at::Tensor& x, const at::Tensor& wp, int64_t N, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  // Rows split evenly over the tiles (8 rows as 4 + 4, not 6 + 2: a short tile has
  // too few independent accumulators to hide the FMA latency): tile t holds rows
  // [first(t), first(t + 1)).
  const int64_t tiles = (M + MR - 1) / MR, base = M / tiles, extra = M % tiles;
  auto first = [&](int64_t t) { return t * base + std::min(t, extra); };
  // x widened to fp32 and regrouped per tile as [tiles][K][MR] (rows past a tile's
  // own are never read)
  std::vector<float> xt(tiles * K * MR);
  const auto* xs = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = first(t); m < first(t + 1); ++m) {
        const c10::BFloat16* row = xs + m * x.stride(0);
        float* dst = xt.data() + t * K * MR + (m - first(t));
        for (int64_t k = 0; k < K; ++k) dst[k * MR] = static_cast<float>(row[k]);
      }
  });
  const auto* w = reinterpret_cast<const uint32_t*>(wp.data_ptr<int32_t>());
  O* yp = y.data_ptr<O>();
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (K * MR * 4));  // tiles per chunk
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
      const int64_t c1 = std::min(tiles, c0 + chunk);
      for (int64_t b = b0; b < b1; ++b) {
        const uint32_t* pw = w + b * K * L;
        const char* pf = reinterpret_cast<const char*>(pw + K * L);
        const char* pf_end = b + 1 < NB ? pf + K * L * 4 : pf;
        // the next block's weight, one line every pf_every k's, spread over every
        // tile of the chunk: DRAM keeps streaming while the later tiles compute
        const int64_t pf_every = K_PER_LINE * (c1 - c0);
        const float* pb = bias ? bias + b * NR : nullptr;
        const int ncols = static_cast<int>(std::min<int64_t>(NR, N - b * NR));
        for (int64_t t = c0; t < c1; ++t) {
          const int64_t m0 = first(t), mr = first(t + 1) - m0;
          const float* xp = xt.data() + t * K * MR;
          O* yo = yp + m0 * N + b * NR;
          switch (mr) {
#define T(n) case n: tile<(n <= MR ? n : MR), O>(xp, K, pw, pb, yo, N, ncols, pf, pf_end, pf_every); break;
            T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11) T(12)
#undef T
          }
        }
      }
    }
  });
}

// fp32_out: the fp32 sums without rounding them to bf16 (logits: see gemm_vnni).
at::Tensor gemm_f32acc(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                       const c10::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  !x.is_cuda(),
              "gemm_f32acc: x must be a CPU bf16 [M, K] with contiguous rows");
  TORCH_CHECK(wp.dim() == 3 && wp.is_contiguous() && wp.scalar_type() == at::kInt,
              "gemm_f32acc: weight must come from pack_f32acc");
  TORCH_CHECK(wp.size(2) == L, "gemm_f32acc: the weight was packed for ", wp.size(2),
              " lanes, this build has ", L);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == wp.size(1), "gemm_f32acc: x has ", K, " columns, the weight ", wp.size(1));
  TORCH_CHECK(n > (wp.size(0) - 1) * NR && n <= wp.size(0) * NR,
              "gemm_f32acc: ", n, " output features do not fit the packed weight");
  std::vector<float> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "gemm_f32acc: bias must be [N]");
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    b.assign(wp.size(0) * NR, 0.f);
    std::memcpy(b.data(), bf.data_ptr<float>(), n * sizeof(float));
  }
  at::Tensor y = at::empty({M, n}, fp32_out ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0) return y;
  const float* bp = b.empty() ? nullptr : b.data();
  if (fp32_out)
    run<float>(x, wp, n, bp, y);
  else
    run<c10::BFloat16>(x, wp, n, bp, y);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("pack_f32acc(Tensor w) -> Tensor");
  m.def("gemm_f32acc(Tensor x, Tensor wp, int n, Tensor? bias, bool fp32_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("pack_f32acc", &pack_f32acc);
  m.impl("gemm_f32acc", &gemm_f32acc);
}
