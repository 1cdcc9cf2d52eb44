// bf16 decode attention with VDPBF16PS, for CPUs with AVX512-BF16.
//
// The generic kernel widens every K/V element to fp32 and keeps its accumulators in
// memory; at batch 64 it is compute-bound at about four times the time it takes to
// read the cache. Here both products run on bf16 pairs, which VDPBF16PS multiplies
// exactly and sums in fp32, as a bf16 GEMM does:
//
//   scores  one instruction per 32 elements of a K row and query row, reduced sixteen
//           tokens at a time with a shuffle tree, scaled in fp32;
//   P @ V   two tokens per instruction: their V rows are interleaved element by
//           element, their probabilities rounded to a bf16 pair and broadcast, the
//           output accumulators for a 64-wide (32-wide for big groups) slice of the
//           head held in registers across a run of tokens.
//
// Probabilities are rounded to bf16 before P @ V, as FlashAttention and bf16 SDPA do.
// Compile-time G (query heads per KV head) and D (head dim) keep the query rows and
// accumulators in registers; other shapes take the generic kernel.
#pragma once

#include "isa.h"

#ifdef DIPTYCH_HAVE_AVX512_BF16
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_decode_driver.h"
#include "vec16.h"

namespace dpattn {

using pattn::kMaxSlack;
using pattn::kStep;
using pattn::Prefetcher;

using dvec::v16f;

inline __m512i pair_index(int first) {
  // lanes 2k and 2k+1 take element first+k of the first and of the second operand
  alignas(64) int16_t idx[32];
  for (int k = 0; k < 16; ++k) {
    idx[2 * k] = static_cast<int16_t>(first + k);
    idx[2 * k + 1] = static_cast<int16_t>(32 + first + k);
  }
  return _mm512_load_si512(idx);
}

// Online-softmax state of one query row: the running max and a 16-lane running sum.
struct alignas(64) RowState {
  v16f l;
  float m;
};

// Scores of tokens [c0, c1) (at most 16) of one block for G query rows, then the
// online-softmax update; leaves bf16 probabilities as pairs in `pp[g][k]`.
template <int G, int D>
__attribute__((always_inline)) inline void score_run(
    const __m512bh* qv, const c10::BFloat16* kb, int64_t kst, int64_t c0, int64_t c1,
    float scale, RowState* st, float* acc, uint32_t (*pp)[8], Prefetcher& pf) {
  constexpr int NV = D / 32;
  alignas(64) v16f part[G][16];
  const int64_t n = c1 - c0;
  for (int64_t t = 0; t < n; ++t) {
    const c10::BFloat16* kr = kb + (c0 + t) * kst;
    pf.step(kStep);
    __m512bh kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
    for (int g = 0; g < G; ++g) {
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g * NV], kv[0]);
      for (int c = 1; c < NV; ++c) s = _mm512_dpbf16_ps(s, qv[g * NV + c], kv[c]);
      part[g][t] = (v16f)s;
    }
  }
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < G; ++g) {
    for (int64_t t = n; t < 16; ++t) part[g][t] = v16f{};
    const __m512 s = _mm512_mask_blend_ps(
        live, neg_inf, _mm512_mul_ps((__m512)dvec::hsum16(part[g]), _mm512_set1_ps(scale)));
    RowState& r = st[g];
    if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(r.m + kMaxSlack), _CMP_GT_OQ)) {
      const float mx = _mm512_reduce_max_ps(s);
      const float corr = std::exp(r.m - mx);  // 0 on the first run (m = -inf)
      const __m512 cv = _mm512_set1_ps(corr);
      r.l = (v16f)_mm512_mul_ps((__m512)r.l, cv);
      float* a = acc + g * D;
      for (int c = 0; c < D / 16; ++c)
        _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), cv));
      r.m = mx;
    }
    const __m512 e = _mm512_maskz_mov_ps(
        live, (__m512)dvec::vexp((v16f)_mm512_sub_ps(s, _mm512_set1_ps(r.m))));
    r.l = (v16f)_mm512_add_ps((__m512)r.l, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(e));
  }
}

// acc[g][:] += sum over tokens [c0, c1) of p[g][t] * V[t][:], two tokens per step.
template <int G, int D>
__attribute__((always_inline)) inline void pv_run(const c10::BFloat16* vb, int64_t vst, int64_t c0, int64_t c1,
                   uint32_t (*pp)[8], float* acc, __m512i ilo, __m512i ihi, Prefetcher& pf) {
  constexpr int SL = G <= 4 ? 64 : 32;  // head-dim slice whose accumulators stay in registers
  constexpr int NA = SL / 16;
  const int64_t n = c1 - c0;
  for (int d0 = 0; d0 < D; d0 += SL) {
    __m512 a[G][NA];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NA; ++i) a[g][i] = _mm512_loadu_ps(acc + g * D + d0 + 16 * i);
    for (int64_t k = 0; 2 * k < n; ++k) {
      const c10::BFloat16* r0 = vb + (c0 + 2 * k) * vst + d0;
      pf.step(kStep);
      // an odd run's last pair repeats its row (with probability 0): the row past
      // the end may be uninitialised memory, and 0 * NaN is NaN
      const c10::BFloat16* r1 = 2 * k + 1 < n ? r0 + vst : r0;
      __m512bh v[NA];
      for (int h = 0; h < SL / 32; ++h) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * h);
        const __m512i x1 = _mm512_loadu_si512(r1 + 32 * h);
        v[2 * h] = (__m512bh)_mm512_permutex2var_epi16(x0, ilo, x1);
        v[2 * h + 1] = (__m512bh)_mm512_permutex2var_epi16(x0, ihi, x1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][k]));
        for (int i = 0; i < NA; ++i) a[g][i] = _mm512_dpbf16_ps(a[g][i], v[i], p);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < NA; ++i) _mm512_storeu_ps(acc + g * D + d0 + 16 * i, a[g][i]);
  }
}

template <int G, int D>
struct Worker {
  static constexpr int NV = D / 32;
  int64_t hs;
  float scale;
  std::vector<float> acc;     // [hs * G][D]
  std::vector<RowState> st;   // [hs * G]
  std::vector<__m512bh> qv;   // [hs * G][NV]
  uint32_t pp[G][8];
  __m512i ilo = pair_index(0), ihi = pair_index(16);

  Worker(int64_t hs_, float scale_)
      : hs(hs_), scale(scale_), acc(hs_ * G * D), st(hs_ * G), qv(hs_ * G * NV) {}

  void begin(const c10::BFloat16* q) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (auto& s : st) s = {v16f{}, -std::numeric_limits<float>::infinity()};
    for (int64_t r = 0; r < hs * G; ++r)
      for (int c = 0; c < NV; ++c)
        qv[r * NV + c] = (__m512bh)_mm512_loadu_si512(q + r * D + 32 * c);
  }

  void block(int64_t hh, const c10::BFloat16* kb, const c10::BFloat16* vb, int64_t kst,
             int64_t vst, int64_t t0, int64_t t1, Prefetcher& pf) {
    float* a = acc.data() + hh * G * D;
    for (int64_t c0 = t0; c0 < t1; c0 += 16) {
      const int64_t c1 = std::min<int64_t>(c0 + 16, t1);
      score_run<G, D>(qv.data() + hh * G * NV, kb, kst, c0, c1, scale, st.data() + hh * G, a,
                      pp, pf);
      pv_run<G, D>(vb, vst, c0, c1, pp, a, ilo, ihi, pf);
    }
  }

  void end(c10::BFloat16* out) {
    for (int64_t r = 0; r < hs * G; ++r) {
      const float l = _mm512_reduce_add_ps((__m512)st[r].l);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int c = 0; c < D / 16; ++c)
        dvec::store16(out + r * D + 16 * c,
                      (v16f)_mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + 16 * c),
                                          _mm512_set1_ps(inv)));
    }
  }
};

// Runs the kernel and returns true when (G, D) has an instantiation.
template <typename I>
bool dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
              const at::Tensor& table, const at::Tensor& lens, float scale, int64_t window,
              at::Tensor& out) {
  const int64_t D = q.size(2), G = q.size(1) / kc.size(2);
#define DP_CASE(g, d)                                                               \
  if (G == g && D == d) {                                                           \
    pattn::run_items<c10::BFloat16, I>(q, kc, vc, table, lens, window, out,         \
                                       [scale](int64_t hs) { return Worker<g, d>(hs, scale); }); \
    return true;                                                                    \
  }
  PATTN_TILED_SHAPES(DP_CASE)
#undef DP_CASE
  return false;
}

}  // namespace dpattn

#endif
