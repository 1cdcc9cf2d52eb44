// LoRA deltas of a mixed batch on CPU (kernels/lora.py has the definition): each row
// gathers its slot's A [J*R, K] and transposed, scaled B [R, N] and adds B(A x) to its
// output row, BGMV-style, so one call serves any mix of adapters in a step.
//
// A row's work is a shrink (J*R dot products of length K: A's rows stream past the one
// x row) and an expand (for each nonzero rank value, an axpy of B's row over the
// slice's columns, contiguous in the rank-major layout); both sum in fp32 and the row
// is rounded once. Rows run in parallel; a slot's weights are small enough (a rank-16
// fused q/k/v of a 576-wide model is 110 KB in bf16) to stay in cache for the rows
// that share it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec16.h"

namespace diptych_cpu {
namespace {

using dvec::load16;
using dvec::v16f;
using dvec::W;

template <typename T>
inline float dot(const T* a, const T* x, int64_t k) {
  v16f acc{};
  int64_t i = 0;
  for (; i + W <= k; i += W) acc += load16(a + i) * load16(x + i);
  float s = dvec::hsum(acc);
  for (; i < k; ++i) s += static_cast<float>(a[i]) * static_cast<float>(x[i]);
  return s;
}

// delta[lo:hi] += c * row[lo:hi]
template <typename T>
inline void axpy(float* delta, const T* row, float c, int64_t lo, int64_t hi) {
  const v16f cv = dvec::splat(c);
  int64_t n = lo;
  for (; n + W <= hi; n += W) dvec::store16(delta + n, dvec::load16(delta + n) + cv * load16(row + n));
  for (; n < hi; ++n) delta[n] += c * static_cast<float>(row[n]);
}

template <typename T, typename I>
void lora_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const I* slots, const std::vector<int64_t>& bounds) {
  const int64_t t_rows = x.size(0), k = x.size(1), n = out.size(1), rank = b.size(1);
  const int64_t jr = a.size(1), slices = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t num_slots = a.size(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  for (int64_t t = 0; t < t_rows; ++t)
    TORCH_CHECK(slots[t] < num_slots, "lora: slot ", static_cast<int64_t>(slots[t]),
                " of ", num_slots);
  at::parallel_for(0, t_rows, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> v(jr), delta(n);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = static_cast<int64_t>(slots[t]);
      if (s < 0) continue;
      const T* xr = xp + t * sx;
      const T* as = ap + s * jr * k;
      for (int64_t i = 0; i < jr; ++i) v[i] = dot(as + i * k, xr, k);
      std::fill(delta.begin(), delta.end(), 0.f);
      const T* bs = bp + s * rank * n;
      for (int64_t j = 0; j < slices; ++j)
        for (int64_t r = 0; r < rank; ++r) {
          const float c = v[j * rank + r];
          if (c != 0.f) axpy(delta.data(), bs + r * n, c, bounds[j], bounds[j + 1]);
        }
      T* orow = op + t * so;
      for (int64_t c = 0; c < n; ++c)
        orow[c] = static_cast<T>(static_cast<float>(orow[c]) + delta[c]);
    }
  });
}

template <typename T>
void lora_dispatch_index(at::Tensor& out, const at::Tensor& x, const at::Tensor& a,
                         const at::Tensor& b, const at::Tensor& slots,
                         const std::vector<int64_t>& bounds) {
  if (slots.scalar_type() == at::kLong)
    lora_rows<T, int64_t>(out, x, a, b, slots.data_ptr<int64_t>(), bounds);
  else
    lora_rows<T, int32_t>(out, x, a, b, slots.data_ptr<int32_t>(), bounds);
}

}  // namespace

void lora_add_(at::Tensor out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& slots, at::IntArrayRef bounds) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora: x [T, K], out [T, N], a [S, J*R, K], b [S, R, N]");
  TORCH_CHECK(out.size(0) == x.size(0) && a.size(2) == x.size(1) && a.size(0) == b.size(0) &&
                  b.size(2) == out.size(1),
              "lora: shapes disagree");
  TORCH_CHECK(static_cast<int64_t>(bounds.size()) >= 2 && bounds.front() == 0 &&
                  bounds.back() == out.size(1),
              "lora: bounds must run from 0 to N");
  TORCH_CHECK(a.size(1) == (static_cast<int64_t>(bounds.size()) - 1) * b.size(1),
              "lora: a's rows must be one rank block per slice");
  for (size_t j = 1; j < bounds.size(); ++j)
    TORCH_CHECK(bounds[j] >= bounds[j - 1], "lora: bounds must rise");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(),
              "lora: rows must be contiguous, a and b contiguous");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && a.scalar_type() == b.scalar_type() &&
                  out.scalar_type() == x.scalar_type(),
              "lora: x, out, a and b must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) &&
                  (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              "lora: slots must be int32/int64 [T]");
  TORCH_CHECK(!x.is_cuda(), "CPU tensors only");
  const at::Tensor idx = slots.contiguous();
  const std::vector<int64_t> bnd(bounds.begin(), bounds.end());
  switch (x.scalar_type()) {
    case at::kFloat: lora_dispatch_index<float>(out, x, a, b, idx, bnd); break;
    case at::kBFloat16: lora_dispatch_index<c10::BFloat16>(out, x, a, b, idx, bnd); break;
    case at::kHalf: lora_dispatch_index<c10::Half>(out, x, a, b, idx, bnd); break;
    default: TORCH_CHECK(false, "lora: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace diptych_cpu

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor slots, int[] bounds) -> ()");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("lora_add_", &diptych_cpu::lora_add_); }
