// y = x @ W^T on FP8 (e4m3) weights kept as the checkpoint stored them, for CPUs
// (kernels/quant.py, kind "f8"):
//
//   codes  float8_e4m3fn [N/8, K/G, G/4, 8, 4]  [tile, group, t, row, byte]: value 4t+b
//   scales fp32 [N/8, K/G, 8], G a multiple of 32       w = scale * code
//
// Weight-only (w8a16): the activations stay floats, so the result is the dequantized
// weight's linear up to summation order. A decode step streams every weight once, and
// these move half of bf16's bytes. A 32-byte chunk holds four values of each of a tile's
// eight rows (row r's at bytes 4r to 4r+3). Under AVX2 each byte becomes an fp16 bit
// pattern with one unpack, one shift and one mask (the e4m3 value times 2^-8: exponent
// bias 15 against 7, exact for e4m3's subnormals too) and F16C widens eight at a time to
// fp32; a vector then holds two rows' four values of the chunk, multiplied by x's four
// values repeated, and a group's four lanes a row are summed once at its end, times its
// scales (and 2^8). Elsewhere a scalar loop widens each byte to an fp32 with shifts and
// masks. Threads split the row tiles; up to MAX_M rows of x are dotted with each chunk
// while it is in registers. e4m3fn's NaN code (0x7F / 0xFF) reads as 480 (or its fp16
// twin): quantizers never write it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <torch/library.h>

#include "isa.h"
#include "ops_cpu.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS = 8;   // output rows per tile
// x rows per pass over the weight: four accumulators a row, within the registers
constexpr int64_t MAX_M = disa::VEC_REGS == 32 ? 4 : 2;
constexpr int64_t PF = 4096;  // bytes of codes prefetched ahead of the ones being read
constexpr float E4M3_TO_F32 = 0x1p120f;

inline float e4m3(uint8_t c) {
  const uint32_t bits = (static_cast<uint32_t>(c & 0x80) << 24) |
                        (static_cast<uint32_t>(c & 0x7F) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * E4M3_TO_F32;
}

struct F8Weight {
  const uint8_t* codes;
  const float* scales;
  int64_t tiles, groups, group, n;
};

#if defined(__AVX2__)
// Half of a chunk's codes (`u`: unpacked with the codes in the high byte of each 16-bit
// lane) as fp16 bit patterns: an arithmetic shift puts the 7 exponent-and-mantissa
// bits at 7-13 and copies the sign to bits 15 and 14; the mask clears bit 14. The
// fp16 value is the e4m3 value times 2^-8 (exponent bias 15 against 7), subnormals
// included, which the group's scales take back.
inline __m256i e4m3_as_f16(__m256i u) {
  return _mm256_and_si256(_mm256_srai_epi16(u, 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
}
#endif

// Tile `t`'s eight rows dotted with the M rows of `xa` (fp32, [M, K'] with stride
// `xs`): out[m * 8 + r].
template <int M>
void f8_tile(const F8Weight& w, int64_t t, const float* xa, int64_t xs, float* out) {
  const int64_t G = w.group;
  const uint8_t* ct = w.codes + t * w.groups * G * ROWS;
  const float* st = w.scales + t * w.groups * ROWS;
#if defined(__AVX2__)
  // acc[m][j]: rows 2j and 2j+1 of the tile, one lane per (row, byte b): the chunk's
  // fp16 values come out two rows a half, and x's four values of the chunk sit in
  // both halves of one vector. A group's four lanes a row are summed once, at its end.
  const __m256 f16_to_e4m3 = _mm256_set1_ps(256.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i zero = _mm256_setzero_si256();
  __m256 sum[M];
  for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* cg = ct + g * G * ROWS;
    __m256 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < G / 4; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(cg + i * 32 + PF), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + i * 32));
      const __m256i lo = e4m3_as_f16(_mm256_unpacklo_epi8(zero, v));  // rows 0, 1 | 4, 5
      const __m256i hi = e4m3_as_f16(_mm256_unpackhi_epi8(zero, v));  // rows 2, 3 | 6, 7
      const __m256 w01 = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
      const __m256 w23 = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
      const __m256 w45 = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
      const __m256 w67 = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
      for (int m = 0; m < M; ++m) {
        const __m256 x = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xa + m * xs + g * G + 4 * i));
        acc[m][0] = _mm256_fmadd_ps(w01, x, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w23, x, acc[m][1]);
        acc[m][2] = _mm256_fmadd_ps(w45, x, acc[m][2]);
        acc[m][3] = _mm256_fmadd_ps(w67, x, acc[m][3]);
      }
    }
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(st + g * ROWS), f16_to_e4m3);
    for (int m = 0; m < M; ++m) {
      // [r0 r2 r4 r6 | r1 r3 r5 r7] after three pairwise adds, then rows in order
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[m][0], acc[m][1]),
                                      _mm256_hadd_ps(acc[m][2], acc[m][3]));
      const __m256 rows = _mm256_permutevar8x32_ps(h, order);
      sum[m] = _mm256_fmadd_ps(rows, s, sum[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * ROWS, sum[m]);
#else
  std::fill(out, out + M * ROWS, 0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* cg = ct + g * G * ROWS;
    float acc[M * ROWS] = {};
    for (int64_t i = 0; i < G / 4; ++i)
      for (int64_t r = 0; r < ROWS; ++r)
        for (int b = 0; b < 4; ++b) {
          const float v = e4m3(cg[i * 32 + r * 4 + b]);
          for (int m = 0; m < M; ++m) acc[m * ROWS + r] += v * xa[m * xs + g * G + 4 * i + b];
        }
    for (int m = 0; m < M; ++m)
      for (int64_t r = 0; r < ROWS; ++r) out[m * ROWS + r] += acc[m * ROWS + r] * st[g * ROWS + r];
  }
#endif
}

template <int M, typename O>
void f8_pass(const F8Weight& w, const float* xa, int64_t xs, O* y, int64_t ys) {
  // a thread's share must be worth waking it: at least 64 KB of codes
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (w.groups * w.group * ROWS));
  at::parallel_for(0, w.tiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(32) float out[M * ROWS];
    for (int64_t t = t0; t < t1; ++t) {
      f8_tile<M>(w, t, xa, xs, out);
      const int64_t rows = std::min(ROWS, w.n - t * ROWS);
      for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) y[m * ys + t * ROWS + r] = static_cast<O>(out[m * ROWS + r]);
    }
  });
}

template <typename O>
void f8_run(const F8Weight& w, const float* xa, int64_t xs, int64_t rows, O* y, int64_t ys) {
  for (int64_t m0 = 0; m0 < rows; m0 += MAX_M) {
    const float* x = xa + m0 * xs;
    O* out = y + m0 * ys;
    switch (std::min(MAX_M, rows - m0)) {
      case 1: f8_pass<1>(w, x, xs, out, ys); break;
      case 2: f8_pass<2>(w, x, xs, out, ys); break;
      case 3: if constexpr (MAX_M >= 3) f8_pass<3>(w, x, xs, out, ys); break;
      default: if constexpr (MAX_M >= 4) f8_pass<4>(w, x, xs, out, ys); break;
    }
  }
}

F8Weight check_f8(const at::Tensor& codes, const at::Tensor& scales, int64_t group, int64_t n) {
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 5 &&
                  codes.size(3) == ROWS && codes.size(4) == 4 && codes.is_contiguous(),
              "f8 codes are a contiguous float8_e4m3fn [N/8, K/G, G/4, 8, 4] tensor");
  TORCH_CHECK(group > 0 && group % 32 == 0 && codes.size(2) == group / 4,
              "f8 groups are a multiple of 32 values, G/4 codes deep");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == ROWS,
              "f8 scales are a contiguous fp32 [N/8, K/G, 8] tensor matching the codes");
  TORCH_CHECK(n > (codes.size(0) - 1) * ROWS && n <= codes.size(0) * ROWS, "bad row count");
  return F8Weight{reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                  codes.size(0), codes.size(1), group, n};
}

}  // namespace

namespace diptych_cpu {

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      int64_t group, int64_t n, bool fp32_out) {
  const F8Weight w = check_f8(codes, scales, group, n);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), kp = w.groups * group;
  TORCH_CHECK(K <= kp && kp - K < group, "the weight's ", kp, " columns do not match x's ", K);
  // the activations as fp32 rows, zero past K (the weight's padding holds zero codes)
  at::Tensor xa = at::zeros({M, kp}, x.options().dtype(at::kFloat));
  xa.narrow(1, 0, K).copy_(x);
  at::Tensor y = at::empty({M, n}, fp32_out ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = xa.data_ptr<float>();
  switch (y.scalar_type()) {
    case at::kFloat: f8_run(w, xp, kp, M, y.data_ptr<float>(), y.stride(0)); break;
    case at::kBFloat16: f8_run(w, xp, kp, M, y.data_ptr<c10::BFloat16>(), y.stride(0)); break;
    case at::kHalf: f8_run(w, xp, kp, M, y.data_ptr<c10::Half>(), y.stride(0)); break;
    default: TORCH_CHECK(false, "unsupported x dtype ", x.scalar_type());
  }
  return y;
}

at::Tensor fp8_dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                          int64_t n, at::ScalarType dtype) {
  const F8Weight w = check_f8(codes, scales, group, n);
  const int64_t kp = w.groups * group;
  at::Tensor out = at::empty({n, kp}, codes.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* cg = w.codes + (t * w.groups + g) * group * ROWS;
        for (int64_t r = 0; r < ROWS && t * ROWS + r < n; ++r) {
          const float s = w.scales[(t * w.groups + g) * ROWS + r];
          float* row = op + (t * ROWS + r) * kp + g * group;
          for (int64_t i = 0; i < group / 4; ++i)
            for (int b = 0; b < 4; ++b) row[4 * i + b] = s * e4m3(cg[i * 32 + r * 4 + b]);
        }
      }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace diptych_cpu

namespace {

// A mixture of experts' FP8 GEMM, every expert at once: x's rows sorted by expert
// (`ends[e]`: one past expert e's last row) against each expert's stacked weight.
// Work items are (a run of at most MAX_M of one expert's rows, a row tile of its
// weight), so a decode step reads each active expert's weight once and the threads
// share the experts' tiles, whatever their number.
template <typename O>
void f8_grouped(const at::Tensor& codes, const at::Tensor& scales, const std::vector<int64_t>& ends,
                int64_t group, int64_t n, const float* xa, int64_t xs, O* y, int64_t ys) {
  const int64_t experts = codes.size(0), tiles = codes.size(1), groups = codes.size(2);
  const int64_t cstride = codes.stride(0), sstride = scales.stride(0);
  struct Run { int64_t expert, m0, m; };
  std::vector<Run> runs;
  for (int64_t e = 0, start = 0; e < experts; start = ends[e], ++e)
    for (int64_t m0 = start; m0 < ends[e]; m0 += MAX_M) runs.push_back({e, m0, std::min(MAX_M, ends[e] - m0)});
  const auto* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const int64_t items = static_cast<int64_t>(runs.size()) * tiles;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (groups * group * ROWS));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    alignas(32) float out[MAX_M * ROWS];
    for (int64_t i = i0; i < i1; ++i) {
      const Run& r = runs[i / tiles];
      const int64_t t = i % tiles;
      const F8Weight w{cp + r.expert * cstride, sp + r.expert * sstride, tiles, groups, group, n};
      const float* x = xa + r.m0 * xs;
      switch (r.m) {
        case 1: f8_tile<1>(w, t, x, xs, out); break;
        case 2: f8_tile<2>(w, t, x, xs, out); break;
        case 3: if constexpr (MAX_M >= 3) f8_tile<3>(w, t, x, xs, out); break;
        default: if constexpr (MAX_M >= 4) f8_tile<4>(w, t, x, xs, out); break;
      }
      const int64_t rows = std::min(ROWS, n - t * ROWS);
      for (int64_t m = 0; m < r.m; ++m)
        for (int64_t c = 0; c < rows; ++c) y[(r.m0 + m) * ys + t * ROWS + c] = static_cast<O>(out[m * ROWS + c]);
    }
  });
}

// x [P, K] (rows sorted by expert) @ each expert's dequant(W_e)^T: [P, n] in x's dtype.
// codes [E, N/8, K/G, G/4, 8, 4] float8_e4m3fn, scales [E, N/8, K/G, 8] fp32, ends [E].
at::Tensor fp8_grouped_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& ends, int64_t group, int64_t n) {
  TORCH_CHECK(codes.dim() == 6 && scales.dim() == 4 && codes.size(0) == scales.size(0),
              "fp8_grouped_linear: codes [E, N/8, K/G, G/4, 8, 4] and scales [E, N/8, K/G, 8]");
  check_f8(codes[0], scales[0], group, n);  // one expert's shape and dtypes
  TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous(), "fp8_grouped_linear: contiguous weights");
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == codes.size(0) && ends.scalar_type() == at::kLong,
              "fp8_grouped_linear: ends is int64 [E]");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [P, K] with contiguous rows");
  const int64_t P = x.size(0), K = x.size(1), kp = codes.size(2) * group;
  TORCH_CHECK(K <= kp && kp - K < group, "the weights' ", kp, " columns do not match x's ", K);
  at::Tensor e_cpu = ends.contiguous();
  std::vector<int64_t> e(e_cpu.data_ptr<int64_t>(), e_cpu.data_ptr<int64_t>() + e_cpu.numel());
  for (size_t i = 0; i < e.size(); ++i)
    TORCH_CHECK(e[i] >= (i ? e[i - 1] : 0) && e[i] <= P, "fp8_grouped_linear: ends must rise to at most P");
  TORCH_CHECK(e.empty() || e.back() == P, "fp8_grouped_linear: the experts' rows must cover x");
  at::Tensor xa = at::zeros({P, kp}, x.options().dtype(at::kFloat));
  xa.narrow(1, 0, K).copy_(x);
  at::Tensor y = at::empty({P, n}, x.options());
  if (P == 0 || n == 0) return y;
  const float* xp = xa.data_ptr<float>();
  switch (y.scalar_type()) {
    case at::kFloat: f8_grouped(codes, scales, e, group, n, xp, kp, y.data_ptr<float>(), n); break;
    case at::kBFloat16: f8_grouped(codes, scales, e, group, n, xp, kp, y.data_ptr<c10::BFloat16>(), n); break;
    case at::kHalf: f8_grouped(codes, scales, e, group, n, xp, kp, y.data_ptr<c10::Half>(), n); break;
    default: TORCH_CHECK(false, "unsupported x dtype ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("fp8_grouped_linear(Tensor x, Tensor codes, Tensor scales, Tensor ends, int group, "
        "int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("fp8_grouped_linear", &fp8_grouped_linear); }
