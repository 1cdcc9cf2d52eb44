// The argument checks the CPU attention kernels share (paged_decode_cpu.cpp,
// det_attention_cpu.cpp, det_attention_amx.cpp): one layout, one set of errors.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace dattn {

struct CacheCodes {
  bool q8, f8;  // the caches hold int8 / fp8 e4m3 codes (D + 2: codes, an fp16 scale)
};

// q [rows, H, D] over paged caches [blocks, block, KVH, D], out shaped like q. `rows`
// names q's first dim in the errors.
inline CacheCodes check_query_and_caches(const char* rows, const at::Tensor& q,
                                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [",
              rows, ", H, D] with each token's heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() &&
                  out.scalar_type() == q.scalar_type(),
              "out must be contiguous, shaped and typed like q");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [blocks, block, KVH, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "cache rows must be contiguous");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  const bool f8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() &&
                  (q8 || f8 || k_cache.scalar_type() == q.scalar_type()),
              "q and the caches must share a dtype (or the caches be int8 or fp8 e4m3)");
  TORCH_CHECK(k_cache.size(3) == q.size(2) + (q8 || f8 ? 2 : 0), "head dims differ");
  TORCH_CHECK(q.size(2) % dvec::W == 0 && q.size(2) <= 256,
              "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of KV heads");
  return {q8, f8};
}

// The batch-invariant attentions' arguments: rows of any sequences, each with its
// causal length and its sequence's row of the block table (all int32).
inline CacheCodes check_det_args(const char* name, const at::Tensor& q,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 const at::Tensor& row_seq, const at::Tensor& out) {
  TORCH_CHECK(!q.is_cuda(), name, " runs on CPU tensors");
  const CacheCodes codes = check_query_and_caches("N", q, k_cache, v_cache, out);
  for (const at::Tensor* t : {&block_table, &seq_lens, &row_seq})
    TORCH_CHECK(t->scalar_type() == at::kInt, "index tensors must be int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1,
              "block_table must be [sequences, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous() &&
                  row_seq.dim() == 1 && row_seq.size(0) == q.size(0) && row_seq.is_contiguous(),
              "seq_lens and row_seq must be contiguous [N]");
  return codes;
}

// The first token a row at causal length `len` attends to: 0, or with a sliding window
// the last `window` tokens only.
inline int64_t first_position(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// Where each run of up to `most` consecutive rows of one sequence starts (row_seq: each
// row's sequence), then n: the work items of the batch-invariant attentions.
inline std::vector<int64_t> sequence_runs(const int32_t* row_seq, int64_t n, int64_t most) {
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < n;) {
    starts.push_back(r);
    int64_t e = r + 1;
    while (e < n && e - r < most && row_seq[e] == row_seq[r]) ++e;
    r = e;
  }
  starts.push_back(n);
  return starts;
}

}  // namespace dattn
