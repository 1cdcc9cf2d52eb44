// y = x @ W^T (+ bias) for a handful of rows (decode at small batch), for CPUs.
//
// At one to a few tokens a linear layer is a matrix-vector product: it streams the
// weight once and is bound by memory bandwidth. Each weight row is loaded once,
// widened to fp32 16 lanes at a time, and multiplied into every input row; four
// accumulators per row keep the FMA pipes busy. Threads split the output features.
//
//   x [M, K], W [N, K] (rows contiguous), bias [N] or empty, y [M, N]; K % 16 == 0.
//
// Each output is summed in the same order whatever M is, so a row's result does not
// depend on the rows beside it (`kernels.ops.row_invariant` relies on it).
//
// On CPUs with AVX512-BF16, bf16 inputs of up to eight rows take `gemv_bf16_dot`
// instead: VDPBF16PS multiplies 32 bf16 pairs exactly and accumulates them in fp32,
// one instruction per 64 bytes of weight with no widening (four accumulator chains
// per input row, one weight row at a time: interleaving several rows' streams was
// slower). On the dev VM it streams 41-48 GB/s of weights where the widening loop
// streams 37-43 GB/s, measured side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_cpu.h"

#include "vec16.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

#ifdef DIPTYCH_HAVE_AVX512_BF16
#include <immintrin.h>
#endif

namespace {

using namespace dvec;
constexpr int64_t MAX_M = 8;

template <typename T, typename O>
void gemv(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), C = K / W;
  const int64_t xs = x.stride(0), ws = w.stride(0), ys = y.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  O* yp = y.data_ptr<O>();
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
        yp[m * ys + n] = static_cast<O>(hsum((acc[m][0] + acc[m][1]) + (acc[m][2] + acc[m][3])) + b);
    }
  });
}

#ifdef DIPTYCH_HAVE_AVX512_BF16
constexpr int64_t DOT_K = 32;  // bf16 values per VDPBF16PS
constexpr int64_t DOT_MAX_M = 8;

template <int M, typename O>
void gemv_bf16_dot(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                   at::Tensor& y) {
  const int64_t K = x.size(1), N = w.size(0), C = K / DOT_K;
  const int64_t xs = x.stride(0), ws = w.stride(0), ys = y.stride(0);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  const c10::BFloat16* bp = bias.defined() ? bias.data_ptr<c10::BFloat16>() : nullptr;
  O* yp = y.data_ptr<O>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint16_t* wr = wp + n * ws;
      __m512 acc[M][4];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 4 <= C; c += 4) {
        __m512bh wv[4];
        for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr + (c + j) * DOT_K);
        for (int m = 0; m < M; ++m) {
          const uint16_t* xr = xp + m * xs + c * DOT_K;
          for (int j = 0; j < 4; ++j)
            acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)_mm512_loadu_si512(xr + j * DOT_K), wv[j]);
        }
      }
      for (; c < C; ++c) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + c * DOT_K);
        for (int m = 0; m < M; ++m)
          acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(xp + m * xs + c * DOT_K), w0);
      }
      const float b = bp ? static_cast<float>(bp[n]) : 0.f;
      for (int m = 0; m < M; ++m)
        yp[m * ys + n] = static_cast<O>(_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]))) + b);
    }
  });
}

// True if the VDPBF16PS path took the product.
bool try_bf16_dot(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& y) {
  if (x.scalar_type() != at::kBFloat16 || x.size(1) % DOT_K != 0 || x.size(0) > DOT_MAX_M)
    return false;
  const bool f32 = y.scalar_type() == at::kFloat;
  switch (x.size(0)) {
#define DOT_CASE(M)                                                      \
  case M:                                                                \
    f32 ? gemv_bf16_dot<M, float>(x, w, b, y) : gemv_bf16_dot<M, c10::BFloat16>(x, w, b, y); \
    return true;
    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#undef DOT_CASE
    default: return false;
  }
}
#else
bool try_bf16_dot(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&) {
  return false;
}
#endif

}  // namespace

namespace diptych_cpu {

// fp32_out: the fp32 sums without rounding them to x's dtype (logits: rounding bf16
// logits first makes ties that argmax then breaks by index).
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, bool fp32_out) {
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
  at::Tensor y = at::empty({x.size(0), w.size(0)},
                           fp32_out ? x.options().dtype(at::kFloat) : x.options());
  if (try_bf16_dot(x, w, b, y)) return y;
#define GEMV_CASE(T)                                         \
  if (fp32_out) gemv<T, float>(x, w, b, y);                  \
  else gemv<T, T>(x, w, b, y);
  switch (x.scalar_type()) {
    case at::kFloat: gemv<float, float>(x, w, b, y); break;
    case at::kBFloat16: { GEMV_CASE(c10::BFloat16) break; }
    case at::kHalf: { GEMV_CASE(c10::Half) break; }
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
#undef GEMV_CASE
  return y;
}

// A mixture of experts' GEMM over stacked weights w [E, N, K]: x's rows sorted by
// expert (`ends[e]`: one past expert e's last row), each expert's rows against its own
// weight, read in place: a few rows (a decode step's) through the GEMV above, which
// streams the weight at the memory's pace; more through ATen's GEMM.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2),
              "grouped_linear: x [P, K] and w [E, N, K]");
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == w.size(0) && ends.scalar_type() == at::kLong,
              "grouped_linear: ends is int64 [E]");
  at::Tensor e_cpu = ends.contiguous();
  const int64_t* e = e_cpu.data_ptr<int64_t>();
  at::Tensor y = at::empty({x.size(0), w.size(1)}, x.options());
  int64_t start = 0;
  for (int64_t i = 0; i < w.size(0); start = e[i], ++i) {
    TORCH_CHECK(e[i] >= start && e[i] <= x.size(0), "grouped_linear: ends must rise to at most P");
    const int64_t rows = e[i] - start;
    if (rows == 0) continue;
    const at::Tensor xi = x.narrow(0, start, rows);
    y.narrow(0, start, rows).copy_(
        rows <= MAX_M && x.size(1) % W == 0 ? small_m_linear(xi, w[i], std::nullopt, false)
                                            : at::linear(xi, w[i]));
  }
  TORCH_CHECK(start == x.size(0), "grouped_linear: the experts' rows must cover x");
  return y;
}

}  // namespace diptych_cpu

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("small_m_linear(Tensor x, Tensor weight, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor w, Tensor ends) -> Tensor");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("small_m_linear", &diptych_cpu::small_m_linear);
  m.impl("grouped_linear", &diptych_cpu::grouped_linear);
}
