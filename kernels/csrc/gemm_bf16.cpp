// bf16 GEMM for decode batches on CPUs with AVX512-BF16: y[M, N] = x[M, K] @ W[N, K]^T.
//
// The weight is packed once (`pack_vnni`) as [N/16, K/2, 16, 2]: one 64-byte vector
// holds two k's of sixteen output columns, the operand order of VDPBF16PS. A tile of
// MR <= 12 rows x 32 columns keeps its 2*MR fp32 accumulators in registers; each k
// pair costs two weight loads, MR broadcasts of an input pair and 2*MR dot products.
// The weight panel of a column pair (K * 64 bytes) stays in L1/L2 across the row
// tiles, and the next panel is prefetched a line at a time while this one is
// computed, so the weight streams from DRAM behind the arithmetic.
//
// At decode batch sizes this is where oneDNN loses time: with the weights cold (a
// model's worth does not fit in L3) its M = 64 GEMMs on SmolLM2's shapes ran at 643
// GFLOP/s on the dev VM, these at 822 (30 layers, side by side); with a hot weight
// both reach ~830. Rows are cast to bf16 once, output rounded to nearest even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vnni_gemm_args.h"

#ifdef DIPTYCH_HAVE_AVX512_BF16
#include <immintrin.h>

namespace {

constexpr int NB = 2;   // column blocks of 16 per panel
constexpr int MRX = 12; // rows per tile
// Up to kWideRows rows, a tile takes WIDE panels (2 * NB * WIDE accumulator chains
// at most, against the dot product's latency). Every column's sum is the same chain
// of VDPBF16PS over k in order in any tile, so a row's bits never depend on M.
constexpr int64_t kWideRows = 2, WIDE = 4;

template <int MR, typename O, int NBT = NB>
inline void tile(const uint32_t* xp, int64_t xs, int64_t K2, const c10::BFloat16* wp,
                 int64_t wstride, const c10::BFloat16* bias, O* y, int64_t ys,
                 const char*& pf, const char* pf_end) {
  __m512 acc[MR][NBT];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NBT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh w[NBT];
    for (int j = 0; j < NBT; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(wp + j * wstride + kp * 32);
    if ((kp & 1) == 0)  // a line every two k pairs per panel
      for (int l = 0; l < (NBT + 1) / 2 && pf < pf_end; ++l, pf += 64)
        _mm_prefetch(pf, _MM_HINT_T0);
    const uint32_t* xk = xp + kp * xs;
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[i]));
      for (int j = 0; j < NBT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], w[j], xb);
    }
  }
  for (int j = 0; j < NBT; ++j) {
    __m512 b = _mm512_setzero_ps();
    if (bias) {
      const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 16 * j));
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 v = _mm512_add_ps(acc[i][j], b);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_storeu_ps(y + i * ys + 16 * j, v);
      } else {
        const __m256bh o = _mm512_cvtneps_pbh(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys + 16 * j), (__m256i)o);
      }
    }
  }
}

at::Tensor pack_vnni(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && !w.is_cuda(),
              "pack_vnni: weight must be a CPU bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % (16 * NB) == 0 && K % 2 == 0 && K > 0,
              "pack_vnni: N must be a multiple of 32 and K even");
  // [N/16, K/2, 16, 2]
  return w.contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

template <typename O>
void run(const at::Tensor& x, const at::Tensor& wp, const c10::BFloat16* bp, at::Tensor& y) {
  const int64_t M = x.size(0), N = wp.size(0) * 16, K2 = wp.size(1);
  // x regrouped per row tile as [tiles][K/2][xs] pairs, xs = MRX or, for a few rows,
  // M (a tile reads only its own rows: the last one's padding is never read)
  const int64_t tiles = (M + MRX - 1) / MRX, xs = M <= kWideRows ? M : MRX;
  std::unique_ptr<uint32_t[]> xt(new uint32_t[tiles * K2 * xs]);
  const c10::BFloat16* xsrc = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    const c10::BFloat16* row = xsrc + m * x.stride(0);  // any row stride and alignment
    uint32_t* dst = xt.get() + (m / MRX) * K2 * xs + m % MRX;
    for (int64_t kp = 0; kp < K2; ++kp) std::memcpy(dst + kp * xs, row + 2 * kp, 4);
  }
  const auto* w = wp.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<O>();
  const int64_t wstride = K2 * 32;  // elements per column block
  const int64_t panels = N / (16 * NB);
  if (M <= kWideRows) {  // a few rows: up to WIDE panels a tile, more chains at once
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0, np; p < p1; p += np) {
        np = std::min<int64_t>(WIDE, p1 - p);
        const c10::BFloat16* pw = w + p * NB * wstride;
        const char* pf = reinterpret_cast<const char*>(pw + np * NB * wstride);
        const char* pf_end = pf + std::min<int64_t>(WIDE, p1 - p - np) * NB * wstride * 2;
        const c10::BFloat16* pb = bp ? bp + p * NB * 16 : nullptr;
        O* yo = yp + p * NB * 16;
        switch (M * 8 + np) {
#define W(m, n)                                                                          \
  case m * 8 + n:                                                                        \
    tile<m, O, n * NB>(xt.get(), xs, K2, pw, wstride, pb, yo, N, pf, pf_end); \
    break;
          W(1, 1) W(1, 2) W(1, 3) W(1, 4) W(2, 1) W(2, 2) W(2, 3) W(2, 4)
#undef W
        }
        for (; pf < pf_end; pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
      }
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const c10::BFloat16* pw = w + p * NB * wstride;
      const char* pf = reinterpret_cast<const char*>(pw + NB * wstride);
      const char* pf_end = p + 1 < panels ? pf + NB * wstride * 2 : pf;
      const c10::BFloat16* pb = bp ? bp + p * NB * 16 : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * MRX, mr = std::min<int64_t>(MRX, M - m0);
        const uint32_t* xp = xt.get() + t * K2 * xs;
        O* yo = yp + m0 * N + p * NB * 16;
        switch (mr) {
#define T(n) case n: tile<n, O>(xp, xs, K2, pw, wstride, pb, yo, N, pf, pf_end); break;
          T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11) T(12)
#undef T
        }
      }
      for (; pf < pf_end; pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
    }
  });
}

// fp32_out: the fp32 sums without rounding them to bf16 (logits: rounded bf16 logits
// tie often, and argmax then breaks the tie by index).
at::Tensor gemm_vnni(const at::Tensor& x, const at::Tensor& wp,
                     const c10::optional<at::Tensor>& bias, bool fp32_out) {
  static_assert(NB == 2, "check_gemm_args takes column blocks in pairs");
  dvnni::GemmArgs a = dvnni::check_gemm_args("gemm_vnni", x, wp, bias, fp32_out);
  if (a.M == 0) return a.y;
  if (fp32_out)
    run<float>(x, wp, a.bias, a.y);
  else
    run<c10::BFloat16>(x, wp, a.bias, a.y);
  return a.y;
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("pack_vnni(Tensor w) -> Tensor");
  m.def("gemm_vnni(Tensor x, Tensor wp, Tensor? bias, bool fp32_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("pack_vnni", &pack_vnni);
  m.impl("gemm_vnni", &gemm_vnni);
}
#endif
