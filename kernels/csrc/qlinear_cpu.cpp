// y = x @ W^T on weights kept quantized (GGUF Q4_0, Q4_1, Q4_K, Q8_0, Q6_K; int8, int4),
// for CPUs. FP8 codes go to fp8_linear_cpu.cpp.
//
// A decode step streams every weight once, so its time is bytes: 4-bit weights move
// a quarter of bf16's. The weights stay quantized, re-laid out once at load
// (kernels/quant.py) so that eight output rows sit side by side, one per 32-bit lane:
//
//   q4  codes  uint8 [N/8, K/32, 4, 8, 4]  [tile, block, i, row, byte]: byte b of
//              (i, row) holds value 4i+b of the row's block in its low nibble and value
//              16+4i+b in its high nibble (GGUF's own nibble order, per row)
//       scales, mins [N/8, K/32, 8] (fp16 or fp32)       w = scale * code + min
//   q8  codes  int8 [N/8, K/G, G/4, 8, 4]   [tile, group, t, row, byte]: value 4t+b
//       scales [N/8, K/G, 8] (fp16 or fp32), G = 32 or 16   w = scale * code
//
// The activations are quantized to int8 per 32 values (scale amax / 127), as llama.cpp
// does, and the products are integer dot products: a vector of 8 lanes takes four
// codes of each of the eight rows, and its x operand is four activation codes
// broadcast to every lane, so after a block's 8 (q4) or G/4 (q8) dot-product
// instructions lane r holds row r's whole block sum and needs no horizontal reduction.
// AVX2 multiplies with VPMADDUBSW (u8 x s8 pairs; q4 sums eight of those in int16,
// which cannot overflow for 4-bit codes) and VPMADDWD; a build with AVX512-VNNI uses
// VPDPBUSD. int8 weights use the sign trick under AVX2 (|w| x sign(x, w)) and, under
// VNNI, w + 128 as the unsigned operand with 128 x the activation sum taken back.
// Then one conversion and one FMA per block and 8 rows: sum * (weight scale x
// activation scale); q4's mins need only the activation block sums (min * d_x *
// sum(q_x)). Threads split the row tiles; every x row (at most MAX_M per pass) is
// dotted with a block while its codes are in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DIPTYCH_QDOT_VNNI 1
#endif

namespace {

constexpr int64_t QB = 32;    // activation values per int8 block (and q4 block)
constexpr int64_t ROWS = 8;   // output rows per tile
constexpr int64_t MAX_M = 4;  // x rows per pass over the weight
// Bytes ahead of the codes being read that each tile prefetches: the hardware
// prefetcher alone left a decode step at 9 GB/s of a VM's ~17 GB/s read bandwidth,
// this at 13-15 (2048 and 4096 measured alike).
constexpr int64_t QPF = 4096;

// ---------------------------------------------------------------- activations

struct QuantActs {
  int64_t nb = 0;           // blocks per row
  std::vector<int8_t> q;    // [M, nb * 32], zero past K
  std::vector<float> d;     // [M, nb] scale
  std::vector<float> s;     // [M, nb] scale * sum of the block's codes
  std::vector<int32_t> h;   // [M, nb, 2] code sums of each half block
};

// One block of 32 values (n valid, the rest zero) to int8 codes with scale d.
template <typename T>
void quantize_block_scalar(const T* x, int64_t n, int8_t* q, float& d) {
  float buf[QB];
  float amax = 0.f;
  for (int64_t i = 0; i < QB; ++i) {
    buf[i] = i < n ? static_cast<float>(x[i]) : 0.f;
    amax = std::max(amax, std::fabs(buf[i]));
  }
  d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < QB; ++i) {
    const int v = static_cast<int>(std::nearbyint(buf[i] * id));
    q[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
  }
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// A whole block, vectorized; rounds (to nearest even) and clamps as the scalar one.
template <typename T>
void quantize_block(const T* x, int64_t n, int8_t* q, float& d) {
  if (n < QB) return quantize_block_scalar(x, n, q, d);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  const float a = hmax8(amax);
  d = a / 127.f;
  const __m256 id = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  const __m256i i01 = _mm256_packs_epi32(i[0], i[1]), i23 = _mm256_packs_epi32(i[2], i[3]);
  __m256i b = _mm256_max_epi8(_mm256_packs_epi16(i01, i23), _mm256_set1_epi8(-127));
  // the packs interleave 128-bit lanes: restore value order
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
}
#else
template <typename T>
void quantize_block(const T* x, int64_t n, int8_t* q, float& d) {
  quantize_block_scalar(x, n, q, d);
}
#endif

template <typename T>
void quantize_one(const T* xp, int64_t xs, int64_t K, int64_t i, QuantActs& a) {
  const int64_t nb = a.nb, m = i / nb, k = (i % nb) * QB;
  int8_t* q = a.q.data() + i * QB;
  quantize_block(xp + m * xs + k, std::max<int64_t>(0, std::min(QB, K - k)), q, a.d[i]);
  int32_t lo = 0, hi = 0;
  for (int j = 0; j < 16; ++j) {
    lo += q[j];
    hi += q[16 + j];
  }
  a.h[2 * i] = lo;
  a.h[2 * i + 1] = hi;
  a.s[i] = a.d[i] * static_cast<float>(lo + hi);
}

template <typename T>
void quantize_acts(const at::Tensor& x, int64_t nb, QuantActs& a) {
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0), n = M * nb;
  const T* xp = x.data_ptr<T>();
  a.nb = nb;
  a.q.resize(n * QB);
  a.d.resize(n);
  a.s.resize(n);
  a.h.resize(2 * n);
  if (n <= 256) {  // a decode step's few blocks: not worth waking the thread pool
    for (int64_t i = 0; i < n; ++i) quantize_one(xp, xs, K, i, a);
    return;
  }
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_one(xp, xs, K, i, a);
  });
}

// ---------------------------------------------------------------- scales

#if defined(__AVX2__)
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scales8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// x's four codes starting at value v of block row xb, in every lane
inline __m256i bcast4(const int8_t* xb, int v) {
  int32_t w;
  std::memcpy(&w, xb + v, 4);
  return _mm256_set1_epi32(w);
}
#endif

// ---------------------------------------------------------------- tiles

// One q4 tile (8 rows) against M x rows: out[m * 8 + r].
template <int M, typename S>
void q4_tile(const uint8_t* codes, const S* sc, const S* mn, const QuantActs& a, float* out) {
  const int64_t nb = a.nb;
#if defined(__AVX2__)
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[M], macc[M];
  for (int m = 0; m < M; ++m) acc[m] = macc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const auto* cv = reinterpret_cast<const __m256i*>(codes + b * 128);
    _mm_prefetch(reinterpret_cast<const char*>(codes + b * 128 + QPF), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(codes + b * 128 + QPF + 64), _MM_HINT_T0);
    __m256i w[8];
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_loadu_si256(cv + i);
      w[i] = _mm256_and_si256(v, low);
      w[4 + i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    const __m256 ws = scales8(sc + b * ROWS), wm = scales8(mn + b * ROWS);
    for (int m = 0; m < M; ++m) {
      const int8_t* xb = a.q.data() + (m * nb + b) * QB;
#ifdef DIPTYCH_QDOT_VNNI
      __m256i d0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], bcast4(xb, 0));
      __m256i d1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[1], bcast4(xb, 4));
      for (int t = 2; t < 8; t += 2) {
        d0 = _mm256_dpbusd_epi32(d0, w[t], bcast4(xb, 4 * t));
        d1 = _mm256_dpbusd_epi32(d1, w[t + 1], bcast4(xb, 4 * t + 4));
      }
      const __m256i dot = _mm256_add_epi32(d0, d1);
#else
      // eight u8 x s8 pair sums per lane, each |.| <= 2 * 15 * 127: int16 holds their sum
      __m256i p = _mm256_maddubs_epi16(w[0], bcast4(xb, 0));
      for (int t = 1; t < 8; ++t) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(w[t], bcast4(xb, 4 * t)));
      const __m256i dot = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
      const int64_t i = m * nb + b;
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(a.d[i])), acc[m]);
      macc[m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(a.s[i]), macc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * ROWS, _mm256_add_ps(acc[m], macc[m]));
#else
  for (int64_t j = 0; j < M * ROWS; ++j) out[j] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* cb = codes + b * 128;
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      const int8_t* xb = a.q.data() + i * QB;
      for (int r = 0; r < ROWS; ++r) {
        int32_t dot = 0;
        for (int t = 0; t < 4; ++t)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = cb[(t * ROWS + r) * 4 + k];
            dot += static_cast<int32_t>(byte & 0x0F) * xb[4 * t + k] +
                   static_cast<int32_t>(byte >> 4) * xb[16 + 4 * t + k];
          }
        out[m * ROWS + r] += static_cast<float>(dot) * static_cast<float>(sc[b * ROWS + r]) * a.d[i] +
                             static_cast<float>(mn[b * ROWS + r]) * a.s[i];
      }
    }
  }
#endif
}

// One q8 tile (8 rows, G values per scale) against M x rows.
template <int M, int G, typename S>
void q8_tile(const int8_t* codes, const S* sc, const QuantActs& a, float* out) {
  const int64_t nb = a.nb, ng = nb * QB / G;
  constexpr int T = G / 4;  // vectors per group
#if defined(__AVX2__)
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const auto* cv = reinterpret_cast<const __m256i*>(codes + g * G * ROWS);
    for (int l = 0; l < G * ROWS; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes + g * G * ROWS + l) + QPF, _MM_HINT_T0);
    __m256i w[T];
#ifdef DIPTYCH_QDOT_VNNI
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int t = 0; t < T; ++t) w[t] = _mm256_xor_si256(_mm256_loadu_si256(cv + t), flip);
#else
    __m256i aw[T];
    for (int t = 0; t < T; ++t) {
      w[t] = _mm256_loadu_si256(cv + t);
      aw[t] = _mm256_sign_epi8(w[t], w[t]);
    }
#endif
    const __m256 ws = scales8(sc + g * ROWS);
    const int64_t b = g * G / QB, v0 = g * G % QB;
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      const int8_t* xb = a.q.data() + i * QB + v0;
#ifdef DIPTYCH_QDOT_VNNI
      // (w + 128) . x - 128 * sum(x)
      __m256i dot = _mm256_set1_epi32(-128 * (G == QB ? a.h[2 * i] + a.h[2 * i + 1] : a.h[2 * i + v0 / 16]));
      for (int t = 0; t < T; ++t) dot = _mm256_dpbusd_epi32(dot, w[t], bcast4(xb, 4 * t));
#else
      __m256i dot = _mm256_setzero_si256();
      const __m256i ones = _mm256_set1_epi16(1);
      for (int t = 0; t < T; ++t) {
        const __m256i x = bcast4(xb, 4 * t);
        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[t], _mm256_sign_epi8(x, w[t])), ones));
      }
#endif
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, _mm256_set1_ps(a.d[i])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * ROWS, acc[m]);
#else
  for (int64_t j = 0; j < M * ROWS; ++j) out[j] = 0.f;
  for (int64_t g = 0; g < ng; ++g) {
    const int8_t* cg = codes + g * G * ROWS;
    const int64_t b = g * G / QB, v0 = g * G % QB;
    for (int m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      const int8_t* xb = a.q.data() + i * QB + v0;
      for (int r = 0; r < ROWS; ++r) {
        int32_t dot = 0;
        for (int t = 0; t < T; ++t)
          for (int k = 0; k < 4; ++k) dot += static_cast<int32_t>(cg[(t * ROWS + r) * 4 + k]) * xb[4 * t + k];
        out[m * ROWS + r] += static_cast<float>(dot) * static_cast<float>(sc[g * ROWS + r]) * a.d[i];
      }
    }
  }
#endif
}

// ---------------------------------------------------------------- the op

struct Weight {
  at::Tensor codes, scales, mins;  // mins undefined: q8
  int64_t group, n;                // n: real rows (the last tile may be padded)
};

template <int M, typename S, typename O>
void run_pass(const Weight& w, const QuantActs& a, int64_t m0, at::Tensor& y) {
  const int64_t tiles = w.codes.size(0), ys = y.stride(0);
  const int64_t cstride = w.codes.stride(0), sstride = w.scales.stride(0);
  const bool q4 = w.mins.defined();
  const S* sp = w.scales.data_ptr<S>();
  const S* mp = q4 ? w.mins.data_ptr<S>() : nullptr;
  O* yp = y.data_ptr<O>() + m0 * ys;
  // a thread's share must be worth waking it: at least 64 KB of codes
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (cstride * w.codes.element_size()));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float out[M * ROWS];
#if defined(__AVX2__)
    // the tiles' prefetches run QPF ahead: start the first QPF bytes (and the scales')
    const char* c0 = static_cast<const char*>(w.codes.data_ptr()) + t0 * cstride * w.codes.element_size();
    const int64_t span = std::min<int64_t>(QPF, (t1 - t0) * cstride * w.codes.element_size());
    for (int64_t l = 0; l < span; l += 64) _mm_prefetch(c0 + l, _MM_HINT_T0);
    const int64_t sbytes = std::min<int64_t>(QPF / 4, (t1 - t0) * sstride * sizeof(S));
    for (int64_t l = 0; l < sbytes; l += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(sp + t0 * sstride) + l, _MM_HINT_T0);
      if (q4) _mm_prefetch(reinterpret_cast<const char*>(mp + t0 * sstride) + l, _MM_HINT_T0);
    }
#endif
    for (int64_t t = t0; t < t1; ++t) {
      if (q4) {
        q4_tile<M, S>(w.codes.data_ptr<uint8_t>() + t * cstride, sp + t * sstride,
                      mp + t * sstride, a, out);
      } else if (w.group == 32) {
        q8_tile<M, 32, S>(w.codes.data_ptr<int8_t>() + t * cstride, sp + t * sstride, a, out);
      } else {
        q8_tile<M, 16, S>(w.codes.data_ptr<int8_t>() + t * cstride, sp + t * sstride, a, out);
      }
      const int64_t rows = std::min(ROWS, w.n - t * ROWS);
      for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r)
          yp[m * ys + t * ROWS + r] = static_cast<O>(out[m * ROWS + r]);
    }
  });
}

// The M rows [m0, m0 + M) of `all`.
void slice_acts(const QuantActs& all, int64_t m0, int64_t M, QuantActs& part) {
  const int64_t nb = all.nb;
  part.nb = nb;
  part.q.assign(all.q.begin() + m0 * nb * QB, all.q.begin() + (m0 + M) * nb * QB);
  part.d.assign(all.d.begin() + m0 * nb, all.d.begin() + (m0 + M) * nb);
  part.s.assign(all.s.begin() + m0 * nb, all.s.begin() + (m0 + M) * nb);
  part.h.assign(all.h.begin() + 2 * m0 * nb, all.h.begin() + 2 * (m0 + M) * nb);
}

template <typename S, typename O>
void run(const Weight& w, const QuantActs& a, int64_t rows, at::Tensor& y) {
  QuantActs part;
  for (int64_t m0 = 0; m0 < rows; m0 += MAX_M) {
    const int64_t M = std::min(MAX_M, rows - m0);
    const QuantActs* acts = &a;
    if (M < rows) {
      slice_acts(a, m0, M, part);
      acts = &part;
    }
    switch (M) {
      case 1: run_pass<1, S, O>(w, *acts, m0, y); break;
      case 2: run_pass<2, S, O>(w, *acts, m0, y); break;
      case 3: run_pass<3, S, O>(w, *acts, m0, y); break;
      case 4: run_pass<4, S, O>(w, *acts, m0, y); break;
      default: TORCH_CHECK(false, "unreachable");
    }
  }
}

Weight check_weight(const at::Tensor& codes, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins_opt, int64_t group, int64_t n) {
  const bool q4 = mins_opt.has_value() && mins_opt->defined();
  TORCH_CHECK(codes.dim() == 5 && codes.size(3) == ROWS && codes.size(4) == 4 &&
                  codes.is_contiguous(), "codes must be a contiguous [N/8, blocks, t, 8, 4] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == ROWS && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1),
              "scales must be a contiguous [N/8, blocks, 8] tensor matching the codes");
  TORCH_CHECK(scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat,
              "scales must be fp16 or fp32");
  TORCH_CHECK(n > (codes.size(0) - 1) * ROWS && n <= codes.size(0) * ROWS, "bad row count");
  if (q4) {
    TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(2) == 4 && group == QB,
                "q4 codes are uint8 [N/8, K/32, 4, 8, 4]");
    TORCH_CHECK(mins_opt->sizes() == scales.sizes() && mins_opt->is_contiguous() &&
                mins_opt->scalar_type() == scales.scalar_type(), "mins must match scales");
  } else {
    TORCH_CHECK(codes.scalar_type() == at::kChar && (group == 32 || group == 16) &&
                codes.size(2) == group / 4, "q8 codes are int8 [N/8, K/G, G/4, 8, 4], G 32 or 16");
  }
  return Weight{codes, scales, q4 ? *mins_opt : at::Tensor(), group, n};
}

}  // namespace

namespace diptych_cpu {

// x [M, K] (fp32/bf16/fp16) @ dequant(W)^T: a new [M, n] in x's dtype, or fp32.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t group, int64_t n,
                        bool fp32_out) {
  if (codes.scalar_type() == at::kFloat8_e4m3fn) return fp8_linear(x, codes, scales, group, n, fp32_out);
  const Weight w = check_weight(codes, scales, mins, group, n);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t K = x.size(1), kp = codes.size(1) * group, nb = kp / QB;
  TORCH_CHECK(kp % QB == 0 && K <= kp && kp - K < QB, "the weight's ", kp,
              " columns do not match x's ", K);
  thread_local QuantActs a;
  switch (x.scalar_type()) {
    case at::kFloat: quantize_acts<float>(x, nb, a); break;
    case at::kBFloat16: quantize_acts<c10::BFloat16>(x, nb, a); break;
    case at::kHalf: quantize_acts<c10::Half>(x, nb, a); break;
    default: TORCH_CHECK(false, "unsupported x dtype ", x.scalar_type());
  }
  at::Tensor y = at::empty({x.size(0), n}, fp32_out ? x.options().dtype(at::kFloat) : x.options());
  const bool half = scales.scalar_type() == at::kHalf;
  auto go = [&](auto out_tag) {
    using O = decltype(out_tag);
    if (half) run<c10::Half, O>(w, a, x.size(0), y);
    else run<float, O>(w, a, x.size(0), y);
  };
  switch (y.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "unreachable");
  }
  return y;
}

}  // namespace diptych_cpu

namespace {

template <typename O>
void dequantize_into(const Weight& w, at::Tensor& out) {
  const bool q4 = w.mins.defined();
  const int64_t tiles = w.codes.size(0), ng = w.codes.size(1), G = w.group, kp = ng * G;
  at::Tensor sf = w.scales.to(at::kFloat), mf = q4 ? w.mins.to(at::kFloat) : at::Tensor();
  const float* sp = sf.data_ptr<float>();
  const float* mp = q4 ? mf.data_ptr<float>() : nullptr;
  O* op = out.data_ptr<O>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float v[QB];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < ROWS && t * ROWS + r < w.n; ++r)
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t si = (t * ng + g) * ROWS + r;
          const float s = sp[si];
          if (q4) {
            const uint8_t* cb = w.codes.data_ptr<uint8_t>() + (t * ng + g) * 128 + r * 4;
            const float mn = mp[si];
            for (int i = 0; i < 4; ++i)
              for (int k = 0; k < 4; ++k) {
                const uint8_t byte = cb[i * ROWS * 4 + k];
                v[4 * i + k] = s * static_cast<float>(byte & 0x0F) + mn;
                v[16 + 4 * i + k] = s * static_cast<float>(byte >> 4) + mn;
              }
          } else {
            const int8_t* cg = w.codes.data_ptr<int8_t>() + (t * ng + g) * G * ROWS + r * 4;
            for (int i = 0; i < G / 4; ++i)
              for (int k = 0; k < 4; ++k) v[4 * i + k] = s * static_cast<float>(cg[i * ROWS * 4 + k]);
          }
          O* row = op + (t * ROWS + r) * kp + g * G;
          for (int j = 0; j < G; ++j) row[j] = static_cast<O>(v[j]);
        }
  });
}

// dequant(W) [n, K'] in `dtype` (K' = the padded width), for large batches and tests.
at::Tensor quant_dequantize(const at::Tensor& codes, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& mins, int64_t group, int64_t n,
                            at::ScalarType dtype) {
  if (codes.scalar_type() == at::kFloat8_e4m3fn)
    return diptych_cpu::fp8_dequantize(codes, scales, group, n, dtype);
  const Weight w = check_weight(codes, scales, mins, group, n);
  at::Tensor out = at::empty({n, codes.size(1) * group}, codes.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: dequantize_into<float>(w, out); break;
    case at::kBFloat16: dequantize_into<c10::BFloat16>(w, out); break;
    case at::kHalf: dequantize_into<c10::Half>(w, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group, int n, "
        "bool fp32_out=False) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? mins, int group, int n, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("quant_linear", &diptych_cpu::quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
