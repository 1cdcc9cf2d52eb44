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
#include "det_attention_lanes.h"
#include "det_attention_rows.h"
#include "paged_decode_driver.h"
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

using namespace ddet;

constexpr int64_t QT = 16;  // positions of one sequence per work item
constexpr int64_t kTransposeRows = 8;  // rows of an item from which keys are transposed
constexpr int64_t kLaneRows = 8;  // DP: rows of an item from which they are lanes

// The active rows of a group: `kt` the keys transposed (or null), `kr` their rows;
// DP: the VDPBF16PS scores on the bf16 key rows (kt unused: an item of many rows takes
// lanes_group instead), else fp32 ones of pre-scaled queries (kt, kr: fp32).
template <int D, bool DP>
void group_rows(RowState* const* rs, int64_t n, const void* kt, const void* kr, int64_t krs,
                const void* vals, float scale, pattn::Prefetcher& pf) {
  // Every row's scores, then every row's update, each row with its own buffer: the
  // rows of a phase are independent, so the core overlaps their dependency chains.
  constexpr int64_t kChunk = 32;
  alignas(64) float p[kChunk][GT];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    for (int64_t i = 0; i < m; ++i) {
      const RowState& s = *rs[i0 + i];
      pf.step(4);
#ifdef DIPTYCH_HAVE_AVX512_BF16
      if constexpr (DP) {
        scores_kr_dp<D>(s, static_cast<const c10::BFloat16*>(kr), krs, scale, p[i]);
      } else
#endif
      {
        (void)scale, (void)krs;
        if (kt)
          scores_kt<D>(s, static_cast<const float*>(kt), p[i]);
        else
          scores_kr<D>(s, static_cast<const float*>(kr), p[i]);
      }
    }
    for (int64_t i = 0; i < m; ++i) update<D, DP>(*rs[i0 + i], p[i], vals);
  }
}

using GroupFn = void (*)(RowState* const*, int64_t, const void*, const void*, int64_t,
                         const void*, float, pattn::Prefetcher&);

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
    pattn::Prefetcher pf;
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
#ifdef DIPTYCH_HAVE_AVX512_BF16
      const int64_t nvec = (nh + 15) / 16;  // lane vectors a head
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
      // DP rows one at a time read the bf16 key rows where they are (whole groups only)
      const bool keys_in_place = dp && !lanes && bs % GT == 0;
      for (int64_t j = hi > lo ? lo / bs : 0; hi > lo && j <= (hi - 1) / bs; ++j) {
        const int64_t blk = blocks[j];
        const int64_t nxt = j < (hi - 1) / bs ? blocks[j + 1] : -1;
        // the next block's rows (every head of the item), a few lines at a time through
        // this block's compute: issued at once they filled the miss buffers and stalled
        // the core (a third of the batch-64 decode's time went to them and the loads)
        pf.reset(reinterpret_cast<const char*>(kp + std::max<int64_t>(nxt, 0) * ksb + h0 * ksh),
                 reinterpret_cast<const char*>(vp + std::max<int64_t>(nxt, 0) * vsb + h0 * vsh),
                 kst * static_cast<int64_t>(sizeof(KV)), vst * static_cast<int64_t>(sizeof(KV)),
                 span, nxt >= 0 ? bs : 0);
        for (int64_t hh = 0; hh < hs; ++hh) {
          const int64_t h = h0 + hh;
          // this block's rows of head h (keys and values widened to fp32), and the keys
          // transposed where the head has enough rows to share the transposition
          if (bs % GT) {  // a partial group's missing tokens read as zeros
            std::fill(kr.begin(), kr.end(), 0.f);
            std::fill(kt.begin(), kt.end(), 0.f);
            std::fill(vt.begin(), vt.end(), 0.f);
            std::fill(vp2.begin(), vp2.end(), 0u);
            std::fill(krb.begin(), krb.end(), KV{});
          }
          for (int64_t t = 0; t < bs && !keys_in_place; ++t) {
            const KV* krow = kp + blk * ksb + t * kst + h * ksh;
            if (dp)
              std::memcpy(krb.data() + t * D, krow, D * sizeof(KV));
            else
              widen_row(krow, D, kr.data() + t * D);
            if (!dp) widen_row(vp + blk * vsb + t * vst + h * vsh, D, vt.data() + t * D);
            pf.step(1);
          }
#ifdef DIPTYCH_HAVE_AVX512_BF16
          if constexpr (bf16_kv) {
            for (int64_t t = 0; dp && t < bs; t += 2) {  // values past hi: zeros
              const int64_t pos = j * bs + t;
              const KV* v = pos < hi ? vp + blk * vsb + t * vst + h * vsh : kZeroRow;
              const KV* u = t + 1 < bs && pos + 1 < hi ? v + vst : nullptr;
              pf.step(2);
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
                  pf.step(8), lanes_group(lrows[hh * nvec + v], krb.data() + g * GT * D,
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
            const void* kr_g =
                keys_in_place ? static_cast<const void*>(kp + blk * ksb + g * GT * kst + h * ksh)
                : dp          ? static_cast<const void*>(krb.data() + g * GT * D)
                              : static_cast<const void*>(kr.data() + g * GT * D);
            const void* vals = dp ? static_cast<const void*>(vp2.data() + g * (GT / 2) * D)
                                  : static_cast<const void*>(vt.data() + g * GT * D);
            group(live.data(), active, kt_g, kr_g, keys_in_place ? kst : D, vals, scale, pf);
          }
        }
        pf.finish();
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
