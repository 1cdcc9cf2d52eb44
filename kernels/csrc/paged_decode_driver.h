// What the register-tiled decode-attention kernels share: the loop over a batch's
// (sequence, KV heads) work items and their blocks, the prefetcher that pulls the
// next KV block in behind the compute, and the lazy softmax-rescale threshold.
//
// A kernel is a Worker class, one per thread's run of items, made by `make(hs)`:
//
//   make(int64_t hs) -> Worker                hs: KV heads per item
//   void begin(const T* q)                    q: the item's hs * G query rows of D
//   void block(int64_t hh, const KV* kb, const KV* vb, int64_t kst, int64_t vst,
//              int64_t t0, int64_t t1, Prefetcher& pf)
//                                             tokens [t0, t1) of one block, KV head hh
//   void end(T* out)                          the item's hs * G output rows
//
// KV is the caches' element type: T, or int8_t / c10::Float8_e4m3fn for the int8 and
// fp8 caches (rows of D codes and an fp16 scale, kernels/kv_quant.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace pattn {

// The (query heads per KV head, head dim) shapes the register-tiled kernels are
// compiled for (TILED_ATTENTION_* in kernels/cpu_ops.py must agree): CASE(G, D) each.
#define PATTN_TILED_SHAPES(CASE)                                                      \
  CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) \
  CASE(8, 64) CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128)        \
  CASE(6, 128) CASE(7, 128) CASE(8, 128)

// prefetches (of K and of V) issued per token step of the current block
constexpr int kStep = 2;

// Walks the cache lines of the next block's K and V rows a few at a time, so the
// prefetches are spread over the compute of the current block: issued all at once
// they fill the miss buffers and stall the core.
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t kstride = 0, vstride = 0, row_bytes = 0, rows = 0, t = 0, off = 0;
  void reset(const char* k_, const char* v_, int64_t ks, int64_t vs, int64_t rb, int64_t n) {
    k = k_, v = v_, kstride = ks, vstride = vs, row_bytes = rb, rows = n, t = 0, off = 0;
  }
  inline void step(int n) {
    for (; n > 0 && t < rows; --n) {
      // non-temporal: each K/V line is read once per step, so keep it out of the
      // outer caches (~12 % faster than a plain prefetch at batch 64 on the dev VM)
      __builtin_prefetch(k + t * kstride + off, 0, 0);
      __builtin_prefetch(v + t * vstride + off, 0, 0);
      off += 64;
      if (off >= row_bytes) off = 0, ++t;
    }
  }
  void finish() { step(1 << 30); }
};

// The running max moves only when a score passes it by more than this (natural log
// units), so most runs skip the rescale; probabilities stay below e^8, far from
// overflow in fp32 and bf16, and softmax does not depend on the shift.
constexpr float kMaxSlack = 8.f;

// Runs a Worker over every item of a decode batch (shapes as paged_decode_cpu.cpp).
template <typename T, typename I, typename KV = T, typename Make>
void run_items(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
               const at::Tensor& table, const at::Tensor& lens, int64_t window,
               at::Tensor& out, Make make) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t ksb = kc.stride(0), kst = kc.stride(1), ksh = kc.stride(2);
  const int64_t vsb = vc.stride(0), vst = vc.stride(1), vsh = vc.stride(2);
  const int64_t tstride = table.stride(0), qs = q.stride(0);
  const T* qp = q.data_ptr<T>();
  const KV* kp = kc.data_ptr<KV>();
  const KV* vp = vc.data_ptr<KV>();
  const I* tp = table.data_ptr<I>();
  const I* lp = lens.data_ptr<I>();
  T* op = out.data_ptr<T>();
  // A work item is one sequence and a run of `hs` KV heads: all of them when there
  // are enough sequences to keep the threads busy (each block is then visited once,
  // every head in turn, while its rows are in L1), one otherwise.
  const int64_t hs = B >= 2 * at::get_num_threads() ? KVH : 1;
  const int64_t per_seq = KVH / hs, items = B * per_seq;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += static_cast<int64_t>(lp[b]);
  const int64_t grain = total * KVH < 8192 ? items : 1;  // small problems run inline
  const int64_t es = static_cast<int64_t>(sizeof(KV));
  const int64_t row_bytes = ((hs - 1) * ksh + kc.size(3)) * es;  // an item's heads of one token

  auto first_token = [&](int64_t b) {
    return window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(lp[b]) - window) : int64_t{0};
  };
  // Aims the prefetcher at block j of an item (nothing when j is past its last block).
  auto aim = [&](Prefetcher& pf, int64_t item, int64_t j) {
    const int64_t b = item / per_seq, h0 = (item % per_seq) * hs;
    const int64_t len = static_cast<int64_t>(lp[b]);
    const bool any = j * bs < len;
    const int64_t blk = any ? static_cast<int64_t>(tp[b * tstride + j]) : 0;
    pf.reset(reinterpret_cast<const char*>(kp + blk * ksb + h0 * ksh),
             reinterpret_cast<const char*>(vp + blk * vsb + h0 * vsh), kst * es, vst * es,
             row_bytes, any ? bs : 0);
  };

  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    auto w = make(hs);
    Prefetcher pf;
    aim(pf, begin, first_token(begin / per_seq) / bs);
    pf.finish();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / per_seq, h0 = (item % per_seq) * hs;
      const int64_t len = static_cast<int64_t>(lp[b]);
      const int64_t first = first_token(b);
      w.begin(qp + b * qs + h0 * G * D);
      const int64_t jlast = len > 0 ? (len - 1) / bs : -1;
      for (int64_t j = first / bs; j <= jlast; ++j) {
        const int64_t blk = static_cast<int64_t>(tp[b * tstride + j]);
        // the next block to read: this item's, else the next item's first
        if (j < jlast)
          aim(pf, item, j + 1);
        else if (item + 1 < end)
          aim(pf, item + 1, first_token((item + 1) / per_seq) / bs);
        const int64_t t0 = std::max<int64_t>(first - j * bs, 0);
        const int64_t t1 = std::min<int64_t>(len - j * bs, bs);
        for (int64_t hh = 0; hh < hs; ++hh)
          w.block(hh, kp + blk * ksb + (h0 + hh) * ksh, vp + blk * vsb + (h0 + hh) * vsh,
                  kst, vst, t0, t1, pf);
        pf.finish();
      }
      w.end(op + (b * H + h0 * G) * D);
    }
  });
}

}  // namespace pattn
