// y = x @ W^T (+ bias) for a handful of rows (decode at small batch), for CPUs.
//
// At one to a few tokens a linear layer is a matrix-vector product: it streams the
// weight once and is bound by memory bandwidth. Each weight row is loaded once,
// widened to fp32 16 lanes at a time, and multiplied into every input row; four
// accumulators per row keep the FMA pipes busy. Threads split the output features.
//
//   x [M, K], W [N, K] (rows contiguous), bias [N] or empty, y [M, N]; K % 16 == 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace dvec;
constexpr int64_t MAX_M = 8;

template <typename T>
void gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), C = K / W;
  const int64_t xs = x.stride(0), ws = w.stride(0), ys = y.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  // x widened once, shared by all threads
  std::vector<v16f> xv(M * C);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c) xv[m * C + c] = load16(xp + m * xs + c * W);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const T* wr = wp + n * ws;
      v16f acc[MAX_M][4];
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = v16f{};
      int64_t c = 0;
      for (; c + 4 <= C; c += 4) {
        const v16f w0 = load16(wr + c * W), w1 = load16(wr + (c + 1) * W);
        const v16f w2 = load16(wr + (c + 2) * W), w3 = load16(wr + (c + 3) * W);
        for (int64_t m = 0; m < M; ++m) {
          const v16f* xr = xv.data() + m * C + c;
          acc[m][0] += xr[0] * w0;
          acc[m][1] += xr[1] * w1;
          acc[m][2] += xr[2] * w2;
          acc[m][3] += xr[3] * w3;
        }
      }
      for (; c < C; ++c) {
        const v16f w0 = load16(wr + c * W);
        for (int64_t m = 0; m < M; ++m) acc[m][0] += xv[m * C + c] * w0;
      }
      const float b = bp ? static_cast<float>(bp[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m)
        yp[m * ys + n] = static_cast<T>(hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) + b);
    }
  });
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.size(0) <= MAX_M, "at most ", MAX_M, " rows");
  TORCH_CHECK(x.size(1) % W == 0, "K must be a multiple of 16");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(!x.is_cuda() && !w.is_cuda(), "CPU tensors only");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == w.size(0) && b.scalar_type() == w.scalar_type(), "bad bias");
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: gemv<float>(x, w, b, y); break;
    case at::kBFloat16: gemv<c10::BFloat16>(x, w, b, y); break;
    case at::kHalf: gemv<c10::Half>(x, w, b, y); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("small_m_linear", &small_m_linear);
}
