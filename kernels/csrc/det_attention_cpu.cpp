// Batch-invariant paged attention for CPUs: the attention of `--deterministic`
// (engine/determinism.py).
//
// Every query row is one token at one position attending to the first seq_len tokens
// of its sequence in the paged cache, whatever the step it comes in: a whole prompt,
// a chunk, a tail after a cached prefix, a verification or a decode. A row's sums
// depend on its own query, its length and the cache alone: the cache is walked in
// groups of 16 tokens aligned to the blocks, and for each group a row computes its 16
// scores (lane j of a vector summing q[cL + j] k[cL + j] over c in order, then the L
// lanes in one fixed tree; with AVX512-BF16 and a bf16 cache, lane j adds the bf16
// pair (2j, 2j + 1) of each 32 values by VDPBF16PS instead, unwidened, see
// scores_kr_dp), the exact online-softmax update (rescaled whenever the maximum grows)
// and P @ V in token order (with VDPBF16PS, by token pairs: the value rows packed by
// pairs once a block, the probabilities rounded to bf16, see update). The rows of one
// sequence are taken up to QT positions at a time, so a block's K/V rows are widened
// (or packed) once and read by all of them from L1 (and, with 8 rows or more, the keys
// transposed once for them: the same sums over the other layout; with VDPBF16PS, the
// rows are instead the lanes of vectors, 16 at a time, see lanes_group); an item takes
// every KV head of its rows when there are enough items. Which rows share an item changes
// nothing in any row's arithmetic, so the threads take items as they free up. The
// decode kernel (paged_decode_cpu.cpp) is faster for decode batches but sums in other
// orders (its register tiles depend on the head group, its rescale is lazy), and a
// prompt's attention elsewhere is torch's SDPA, whose tiles depend on the prompt's
// length.
//
//   q            [N, H, D]         rows (H, D) contiguous, any row stride
//   k/v cache    [blocks, block, KVH, D]  (int8 / fp8: D + 2, codes then an fp16 scale)
//   block_table  [S, max_blocks]   int32, one row per sequence
//   seq_lens     [N]               int32: each query row's causal length (its position + 1)
//   row_seq      [N]               int32: each query row's sequence (rows of a sequence
//                                  consecutive, in position order)
//   out          [N, H, D]         contiguous, q's dtype
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_args.h"
#include "isa.h"
#include "vec16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t QT = 16;  // positions of one sequence per work item
constexpr int64_t GT = 16;  // cache tokens per group
constexpr int64_t kTransposeRows = 8;  // rows of an item from which keys are transposed
constexpr int64_t kLaneRows = 8;  // DP: rows of an item from which they are lanes
constexpr int L = disa::VEC_LANES, NV = GT / L;
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
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
inline void scores_kr_dp(const RowState& s, const c10::BFloat16* kr, float scale, float* out) {
  vf a[L];
  for (int u = 0; u < L; ++u) a[u] = vf{};
  for (int c = 0; c < D / 32; ++c) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(s.qb + c * 32);
    for (int u = 0; u < L; ++u)
      a[u] = (vf)_mm512_dpbf16_ps((__m512)a[u],
                                  (__m512bh)_mm512_loadu_si512(kr + u * D + c * 32), qc);
  }
  tree_levels<L>(a, L);
  storev(out, a[0] * splat(scale));
}
#endif

// A row's online-softmax update and P @ V over the group: rescaled exactly whenever
// the maximum grows, the probabilities summed in one fixed tree. vals: the values as
// fp32 rows [GT][D], accumulated in token order; or, DP, by token pairs ([GT/2][D]
// 32-bit: value pair (2i, 2i + 1) of each dim, the dims in `pair_dim`'s order), each
// pair one VDPBF16PS with the pair's probabilities rounded to bf16, in pair order.
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
alignas(64) const c10::BFloat16 kZeroRow[256] = {};  // a value row past the lengths

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

#ifdef DIPTYCH_HAVE_AVX512_BF16
// The DP attention of 16 rows of one KV head at once, one row a lane (an item's rows
// when it has kLaneRows or more): for each group and token, the 16 chains of
// scores_kr_dp as 16 vectors over the key's pairs broadcast, then their tree; the
// online softmax lane-wise; P @ V with each (pair, dim) value broadcast against the
// rows' probability pairs. Every lane does a row's arithmetic of scores_kr_dp and
// update<D, true> in the same order: the same max, the same exp (vexp_n, also for the
// rescale), the probabilities summed in tree_sum's tree, every value pair of the group
// (the masked lanes' accumulators untouched), so a row gets the same bits in either
// kernel. Compared with a row at a time, no lane-crossing trees, and the 16 rows'
// chains overlap (a 1,024-token prompt's attention took 30 % less time).
struct LaneRows {
  uint32_t* qp;   // [D/2][16] the rows' query pairs, row r in lane r
  float* ot;      // [D][16]  output sums, dims in pair_dim's order
  alignas(64) float m[16], l[16];
  alignas(64) int32_t first[16], len[16];  // each row's first and past-last position
};

inline void lanes_group(LaneRows& lr, const c10::BFloat16* kr, const uint32_t* vpp, int64_t D,
                        int64_t base, int64_t in_block, float scale) {
  const __m512i first = _mm512_load_si512(lr.first), len = _mm512_load_si512(lr.len);
  __mmask16 own[GT], active = 0;
  for (int t = 0; t < GT; ++t) {
    const __m512i pos = _mm512_set1_epi32(static_cast<int>(base + t));
    own[t] = t < in_block ? _mm512_cmpge_epi32_mask(pos, first) & _mm512_cmplt_epi32_mask(pos, len)
                          : __mmask16{0};
    active |= own[t];
  }
  if (!active) return;
  __m512 sc[GT];
  for (int t = 0; t < GT; ++t) {  // lane j's chain of scores_kr_dp a vector, then its tree
    const uint32_t* k = reinterpret_cast<const uint32_t*>(kr + t * D);
    __m512 part[L];
    for (int j = 0; j < L; ++j) part[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 2; c += L)
      for (int j = 0; j < L; ++j)
        part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_loadu_si512(lr.qp + (c + j) * 16),
                                   (__m512bh)_mm512_set1_epi32(static_cast<int>(k[c + j])));
    for (int w = L / 2; w > 0; w /= 2)
      for (int j = 0; j < w; ++j) part[j] = _mm512_add_ps(part[j], part[j + w]);
    sc[t] = part[0];
  }
  const __m512 m = _mm512_load_ps(lr.m), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = m;
  for (int t = 0; t < GT; ++t) {
    sc[t] = _mm512_mask_mul_ps(ninf, own[t], sc[t], _mm512_set1_ps(scale));
    mx = _mm512_max_ps(mx, sc[t]);
  }
  const __mmask16 grown = _mm512_cmp_ps_mask(mx, m, _CMP_GT_OQ);
  const __m512 corr = (__m512)dvec::vexp_n<vf, vi>((vf)_mm512_sub_ps(m, mx));
  _mm512_store_ps(lr.m, _mm512_mask_mov_ps(m, grown, mx));
  __m512 pr[GT], sum[GT / 2];
  for (int t = 0; t < GT; ++t)
    pr[t] = _mm512_maskz_mov_ps(own[t], (__m512)dvec::vexp_n<vf, vi>((vf)_mm512_sub_ps(sc[t], mx)));
  for (int t = 0; t < GT / 2; ++t) sum[t] = _mm512_add_ps(pr[t], pr[t + GT / 2]);
  for (int w = GT / 4; w > 0; w /= 2)
    for (int t = 0; t < w; ++t) sum[t] = _mm512_add_ps(sum[t], sum[t + w]);
  const __m512 l = _mm512_load_ps(lr.l);
  _mm512_store_ps(lr.l, _mm512_mask_add_ps(l, active, _mm512_mask_mul_ps(l, grown, l, corr), sum[0]));
  __m512bh pp[GT / 2];  // lane r: the pair (2i, 2i + 1) of row r's probabilities, bf16
  for (int i = 0; i < GT / 2; ++i) {
    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(pr[2 * i]));
    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(pr[2 * i + 1]));
    pp[i] = (__m512bh)_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
  }
  for (int64_t c = 0; c < D; c += 16) {
    __m512 o[16];
    for (int x = 0; x < 16; ++x) {
      o[x] = _mm512_loadu_ps(lr.ot + (c + x) * 16);
      o[x] = _mm512_mask_mul_ps(o[x], grown, o[x], corr);
    }
    for (int i = 0; i < GT / 2; ++i)
      for (int x = 0; x < 16; ++x)
        o[x] = _mm512_mask_dpbf16_ps(
            o[x], active, pp[i],
            (__m512bh)_mm512_set1_epi32(static_cast<int>(vpp[i * D + c + x])));
    for (int x = 0; x < 16; ++x) _mm512_storeu_ps(lr.ot + (c + x) * 16, o[x]);
  }
}
#endif

// The active rows of a group: `kt` the keys transposed (or null), `kr` their rows;
// DP: the VDPBF16PS scores (kt: pairs, kr: bf16 rows), else fp32 ones of pre-scaled
// queries (kt, kr: fp32).
template <int D, bool DP>
void group_rows(RowState* const* rs, int64_t n, const void* kt, const void* kr,
                const void* vals, float scale) {
  // Every row's scores, then every row's update, each row with its own buffer: the
  // rows of a phase are independent, so the core overlaps their dependency chains.
  constexpr int64_t kChunk = 32;
  alignas(64) float p[kChunk][GT];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < m; ++i) {
      const RowState& s = *rs[i0 + i];
#ifdef DIPTYCH_HAVE_AVX512_BF16
      if constexpr (DP) {
        scores_kr_dp<D>(s, static_cast<const c10::BFloat16*>(kr), scale, p[i]);
      } else
#endif
      {
        (void)scale;
        if (kt)
          scores_kt<D>(s, static_cast<const float*>(kt), p[i]);
        else
          scores_kr<D>(s, static_cast<const float*>(kr), p[i]);
      }
    }
    for (int64_t i = 0; i < m; ++i) update<D, DP>(*rs[i0 + i], p[i], vals);
  }
}

using GroupFn = void (*)(RowState* const*, int64_t, const void*, const void*, const void*,
                         float);

template <bool DP>
GroupFn group_fn(int64_t D) {
  switch (D) {
#define DET_D(X) \
  case X:        \
    return &group_rows<X, DP && X % 32 == 0>;
    DET_D(16) DET_D(32) DET_D(48) DET_D(64) DET_D(80) DET_D(96) DET_D(112) DET_D(128)
    DET_D(144) DET_D(160) DET_D(176) DET_D(192) DET_D(208) DET_D(224) DET_D(240) DET_D(256)
#undef DET_D
    default:
      TORCH_CHECK(false, "det_attention: head dim ", D, " is not a multiple of 16 up to 256");
  }
}

template <typename T, typename KV>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
         const at::Tensor& table, const at::Tensor& lens, const at::Tensor& seqs, float scale,
         int64_t window, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t ksb = kc.stride(0), kst = kc.stride(1), ksh = kc.stride(2);
  const int64_t vsb = vc.stride(0), vst = vc.stride(1), vsh = vc.stride(2);
  const int64_t qs = q.stride(0), ts = table.stride(0);
  const T* qp = q.data_ptr<T>();
  const KV* kp = kc.data_ptr<KV>();
  const KV* vp = vc.data_ptr<KV>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* sp = seqs.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  // tiles: runs of up to QT consecutive rows of a sequence
  const std::vector<int64_t> starts = dattn::sequence_runs(sp, N, QT);
  const int64_t ntiles = static_cast<int64_t>(starts.size()) - 1;
  const int64_t groups = (bs + GT - 1) / GT;
#ifdef DIPTYCH_HAVE_AVX512_BF16
  constexpr bool bf16_kv = std::is_same_v<T, c10::BFloat16> && std::is_same_v<KV, T>;
#else
  constexpr bool bf16_kv = false;
#endif
  const bool dp = bf16_kv && D % 32 == 0;  // the VDPBF16PS scores
  const GroupFn group = dp ? group_fn<true>(D) : group_fn<false>(D);
  const int64_t row_bytes = kc.size(3) * static_cast<int64_t>(sizeof(KV));
  auto first_of = [&](int64_t r) { return dattn::first_position(lp[r], window); };
  // A work item is a tile and a run of `hs` KV heads: all of them when there are
  // enough tiles to keep the threads busy (a block's rows are then read whole, every
  // head in turn, and prefetched as one range), one otherwise. Items go to the threads
  // as they free up, the longest (the last tiles of the longest sequences, listed
  // last) first: a static split gave one thread the triangle's long half.
  const int64_t hs = ntiles >= 2 * at::get_num_threads() ? KVH : 1;
  const int64_t per_tile = KVH / hs, items = ntiles * per_tile;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  const int64_t span = (hs - 1) * ksh * static_cast<int64_t>(sizeof(KV)) + row_bytes;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // fp32 queries and keys for the fp32 scores; with dp, the key rows as they are and
    // transposed by pairs (the queries are read in place)
    const int64_t fk = dp ? 0 : groups * GT * D, bk = dp ? groups * GT * D : 0;
    std::vector<float> qf(dp ? 0 : QT * G * hs * D), acc(QT * G * hs * D);
    std::vector<float> kr(fk), kt(fk), vt(dp ? 0 : groups * GT * D);
    std::vector<uint32_t> vp2(dp ? groups * (GT / 2) * D : 0);  // values by pairs
    std::vector<KV> krb(bk);
    std::vector<RowState> rows(QT * G * hs);
    std::vector<RowState*> live(QT * G);
#ifdef DIPTYCH_HAVE_AVX512_BF16
    const int64_t nlanes = dp ? hs * ((QT * G + 15) / 16) : 0;  // lane vectors of an item
    std::vector<LaneRows> lrows(nlanes);
    std::vector<uint32_t> lq(nlanes * (D / 2) * 16);
    std::vector<float> lacc(nlanes * D * 16);
#endif
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t tile = ntiles - 1 - item / per_tile, h0 = (item % per_tile) * hs;
      const int64_t r0 = starts[tile], r1 = starts[tile + 1], nh = (r1 - r0) * G;
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = 0; i < nh * hs; ++i) {  // row i: head h0 + i / nh, its rows in order
        const int64_t r = r0 + (i % nh) / G, head = (h0 + i / nh) * G + i % G;
        float* qi = dp ? nullptr : qf.data() + i * D;
        const T* qrow = qp + r * qs + head * D;
        if (!dp) {
          widen_row(qrow, D, qi);
          for (int64_t d = 0; d < D; ++d) qi[d] *= scale;
        }
        std::fill_n(acc.data() + i * D, D, 0.f);
        rows[i] = RowState{qi, reinterpret_cast<const c10::BFloat16*>(qrow), acc.data() + i * D,
                           -std::numeric_limits<float>::infinity(), 0.f, 0, 0};
        lo = std::min(lo, first_of(r));
        hi = std::max<int64_t>(hi, lp[r]);
      }
      const int32_t* blocks = tp + sp[r0] * ts;
      const bool transpose = nh >= kTransposeRows;
      const int64_t nvec = (nh + 15) / 16;  // lane vectors a head
#ifdef DIPTYCH_HAVE_AVX512_BF16
      const bool lanes = dp && nh >= kLaneRows;
      for (int64_t v = 0; lanes && v < nvec * hs; ++v) {  // rows 16v' .. of head v / nvec
        LaneRows& lr = lrows[v];
        lr.qp = lq.data() + v * (D / 2) * 16;
        lr.ot = lacc.data() + v * D * 16;
        std::fill_n(lr.ot, D * 16, 0.f);
        for (int64_t x = 0; x < 16; ++x) {
          const int64_t i = (v % nvec) * 16 + x;
          const RowState* st = i < nh ? &rows[(v / nvec) * nh + i] : nullptr;
          const uint32_t* qr = st ? reinterpret_cast<const uint32_t*>(st->qb) : nullptr;
          for (int64_t p = 0; p < D / 2; ++p) lr.qp[p * 16 + x] = qr ? qr[p] : 0u;
          lr.m[x] = -std::numeric_limits<float>::infinity();
          lr.l[x] = 0.f;
          lr.first[x] = st ? static_cast<int32_t>(first_of(r0 + i / G))
                           : std::numeric_limits<int32_t>::max();
          lr.len[x] = st ? lp[r0 + i / G] : 0;
        }
      }
#else
      constexpr bool lanes = false;
#endif
      for (int64_t j = hi > lo ? lo / bs : 0; hi > lo && j <= (hi - 1) / bs; ++j) {
        const int64_t blk = blocks[j];
        const int64_t nxt = j < (hi - 1) / bs ? blocks[j + 1] : -1;
        for (int64_t hh = 0; hh < hs; ++hh) {
          const int64_t h = h0 + hh;
          // the next block's rows (every head of the item), a share before each head's
          // compute; non-temporal: each line is read once a step
          for (int64_t t = hh * bs / hs; nxt >= 0 && t < (hh + 1) * bs / hs; ++t)
            for (int64_t off = 0; off < span; off += 64) {
              __builtin_prefetch(
                  reinterpret_cast<const char*>(kp + nxt * ksb + t * kst + h0 * ksh) + off, 0, 0);
              __builtin_prefetch(
                  reinterpret_cast<const char*>(vp + nxt * vsb + t * vst + h0 * vsh) + off, 0, 0);
            }
          // this block's rows of head h (keys and values widened to fp32), and the keys
          // transposed where the head has enough rows to share the transposition
          if (bs % GT) {  // a partial group's missing tokens read as zeros
            std::fill(kr.begin(), kr.end(), 0.f);
            std::fill(kt.begin(), kt.end(), 0.f);
            std::fill(vt.begin(), vt.end(), 0.f);
            std::fill(vp2.begin(), vp2.end(), 0u);
            std::fill(krb.begin(), krb.end(), KV{});
          }
          for (int64_t t = 0; t < bs; ++t) {
            const KV* krow = kp + blk * ksb + t * kst + h * ksh;
            if (dp)
              std::memcpy(krb.data() + t * D, krow, D * sizeof(KV));
            else
              widen_row(krow, D, kr.data() + t * D);
            if (!dp) widen_row(vp + blk * vsb + t * vst + h * vsh, D, vt.data() + t * D);
          }
#ifdef DIPTYCH_HAVE_AVX512_BF16
          if constexpr (bf16_kv) {
            for (int64_t t = 0; dp && t < bs; t += 2) {  // values past hi: zeros
              const int64_t pos = j * bs + t;
              const KV* v = pos < hi ? vp + blk * vsb + t * vst + h * vsh : kZeroRow;
              const KV* u = t + 1 < bs && pos + 1 < hi ? v + vst : nullptr;
              pack_value_pair(v, u, D,
                              vp2.data() + (t / GT) * (GT / 2) * D + (t % GT) / 2 * D);
            }
          }
#endif
          if (!dp && transpose)
            for (int64_t t = 0; t < bs; ++t) {
              const float* k = kr.data() + t * D;
              float* ktg = kt.data() + (t / GT) * D * GT + t % GT;
              for (int64_t d = 0; d < D; ++d) ktg[d * GT] = k[d];
            }
          for (int64_t g = 0; g < groups; ++g) {
            const int64_t base = j * bs + g * GT, in_block = std::min<int64_t>(GT, bs - g * GT);
#ifdef DIPTYCH_HAVE_AVX512_BF16
            if constexpr (bf16_kv)
              if (lanes) {
                for (int64_t v = 0; v < nvec; ++v)
                  lanes_group(lrows[hh * nvec + v], krb.data() + g * GT * D,
                              vp2.data() + g * (GT / 2) * D, D, base, in_block, scale);
                continue;
              }
#endif
            int64_t active = 0;
            for (int64_t i = 0; i < nh; ++i) {
              const int64_t r = r0 + i / G;
              RowState& st = rows[hh * nh + i];
              st.t0 = std::max<int64_t>(first_of(r) - base, 0);
              st.t1 = std::min<int64_t>(lp[r] - base, in_block);
              if (st.t1 > st.t0) live[active++] = &st;
            }
            const void* kt_g = dp || !transpose ? nullptr
                                          : static_cast<const void*>(kt.data() + g * D * GT);
            const void* kr_g = dp ? static_cast<const void*>(krb.data() + g * GT * D)
                                  : static_cast<const void*>(kr.data() + g * GT * D);
            const void* vals = dp ? static_cast<const void*>(vp2.data() + g * (GT / 2) * D)
                                  : static_cast<const void*>(vt.data() + g * GT * D);
            group(live.data(), active, kt_g, kr_g, vals, scale);
          }
        }
      }
#ifdef DIPTYCH_HAVE_AVX512_BF16
      for (int64_t i = 0; lanes && i < nh * hs; ++i) {  // the lanes' sums to their rows
        const LaneRows& lr = lrows[(i / nh) * nvec + (i % nh) / 16];
        const int64_t x = (i % nh) % 16;
        rows[i].l = lr.l[x];
        for (int64_t d = 0; d < D; ++d) rows[i].acc[d] = lr.ot[d * 16 + x];
      }
#endif
      for (int64_t i = 0; i < nh * hs; ++i) {
        const int64_t r = r0 + (i % nh) / G, head = (h0 + i / nh) * G + i % G;
        const float inv = rows[i].l > 0.f ? 1.f / rows[i].l : 0.f;
        float* a = rows[i].acc;
        if (dp) {  // the sums back in dim order
          alignas(64) float by_dim[256];
          for (int64_t d = 0; d < D; ++d) by_dim[d] = a[pair_dim(d)];
          std::copy_n(by_dim, D, a);
        }
        for (int64_t c = 0; c < D; c += dvec::W)
          dvec::store16(op + (r * H + head) * D + c, dvec::load16(a + c) * inv);
      }
    }
  });
}

void det_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                   const at::Tensor& row_seq, double scale, int64_t window, at::Tensor out) {
  const auto [q8, f8] =
      dattn::check_det_args("det_attention", q, k_cache, v_cache, block_table, seq_lens,
                            row_seq, out);
  const float s = static_cast<float>(scale);
#define DET_KV(T)                                                                              \
  if (q8)                                                                                      \
    run<T, int8_t>(q, k_cache, v_cache, block_table, seq_lens, row_seq, s, window, out);       \
  else if (f8)                                                                                 \
    run<T, c10::Float8_e4m3fn>(q, k_cache, v_cache, block_table, seq_lens, row_seq, s, window, \
                               out);                                                           \
  else                                                                                         \
    run<T, T>(q, k_cache, v_cache, block_table, seq_lens, row_seq, s, window, out);
  switch (q.scalar_type()) {
    case at::kFloat: { DET_KV(float) break; }
    case at::kBFloat16: { DET_KV(c10::BFloat16) break; }
    case at::kHalf: { DET_KV(c10::Half) break; }
    default: TORCH_CHECK(false, "det_attention: unsupported dtype ", q.scalar_type());
  }
#undef DET_KV
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("det_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor row_seq, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("det_attention", &det_attention); }
