// The batch-invariant CPU attention's rows as the lanes of vectors, 16 at a time, with
// AVX512-BF16 (det_attention_cpu.cpp takes it for items of many rows): each lane's
// arithmetic is exactly det_attention_rows.h's for one row. Only det_attention_cpu.cpp
// includes it.
#pragma once

#include "det_attention_rows.h"

namespace ddet {

#ifdef DIPTYCH_HAVE_AVX512_BF16
// The DP attention of 16 rows of one KV head at once, one row a lane (an item's rows
// when it has det_attention_cpu.cpp's kLaneRows or more): for each group and token,
// the 16 chains of scores_kr_dp as 16 vectors over the key's pairs broadcast, then
// their tree; the online softmax lane-wise; P @ V with each (pair, dim) value broadcast against the
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
  const __m512 m = _mm512_load_ps(lr.m);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
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
  const __m512 rescaled = _mm512_mask_mul_ps(l, grown, l, corr);
  _mm512_store_ps(lr.l, _mm512_mask_add_ps(l, active, rescaled, sum[0]));
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

}  // namespace ddet
