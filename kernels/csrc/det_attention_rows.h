// One query row's arithmetic in the batch-invariant CPU attention
// (det_attention_cpu.cpp, which explains the sums): the group's scores on either key
// layout, the online-softmax update and P @ V, and the VDPBF16PS forms of both, with
// the value rows packed by pairs. Only det_attention_cpu.cpp includes it.
#pragma once

#include <ATen/ATen.h>

#include "isa.h"
#include "vec16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace ddet {

constexpr int64_t GT = 16;  // cache tokens per group
constexpr int L = disa::VEC_LANES, NV = GT / L;
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

inline vf loadv(const float* p) { return dvec::loadu<vf>(p); }
inline void storev(float* p, vf v) { dvec::storeu(p, v); }
inline vf splat(float x) {  // one broadcast (`vf{} + x` adds 0.f, then inserts lanes)
  vf v = vf{};
  v[0] = x;
  return __builtin_shuffle(v, vi{});
}
// Lane i + W of v moved to lane i (the lanes from W on: don't care).
template <int W, std::size_t... I>
constexpr vi down_mask(std::index_sequence<I...>) {
  return vi{static_cast<int>((I + W) % L)...};
}
template <int W>
inline vf down(vf v) {
  constexpr vi m = down_mask<W>(std::make_integer_sequence<std::size_t, L>{});
  return __builtin_shuffle(v, m);
}
// The lanes of v summed in one fixed tree: lane i adds lane i + w for w = L/2, ..., 1,
// the pairs of a scalar loop `t[i] += t[i + w]`, kept in registers.
template <int W = L / 2>
inline float tree_sum(vf v) {
  v += down<W>(v);
  if constexpr (W > 1)
    return tree_sum<W / 2>(v);
  else
    return v[0];
}
// Their maximum: exact in any order (no NaN reaches it), so the same tree.
template <int W = L / 2>
inline float tree_max(vf v) {
  const vf d = down<W>(v);
  v = v > d ? v : d;
  if constexpr (W > 1)
    return tree_max<W / 2>(v);
  else
    return v[0];
}

// One cache row of D values as fp32: the values, or codes times the row's fp16 scale.
// bf16 widens L lanes at a time (16-lane vectors spill on narrower machines).
template <typename KV>
inline void widen_row(const KV* row, int64_t D, float* out) {
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
#ifdef __AVX512F__
    // one zero-extending load a vector (GCC splits the generic form into halves)
    for (int64_t c = 0; c < D; c += 16)
      _mm512_storeu_si512(out + c, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                         reinterpret_cast<const __m256i*>(row + c))),
                                                     16));
#else
    typedef uint32_t vu __attribute__((vector_size(4 * L)));
    typedef uint16_t vh __attribute__((vector_size(2 * L)));
    for (int64_t c = 0; c < D; c += L) storev(out + c, dvec::widen_bf16<vf, vu, vh>(row + c));
#endif
  } else if constexpr (std::is_same_v<KV, float>) {
    std::memcpy(out, row, D * sizeof(float));
  } else {
    float scale = 1.f;
    if constexpr (sizeof(KV) == 1) {
      c10::Half s;
      std::memcpy(&s, row + D, sizeof(s));
      scale = static_cast<float>(s);
    }
    for (int64_t c = 0; c < D; c += dvec::W) {
      dvec::v16f v = dvec::load16(row + c);
      if constexpr (sizeof(KV) == 1) v *= scale;
      dvec::store16(out + c, v);
    }
  }
}

// A query row's running state: its pre-scaled query [D], output sums [D], max and sum,
// and the tokens of the current group that are its own (t0 .. t1-1).
struct RowState {
  const float* q;
  const c10::BFloat16* qb;  // the row's bf16 query, unscaled (the VDPBF16PS scores)
  float* acc;
  float m, l;
  int64_t t0, t1;
};

// A row's 16 scores over one group of GT cache tokens. Each is the same sum on both
// layouts: lane j of a vector accumulates q[cL + j] k[cL + j] over c in order, and the
// L lanes are then added in `tree_sum`'s tree. From the keys transposed (kt [D][GT],
// for items of many rows: the transposition is shared) every lane j is a vector of
// its own over the tokens; from the key rows (kr [GT][D], for a decode's few rows)
// each token is one vector chain, then the tree.
template <int D>
inline void scores_kt(const RowState& s, const float* kt, float* out) {
  vf part[L][NV];
  for (int j = 0; j < L; ++j)
    for (int v = 0; v < NV; ++v) part[j][v] = vf{};
  for (int c = 0; c < D / L; ++c)
    for (int j = 0; j < L; ++j) {
      const vf qd = splat(s.q[c * L + j]);
      const float* k = kt + (c * L + j) * GT;
      for (int v = 0; v < NV; ++v) part[j][v] += qd * loadv(k + v * L);
    }
  for (int w = L / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j)
      for (int v = 0; v < NV; ++v) part[j][v] += part[j + w][v];
  for (int v = 0; v < NV; ++v) storev(out + v * L, part[0][v]);
}

// The tree of `tree_sum` taken over L vectors at once: `halve<S>` adds, for the tokens
// of x and then of y (each in blocks of S lanes), lane i of a block to lane i + S/2,
// the same pairs as one level of the tree, so each token's sum is bit for bit
// tree_sum's; after the last level lane u holds token u's sum.
constexpr int half_src(int S, bool high, int o) {
  const int h = S / 2, per = L / S, tk = o / h, w = o % h;
  return (tk < per ? tk * S : L + (tk - per) * S) + w + (high ? h : 0);
}
template <int S, bool High, std::size_t... I>
constexpr vi half_mask(std::index_sequence<I...>) {
  return vi{half_src(S, High, static_cast<int>(I))...};
}
template <int S>
inline vf halve(vf x, vf y) {
  constexpr vi lo = half_mask<S, false>(std::make_integer_sequence<std::size_t, L>{});
  constexpr vi hi = half_mask<S, true>(std::make_integer_sequence<std::size_t, L>{});
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}
template <int S>
__attribute__((always_inline)) inline void tree_levels(vf* a, int n) {
  for (int i = 0; i < n / 2; ++i) a[i] = halve<S>(a[2 * i], a[2 * i + 1]);
  if constexpr (S > 2) tree_levels<S / 2>(a, n / 2);
}

template <int D>
inline void scores_kr(const RowState& s, const float* kr, float* out) {
  for (int t = 0; t < GT; t += L) {  // L tokens at once: independent chains, one tree
    vf a[L];
    for (int u = 0; u < L; ++u) a[u] = vf{};
    for (int c = 0; c < D / L; ++c) {
      const vf qc = loadv(s.q + c * L);
      for (int u = 0; u < L; ++u) a[u] += qc * loadv(kr + (t + u) * D + c * L);
    }
    tree_levels<L>(a, L);
    storev(out + t, a[0]);
  }
}

#ifdef DIPTYCH_HAVE_AVX512_BF16
// With AVX512-BF16, a bf16 query over a bf16 cache (head dims a multiple of 32) takes
// its scores as VDPBF16PS dot products on the bf16 values, unwidened: lane j of a
// vector adds, chunk by chunk of 32 values in order, the products of its pair (2j,
// 2j + 1) (one instruction, odd element first); the 16 lanes are then added in the
// same tree as above, and the sum is multiplied by the softmax scale. Here the key
// rows (kr: [GT][D] bf16) give each token one vector chain; lanes_group below takes
// lane j's chain of 16 rows as one vector over the key's pairs broadcast: the same
// instructions on the same pairs in the same order, so the same bits.
static_assert(L == 16 && GT == 16, "the VDPBF16PS scores take 16 lanes and tokens");
template <int D>
inline void scores_kr_dp(const RowState& s, const c10::BFloat16* kr, int64_t krs, float scale,
                         float* out) {  // krs: elements from one key row to the next
  vf a[L];
  for (int u = 0; u < L; ++u) a[u] = vf{};
  for (int c = 0; c < D / 32; ++c) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(s.qb + c * 32);
    for (int u = 0; u < L; ++u)
      a[u] = (vf)_mm512_dpbf16_ps((__m512)a[u],
                                  (__m512bh)_mm512_loadu_si512(kr + u * krs + c * 32), qc);
  }
  tree_levels<L>(a, L);
  storev(out, a[0] * splat(scale));
}
#endif

// A row's online-softmax update and P @ V over the group: rescaled exactly whenever
// the maximum grows, the probabilities summed in one fixed tree. vals: the values as
// fp32 rows [GT][D], accumulated in token order; or, DP, by token pairs ([GT/2][D]
// 32-bit: value pair (2i, 2i + 1) of each dim, the dims in `pair_dim`'s order), every
// pair of the group (zeros outside t0 .. t1-1) one VDPBF16PS with the pair's
// probabilities rounded to bf16, in pair order.
template <int D, bool DP = false>
inline void update(RowState& s, float* p, const void* vals) {
  const int64_t t0 = s.t0, t1 = s.t1;
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  vf lane;
  for (int i = 0; i < L; ++i) lane[i] = static_cast<float>(i);
  vf own[NV], sc[NV];
  vf top = ninf;
  for (int v = 0; v < NV; ++v) {
    const vf t = lane + static_cast<float>(v * L);
    own[v] = (vf)((t >= static_cast<float>(t0)) & (t < static_cast<float>(t1)));
    sc[v] = loadv(p + v * L);
    const vf masked = (vi)own[v] ? sc[v] : ninf;
    top = top > masked ? top : masked;
  }
  const float mx = std::max(s.m, tree_max(top));
  vf a[D / L];
  for (int c = 0; c < D / L; ++c) a[c] = loadv(s.acc + c * L);
  if (mx > s.m) {
    // DP: the vector exp of the lane-wise kernel (lanes_group), so its rows match
    const float corr = DP ? dvec::vexp_n<vf, vi>(splat(s.m - mx))[0] : std::exp(s.m - mx);
    s.l *= corr;
    for (int c = 0; c < D / L; ++c) a[c] *= corr;
    s.m = mx;
  }
  vf sum = vf{};
  for (int v = 0; v < NV; ++v) {
    const vf e = dvec::vexp_n<vf, vi>(sc[v] - mx);
    const vf pv = (vi)own[v] ? e : vf{};
    storev(p + v * L, pv);
    sum += pv;
  }
  s.l += tree_sum(sum);
#ifdef DIPTYCH_HAVE_AVX512_BF16
  if constexpr (DP) {
    uint32_t pp[GT / 2];  // the probabilities by pairs, bf16 (token 2i low)
    const __m256bh pb = _mm512_cvtneps_pbh(_mm512_loadu_ps(p));
    std::memcpy(pp, &pb, sizeof(pp));
    const uint32_t* vpp = static_cast<const uint32_t*>(vals);
    for (int64_t i = 0; i < GT / 2; ++i) {  // every pair (zeros outside t0 .. t1-1)
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i]));
      for (int c = 0; c < D / L; ++c)
        a[c] = (vf)_mm512_dpbf16_ps((__m512)a[c],
                                    (__m512bh)_mm512_loadu_si512(vpp + i * D + c * L), w);
    }
  } else
#endif
  {
    const float* vt = static_cast<const float*>(vals);
    for (int64_t t = t0; t < t1; ++t) {
      const vf w = splat(p[t]);
      const float* v = vt + t * D;
      for (int c = 0; c < D / L; ++c) a[c] += w * loadv(v + c * L);
    }
  }
  for (int c = 0; c < D / L; ++c) storev(s.acc + c * L, a[c]);
}

// Where dim d's sum sits in a DP row's accumulators: a pair of value rows is packed
// 32 dims at a time by VPUNPCKLWD / VPUNPCKHWD, whose lane 4j + i (j the 128-bit
// quarter) holds dim 8j + i (low half) or 8j + 4 + i (high half).
inline int64_t pair_dim(int64_t d) {
  const int64_t c = d / 32, r = d % 32, j = r / 8, hi = (r % 8) / 4, i = r % 4;
  return c * 32 + hi * 16 + 4 * j + i;
}

#ifdef DIPTYCH_HAVE_AVX512_BF16
alignas(64) inline const c10::BFloat16 kZeroRow[256] = {};  // a value row past the lengths

// Value rows t and t + 1 (u: null past the block or the lengths: zeros) of D dims as
// D pairs in pair_dim's order.
inline void pack_value_pair(const c10::BFloat16* v, const c10::BFloat16* u, int64_t D,
                            uint32_t* out) {
  for (int64_t c = 0; c < D; c += 32) {
    const __m512i a = _mm512_loadu_si512(v + c);
    const __m512i b = u ? _mm512_loadu_si512(u + c) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + c, _mm512_unpacklo_epi16(a, b));
    _mm512_storeu_si512(out + c + 16, _mm512_unpackhi_epi16(a, b));
  }
}
#endif

}  // namespace ddet
