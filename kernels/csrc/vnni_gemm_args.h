// The arguments of the two GEMMs on pack_vnni's [N/16, K/2, 16, 2] layout (gemm_bf16.cpp
// on VDPBF16PS, gemm_amx.cpp on AMX tiles), checked alike.
#pragma once

#include <ATen/ATen.h>

namespace dvnni {

struct GemmArgs {
  int64_t M, K, N;
  const c10::BFloat16* bias;  // nullptr: none
  at::Tensor y;               // [M, N], bf16 or (fp32_out) fp32, not yet written
};

// x [M, K] bf16 with contiguous rows; wp from pack_vnni (column blocks in pairs); an
// optional contiguous bf16 bias [N]. `op` names the caller in the errors.
inline GemmArgs check_gemm_args(const char* op, const at::Tensor& x, const at::Tensor& wp,
                                const c10::optional<at::Tensor>& bias, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  !x.is_cuda(),
              op, ": x must be a CPU bf16 [M, K] with contiguous rows");
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == 16 && wp.size(3) == 2 &&
                  wp.scalar_type() == at::kBFloat16 && wp.size(0) % 2 == 0,
              op, ": weight must come from pack_vnni");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * 16;
  TORCH_CHECK(K == 2 * wp.size(1), op, ": x has ", K, " columns, the weight ", 2 * wp.size(1));
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                op, ": bias must be a contiguous bf16 [N]");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  return {M, K, N, bp,
          at::empty({M, N}, fp32_out ? x.options().dtype(at::kFloat) : x.options())};
}

}  // namespace dvnni
