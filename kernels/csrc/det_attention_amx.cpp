// Batch-invariant paged attention on AMX tiles: `--deterministic`'s attention at the
// amx level (Sapphire Rapids and later) for a bf16 query over a bf16 cache, head dims a
// multiple of 32. The contract is det_attention_cpu.cpp's: every query row is one token
// attending to the first seq_len tokens of its sequence, and its sums depend on its own
// query, its length and the cache alone, whatever the step it comes in (a whole
// prompt, a chunk, a tail after a cached prefix, a verification, a decode).
//
// The rows of a work item (up to 16 positions of one sequence, one KV head) are taken
// as lanes, sixteen at a time: the query rows of its heads, position by position. The
// cache is walked in groups of 16 tokens at absolute positions 16g .. 16g + 15, and per
// group and set of lanes:
//   S^T [16 tokens][16 lanes] = K rows (TDPBF16PS's A, read from the cache in place)
//                               x the lanes' queries packed by pairs (its B), over the
//                               head dim in k tiles of 32, in order;
//   the online softmax, lane-wise: scaled scores, the running maximum (exact), the
//   correction exp(m - m') where it grew, probabilities rounded to bf16 and their sum
//   taken token by token;
//   O^T [D][16 lanes] += V^T (A: the group's values transposed, shared by the item's
//                         sets) x P (B: the probabilities packed by token pairs), one
//                         product a 16-dim block, added to the accumulators as
//                         acc * corr + product.
// A tile unit computes each output element from its own row of A and column of B, so a
// lane's bits never depend on the lanes beside it; a token outside a lane's range gets
// probability zero, and a group with none of its tokens leaves its state as it was
// (corr 1, products +0). The values of tokens past every lane's length (another
// sequence's, or never written) are read as zeros.
//
// The sums are not det_attention_cpu.cpp's (scores by tile products, probabilities in
// bf16): the engine's numerics key names the amx level apart (engine/determinism.py),
// and every row of a step at that level comes here, decodes included.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_args.h"
#include "isa.h"
#include "vec16.h"

#if defined(DIPTYCH_HAVE_AVX512_BF16) && defined(__linux__) && defined(__x86_64__)
#include <immintrin.h>

#include "amx_tiles.h"

namespace {

constexpr int64_t LN = 16;  // lanes: query rows of a set
constexpr int64_t GT = 16;  // cache tokens of a group
constexpr int64_t QT = 16;  // positions of a sequence per item
alignas(64) const c10::BFloat16 kZeros[256] = {};  // a value row past every length

// Tiles: 0 S^T, 1 and 6 two blocks of O^T, 2 K rows (16 tokens x 32 dims), 3 the
// queries' pairs (16 dim pairs x 16 lanes), 4 and 7 V^T (16 dims x 16 tokens each),
// 5 P's pairs (8 x 16 lanes).
AMX_FN void configure() {
  damx::TileConfig c;
  for (int t : {0, 1, 2, 3, 6}) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  for (int t : {4, 7}) {
    c.rows[t] = 16;
    c.colsb[t] = 32;
  }
  c.rows[5] = 8;
  c.colsb[5] = 64;
  damx::load_config(c);
}

AMX_FN void release() { _tile_release(); }

using dvec::v16f;
using dvec::v16i;

inline v16f splat(float x) { return v16f{} + x; }

// A set of up to 16 lanes: its queries by pairs ([D/2][16] 32-bit, zero for an unused
// lane), where each lane's output goes, its token range, and its running state.
struct LaneSet {
  uint32_t* qt;
  float* acc;  // O^T sums [D][16]
  v16f first, len, m, l;
  int64_t out[LN];  // element offset of each used lane's output row
  int64_t n;
};

// The softmax of one group for a set: s [16 tokens][16 lanes] the raw products at
// positions base .. base + 15. Writes P's token pairs (pp: [8][16] 32-bit, bf16 of
// token 2i low, 2i + 1 high) and returns each lane's correction of the old sums.
inline v16f softmax_group(LaneSet& st, const float* s, float scale, int64_t base,
                          uint32_t* pp) {
  const v16f ninf = splat(-std::numeric_limits<float>::infinity());
  v16f sc[GT];
  v16f mx = st.m;
  for (int64_t t = 0; t < GT; ++t) {
    const v16f pos = splat(static_cast<float>(base + t));
    const v16i valid = (pos >= st.first) & (pos < st.len);
    sc[t] = valid ? dvec::load16(s + t * LN) * scale : ninf;
    mx = mx > sc[t] ? mx : sc[t];
  }
  const v16i grew = mx > st.m;
  const v16f corr = grew ? dvec::vexp_n<v16f, v16i>(st.m - mx) : splat(1.f);
  st.m = mx;
  v16f l = st.l * corr;
  __m512i wide[GT];  // each token's probabilities rounded to bf16, in the high halves
  for (int64_t t = 0; t < GT; ++t) {
    const v16i live = sc[t] > ninf;
    const v16f p = live ? dvec::vexp_n<v16f, v16i>(sc[t] - mx) : v16f{};
    wide[t] = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)p)), 16);
    l += (v16f)wide[t];  // the sum takes them as P @ V does: rounded
  }
  st.l = l;
  for (int64_t i = 0; i < GT / 2; ++i)
    _mm512_store_si512(pp + i * LN,
                       _mm512_or_si512(_mm512_srli_epi32(wide[2 * i], 16), wide[2 * i + 1]));
  return corr;
}

// A 16 x 16 block of 16-bit values transposed in registers: rows[t] points at row t's
// 16 values, out[d * 16 + t] = rows[t][d]. The block is 8 vectors of 32 values, a
// value's place 8 bits (t3 t2 t1 | t0 d3 d2 d1 d0); three rounds of two-vector
// permutes swap the vector bits t3 t2 t1 with d3 d2 d1, and one in-vector permute puts
// (d0 t3 t2 t1 t0) in order.
struct SwapIdx {
  alignas(64) int16_t x[32];
  alignas(64) int16_t y[32];
};
constexpr SwapIdx swap_idx(int bit) {
  SwapIdx s{};
  const int m = 1 << bit;
  for (int e = 0; e < 32; ++e) {
    s.x[e] = static_cast<int16_t>((e & m) ? 32 + (e & ~m) : e);
    s.y[e] = static_cast<int16_t>((e & m) ? 32 + e : (e | m));
  }
  return s;
}
struct LastIdx {
  alignas(64) int16_t v[32];
};
constexpr LastIdx last_idx() {
  LastIdx s{};
  for (int e = 0; e < 32; ++e)
    s.v[e] = static_cast<int16_t>(((e & 1) << 4) | (e & 14) | (e >> 4));
  return s;
}
constexpr SwapIdx kSwap[3] = {swap_idx(1), swap_idx(2), swap_idx(3)};
constexpr LastIdx kLast = last_idx();

inline void transpose16(const c10::BFloat16* const* rows, c10::BFloat16* out) {
  __m512i z[8];
  for (int i = 0; i < 8; ++i)
    z[i] = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * i]))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[2 * i + 1])), 1);
  for (int round = 2; round >= 0; --round) {  // vector bit `round` with value bit round + 1
    const __m512i ix = _mm512_load_si512(kSwap[round].x), iy = _mm512_load_si512(kSwap[round].y);
    for (int i = 0; i < 8; ++i) {
      if (i & (1 << round)) continue;
      const __m512i x = z[i], y = z[i | (1 << round)];
      z[i] = _mm512_permutex2var_epi16(x, ix, y);
      z[i | (1 << round)] = _mm512_permutex2var_epi16(x, iy, y);
    }
  }
  const __m512i il = _mm512_load_si512(kLast.v);
  for (int i = 0; i < 8; ++i) _mm512_storeu_si512(out + 32 * i, _mm512_permutexvar_epi16(il, z[i]));
}

struct Shape {
  int64_t D, G, KVH, bs;
  int64_t ksb, kst, ksh, vsb, vst, vsh, qs;
};

AMX_FN void item(const Shape& sh, const c10::BFloat16* qp, const c10::BFloat16* kp,
                 const c10::BFloat16* vp, const int32_t* blocks, const int32_t* lp,
                 int64_t r0, int64_t r1, int64_t h, float scale, int64_t window,
                 c10::BFloat16* op, std::vector<LaneSet>& sets, std::vector<uint32_t>& qt,
                 std::vector<float>& acc, std::vector<c10::BFloat16>& vt,
                 std::vector<c10::BFloat16>& kbuf) {
  const int64_t D = sh.D, G = sh.G, bs = sh.bs, H = G * sh.KVH;
  const int64_t lanes = (r1 - r0) * G, nsets = (lanes + LN - 1) / LN;
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t s = 0; s < nsets; ++s) {
    LaneSet& st = sets[s];
    st.qt = qt.data() + s * (D / 2) * LN;
    st.acc = acc.data() + s * D * LN;
    std::fill_n(st.qt, (D / 2) * LN, 0u);
    std::fill_n(st.acc, D * LN, 0.f);
    st.n = std::min(LN, lanes - s * LN);
    st.m = splat(-std::numeric_limits<float>::infinity());
    st.l = v16f{};
    st.first = v16f{};
    st.len = v16f{};
    for (int64_t j = 0; j < LN; ++j) {
      if (j >= st.n) continue;
      const int64_t lane = s * LN + j, r = r0 + lane / G, head = h * G + lane % G;
      const int64_t len = lp[r], first = dattn::first_position(len, window);
      st.first[j] = static_cast<float>(first);
      st.len[j] = static_cast<float>(len);
      lo = std::min(lo, first);
      hi = std::max(hi, len);
      st.out[j] = (r * H + head) * D;
      const uint32_t* q = reinterpret_cast<const uint32_t*>(qp + r * sh.qs + head * D);
      for (int64_t d2 = 0; d2 < D / 2; ++d2) st.qt[d2 * LN + j] = q[d2];
    }
  }
  alignas(64) float s[GT * LN], c[32 * LN];
  alignas(64) uint32_t pp[GT / 2 * LN];
  const bool in_place = bs % GT == 0;
  for (int64_t g = hi > lo ? lo / GT : 0; hi > lo && g <= (hi - 1) / GT; ++g) {
    const int64_t base = g * GT;
    // V^T of the group (zeros past hi); the K rows in place, or copied where a group
    // spans blocks
    const c10::BFloat16* vrow[GT];
    for (int64_t t = 0; t < GT; ++t) {
      const int64_t pos = base + t;
      if (pos >= hi) {
        vrow[t] = kZeros;
        if (!in_place) std::fill_n(kbuf.data() + t * D, D, c10::BFloat16(0.f));
        continue;
      }
      const int64_t blk = blocks[pos / bs], off = pos % bs;
      vrow[t] = vp + blk * sh.vsb + off * sh.vst + h * sh.vsh;
      if (!in_place)
        std::memcpy(kbuf.data() + t * D, kp + blk * sh.ksb + off * sh.kst + h * sh.ksh, D * 2);
    }
    for (int64_t db = 0; db < D / 16; ++db) {
      const c10::BFloat16* rows[GT];
      for (int64_t t = 0; t < GT; ++t) rows[t] = vrow[t] + db * 16;  // kZeros: 256 wide
      transpose16(rows, vt.data() + db * 16 * GT);
    }
    const c10::BFloat16* krows =
        in_place ? kp + blocks[base / bs] * sh.ksb + (base % bs) * sh.kst + h * sh.ksh
                 : kbuf.data();
    const int64_t kstride = (in_place ? sh.kst : D) * 2;
    for (int64_t si = 0; si < nsets; ++si) {
      LaneSet& st = sets[si];
      _tile_zero(0);
      for (int64_t kt = 0; kt < D / 32; ++kt) {
        _tile_loadd(2, krows + kt * 32, kstride);
        _tile_loadd(3, st.qt + kt * 16 * LN, 64);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, s, 64);
      const v16f corr = softmax_group(st, s, scale, base, pp);
      _tile_loadd(5, pp, 64);
      for (int64_t db = 0; db < D / 16; db += 2) {  // two blocks of O^T at a time
        _tile_zero(1);
        _tile_zero(6);
        _tile_loadd(4, vt.data() + db * 16 * GT, 32);
        _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(7, vt.data() + (db + 1) * 16 * GT, 32);
        _tile_dpbf16ps(6, 7, 5);
        _tile_stored(1, c, 64);
        _tile_stored(6, c + 16 * LN, 64);
        float* a = st.acc + db * 16 * LN;
        for (int64_t d = 0; d < 32; ++d)
          _mm512_storeu_ps(a + d * LN, _mm512_fmadd_ps(_mm512_loadu_ps(a + d * LN), (__m512)corr,
                                                       _mm512_loadu_ps(c + d * LN)));
      }
    }
  }
  for (int64_t si = 0; si < nsets; ++si) {
    const LaneSet& st = sets[si];
    const v16f inv = st.l > v16f{} ? splat(1.f) / st.l : v16f{};
    for (int64_t d = 0; d < D; ++d)
      dvec::store16(st.acc + d * LN, dvec::load16(st.acc + d * LN) * inv);
    for (int64_t j = 0; j < st.n; ++j)
      for (int64_t d = 0; d < D; ++d) op[st.out[j] + d] = c10::BFloat16(st.acc[d * LN + j]);
  }
}

bool det_attention_amx_available() { return damx::tiles_available(); }

void det_attention_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, const at::Tensor& seq_lens,
                       const at::Tensor& row_seq, double scale, int64_t window, at::Tensor out) {
  TORCH_CHECK(det_attention_amx_available(),
              "det_attention_amx: this CPU (or kernel) lends no AMX tiles");
  dattn::check_det_args("det_attention_amx", q, k_cache, v_cache, block_table, seq_lens,
                        row_seq, out);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "det_attention_amx takes a bf16 query over a bf16 cache");
  const int64_t N = q.size(0), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(D % 32 == 0, "det_attention_amx: head_dim must be a multiple of 32, got ", D);
  const Shape sh{D,
                 q.size(1) / KVH,
                 KVH,
                 k_cache.size(1),
                 k_cache.stride(0),
                 k_cache.stride(1),
                 k_cache.stride(2),
                 v_cache.stride(0),
                 v_cache.stride(1),
                 v_cache.stride(2),
                 q.stride(0)};
  const int32_t* sp = row_seq.data_ptr<int32_t>();
  const std::vector<int64_t> starts = dattn::sequence_runs(sp, N, QT);
  const int64_t ntiles = static_cast<int64_t>(starts.size()) - 1, items = ntiles * KVH;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t ts = block_table.stride(0), maxsets = (QT * sh.G + LN - 1) / LN;
  const float s = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    configure();
    std::vector<LaneSet> sets(maxsets);
    std::vector<uint32_t> qt(maxsets * (D / 2) * LN);
    std::vector<float> acc(maxsets * D * LN);
    std::vector<c10::BFloat16> vt(D * GT), kbuf(GT * D);
    // the last tiles (the longest rows of a prompt) first
    for (int64_t it; (it = next.fetch_add(1)) < items;) {
      const int64_t tile = ntiles - 1 - it / KVH, h = it % KVH;
      const int64_t r0 = starts[tile], r1 = starts[tile + 1];
      item(sh, qp, kp, vp, tp + sp[r0] * ts, lp, r0, r1, h, s, window, op, sets, qt, acc, vt,
           kbuf);
    }
    release();
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("det_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor row_seq, float scale, int window, Tensor(a!) out) -> ()");
  m.def("det_attention_amx_available() -> bool", &det_attention_amx_available);
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("det_attention_amx", &det_attention_amx); }
#endif
