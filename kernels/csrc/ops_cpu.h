// The CPU ops' C++ entry points, for ops that call other ops without going back
// through Python and the dispatcher (decode_stack_cpu.cpp). Each is the function its
// file registers under `diptych_cpu::`; the schemas are in those files.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace diptych_cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins, int64_t group, int64_t n,
                        bool fp32_out);
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                      int64_t group, int64_t n, bool fp32_out);
at::Tensor fp8_dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t group,
                          int64_t n, at::ScalarType dtype);
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, bool fp32_out);
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            at::Tensor out);

}  // namespace diptych_cpu
