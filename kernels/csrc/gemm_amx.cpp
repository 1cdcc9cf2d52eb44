// bf16 GEMM on AMX tiles (Sapphire Rapids and later), the fixed-order linear of
// --deterministic there: y[M, N] = x[M, K] @ W[N, K]^T on the weight gemm_bf16.cpp packs.
//
// That layout, [N/16, K/2, 16, 2], is TDPBF16PS's B operand as it is: sixteen k pairs
// of a 16-column block are one 16 x 64-byte tile. A tile of x is 16 rows x 32 k.
// Eight tile registers hold 2 x 2 accumulators (32 rows x 32 columns), two x tiles
// and two weight tiles; each k step is four tile products.
//
// Row invariance: every output element is one accumulator tile's chain of TDPBF16PS
// over the k tiles in order, started from zero, whatever M is. A tile always has 16
// rows: the last partial block of x is copied into a zero-padded one, so a row is never
// computed by another instruction sequence because of the rows beside it. The bias is
// added after the sum and the result rounded to nearest even (bf16) or kept (fp32), as
// gemm_vnni does. The sums are not gemm_vnni's (the tile unit adds in its own order):
// the engine's numerics key names the amx level apart (engine/determinism.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vnni_gemm_args.h"

#if defined(DIPTYCH_HAVE_AVX512_BF16) && defined(__linux__) && defined(__x86_64__)
#include <immintrin.h>

#include "amx_tiles.h"

namespace {

constexpr int64_t TR = 16;  // rows of a tile
constexpr int64_t TK = 32;  // k of a tile: 16 pairs, 64 bytes a row
constexpr int64_t NB = 2;   // column blocks of 16 per panel (pack_vnni's multiple)

AMX_FN void configure() {
  damx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = TR;
    c.colsb[t] = 64;
  }
  damx::load_config(c);
}

// Accumulators 0-3 (row block r, column block j: tile 2r + j), x tiles 4-5, weights 6-7.
template <bool TWO>
AMX_FN inline void products(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t lda,
                            const c10::BFloat16* w0, const c10::BFloat16* w1, int64_t kts,
                            float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < kts; ++kt) {
    _tile_loadd(6, w0 + kt * TR * 32, 64);
    _tile_loadd(7, w1 + kt * TR * 32, 64);
    _tile_loadd(4, a0 + kt * TK, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, a1 + kt * TK, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + TR * 16, 64);
  if constexpr (TWO) {
    _tile_stored(2, c + 2 * TR * 16, 64);
    _tile_stored(3, c + 3 * TR * 16, 64);
  }
}

// `rows` valid rows of an accumulator pair (32 columns) to y, bias added.
template <typename O>
inline void epilogue(const float* c, int64_t rows, const c10::BFloat16* bias, O* y,
                     int64_t ys) {
  for (int64_t j = 0; j < NB; ++j) {
    __m512 b = _mm512_setzero_ps();
    if (bias) {
      const __m256i bb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + 16 * j));
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + j * TR * 16 + i * 16), b);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_storeu_ps(y + i * ys + 16 * j, v);
      } else {
        const __m256bh o = _mm512_cvtneps_pbh(v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * ys + 16 * j), (__m256i)o);
      }
    }
  }
}

struct Rows {  // where row block `rb` of x is read from
  const c10::BFloat16* x;
  int64_t lda;  // bytes between rows
  const c10::BFloat16* pad;  // the last partial block, zero-padded to 16 rows
  int64_t full;  // whole blocks in x
  int64_t K;
  const c10::BFloat16* block(int64_t rb) const { return rb < full ? x + rb * TR * (lda / 2) : pad; }
  int64_t stride(int64_t rb) const { return rb < full ? lda : K * 2; }
};

// Row blocks [b0, b1) of panels [p0, p1).
template <typename O>
AMX_FN void panels(const Rows& xr, int64_t M, int64_t K, int64_t N, const c10::BFloat16* w,
                   const c10::BFloat16* bias, O* y, int64_t p0, int64_t p1, int64_t b0,
                   int64_t b1) {
  configure();
  alignas(64) float c[4 * TR * 16];
  const int64_t wstride = (K / 2) * 32, kts = K / TK;
  for (int64_t p = p0; p < p1; ++p) {
    const c10::BFloat16* w0 = w + p * NB * wstride;
    const c10::BFloat16* pb = bias ? bias + p * NB * 16 : nullptr;
    const int64_t n0 = p * NB * 16;
    int64_t rb = b0;
    for (; rb + 1 < std::min(b1, xr.full); rb += 2) {  // whole blocks in pairs
      products<true>(xr.block(rb), xr.block(rb + 1), xr.lda, w0, w0 + wstride, kts, c);
      epilogue<O>(c, TR, pb, y + rb * TR * N + n0, N);
      epilogue<O>(c + 2 * TR * 16, TR, pb, y + (rb + 1) * TR * N + n0, N);
    }
    for (; rb < b1; ++rb) {  // an odd whole block, the padded last one
      products<false>(xr.block(rb), nullptr, xr.stride(rb), w0, w0 + wstride, kts, c);
      epilogue<O>(c, std::min<int64_t>(TR, M - rb * TR), pb, y + rb * TR * N + n0, N);
    }
  }
  _tile_release();
}

bool gemm_amx_available() {
  return damx::tiles_available();
}

at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& wp,
                    const c10::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(gemm_amx_available(), "gemm_amx: this CPU (or kernel) lends no AMX tiles");
  static_assert(NB == 2, "check_gemm_args takes column blocks in pairs");
  auto [M, K, N, bp, y] = dvnni::check_gemm_args("gemm_amx", x, wp, bias, fp32_out);
  TORCH_CHECK(K % TK == 0, "gemm_amx: K must be a multiple of 32, got ", K);
  if (M == 0) return y;
  const int64_t full = M / TR, tail = M % TR;
  std::vector<c10::BFloat16> pad(tail ? TR * K : 0, c10::BFloat16(0.0f));
  const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < tail; ++i)
    std::memcpy(pad.data() + i * K, xs + (full * TR + i) * x.stride(0), K * 2);
  const Rows xr{xs, x.stride(0) * 2, pad.data(), full, K};
  const auto* w = wp.data_ptr<c10::BFloat16>();
  // Rows a chunk at a time, every panel over one chunk before the next: a chunk of x
  // (~256 KB) stays in L2 while the weight streams past it. At 1,024 rows without it
  // a 960 x 576 GEMM took 2.3x its time at 512.
  const int64_t blocks = (M + TR - 1) / TR;
  const int64_t chunk = std::max<int64_t>(2, (256 * 1024 / (K * 2 * TR)) / 2 * 2);
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    const int64_t b1 = std::min(blocks, b0 + chunk);
    at::parallel_for(0, N / (16 * NB), 1, [&](int64_t p0, int64_t p1) {
      if (fp32_out)
        panels<float>(xr, M, K, N, w, bp, y.data_ptr<float>(), p0, p1, b0, b1);
      else
        panels<c10::BFloat16>(xr, M, K, N, w, bp, y.data_ptr<c10::BFloat16>(), p0, p1, b0,
                              b1);
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("gemm_amx(Tensor x, Tensor wp, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("gemm_amx_available() -> bool", &gemm_amx_available);
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("gemm_amx", &gemm_amx); }
#endif
