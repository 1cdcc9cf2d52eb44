// LoRA deltas of a mixed batch on CPU (kernels/lora.py has the definition): each row
// gathers its slot's A [J*R, K] and transposed, scaled B [R, N] and adds B(A x) to its
// output row, so one call serves any mix of adapters in a step.
//
// The rows are grouped by slot (a counting sort) and cut into tiles of up to TILE rows
// of one slot; the tiles run in parallel. A tile reads its slot's A and B once for all
// its rows (a row at a time, as a plain BGMV does, each of 32 decode rows would re-read
// its 100-200 KB of adapter weights). The shrink streams A's rows past the tile's x
// rows, two accumulator chains a row; the expand keeps a vector of output columns of
// every row in registers while it walks the slice's rank rows of B (a block of
// columns of B stays in L1), then adds it to the output rows, rounded once. Rank rows
// past the last nonzero rank value of the tile (a rank-8 adapter in rank-16 slots) are
// skipped. Vectors are this build's native width (disa::VEC_LANES): GCC's 64-byte
// vectors on an AVX2 build ran these loops ten times slower.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "vec16.h"

namespace diptych_cpu {
namespace {

constexpr int L = disa::VEC_LANES;
typedef float vf __attribute__((vector_size(4 * L)));
typedef uint32_t vu __attribute__((vector_size(4 * L)));
typedef uint16_t vh __attribute__((vector_size(2 * L)));

inline vf ld(const float* p) { return dvec::loadu<vf>(p); }
inline vf ld(const c10::BFloat16* p) { return dvec::widen_bf16<vf, vu, vh>(p); }
inline vf ld(const c10::Half* p) {
  alignas(64) float t[L];
  for (int i = 0; i < L; ++i) t[i] = static_cast<float>(p[i]);
  return ld(t);
}
inline void st(float* p, vf v) { dvec::storeu(p, v); }
inline void st(c10::BFloat16* p, vf v) { dvec::narrow_bf16<vf, vu, vh>(p, v); }
inline void st(c10::Half* p, vf v) {
  for (int i = 0; i < L; ++i) p[i] = static_cast<c10::Half>(v[i]);
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
}

constexpr int TILE = 4;  // rows of one slot that share the weights' reads

struct Tile {
  int64_t slot;
  int64_t rows[TILE];
  int count;
};

// v[m * jr + i] = A[i, :] . x_m for the tile's M rows
template <int M, typename T>
void shrink(const T* a, const T* const* xs, int64_t jr, int64_t k, float* v) {
  for (int64_t i = 0; i < jr; ++i) {
    const T* arow = a + i * k;
    vf acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = vf{};
    int64_t kk = 0;
    for (; kk + 2 * L <= k; kk += 2 * L) {
      const vf a0 = ld(arow + kk), a1 = ld(arow + kk + L);
      for (int m = 0; m < M; ++m) {
        acc0[m] += a0 * ld(xs[m] + kk);
        acc1[m] += a1 * ld(xs[m] + kk + L);
      }
    }
    for (; kk + L <= k; kk += L) {
      const vf a0 = ld(arow + kk);
      for (int m = 0; m < M; ++m) acc0[m] += a0 * ld(xs[m] + kk);
    }
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc0[m] + acc1[m]);
      for (int64_t t = kk; t < k; ++t)
        sum += static_cast<float>(arow[t]) * static_cast<float>(xs[m][t]);
      v[m * jr + i] = sum;
    }
  }
}

// out_m[lo:hi] += sum_r v[m, base + r] * B[r, lo:hi], r < rank (rounded once)
template <int M, typename T>
void expand(const T* b, const float* v, int64_t jr, int64_t base, int64_t rank, int64_t n,
            int64_t lo, int64_t hi, T* const* outs) {
  int64_t c = lo;
  for (; c + L <= hi; c += L) {
    vf acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vf{};
    for (int64_t r = 0; r < rank; ++r) {
      const vf bv = ld(b + r * n + c);
      for (int m = 0; m < M; ++m) acc[m] += (vf{} + v[m * jr + base + r]) * bv;
    }
    for (int m = 0; m < M; ++m) st(outs[m] + c, ld(outs[m] + c) + acc[m]);
  }
  for (; c < hi; ++c) {
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int64_t r = 0; r < rank; ++r)
        sum += v[m * jr + base + r] * static_cast<float>(b[r * n + c]);
      outs[m][c] = static_cast<T>(static_cast<float>(outs[m][c]) + sum);
    }
  }
}

template <int M, typename T>
void run_tile(const Tile& tile, const T* xp, int64_t sx, const T* ap, const T* bp, T* op,
              int64_t so, int64_t jr, int64_t k, int64_t n, int64_t rank,
              const std::vector<int64_t>& bounds, float* v) {
  const T* xs[M];
  T* outs[M];
  for (int m = 0; m < M; ++m) {
    xs[m] = xp + tile.rows[m] * sx;
    outs[m] = op + tile.rows[m] * so;
  }
  shrink<M>(ap + tile.slot * jr * k, xs, jr, k, v);
  const T* bs = bp + tile.slot * rank * n;
  const int64_t slices = static_cast<int64_t>(bounds.size()) - 1;
  for (int64_t j = 0; j < slices; ++j) {
    int64_t used = 0;  // past the last nonzero rank value of the slice: zeros
    for (int64_t r = 0; r < rank; ++r)
      for (int m = 0; m < M; ++m)
        if (v[m * jr + j * rank + r] != 0.f) used = r + 1;
    if (used)
      expand<M>(bs, v, jr, j * rank, used, n, bounds[j], bounds[j + 1], outs);
  }
}

template <typename T, typename I>
void lora_rows(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const I* slots, const std::vector<int64_t>& bounds) {
  const int64_t t_rows = x.size(0), k = x.size(1), n = out.size(1), rank = b.size(1);
  const int64_t jr = a.size(1), num_slots = a.size(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t sx = x.stride(0), so = out.stride(0);
  // rows grouped by slot, in tiles of up to TILE rows
  std::vector<Tile> tiles;
  std::vector<int64_t> open(num_slots, -1);
  tiles.reserve(t_rows);
  for (int64_t t = 0; t < t_rows; ++t) {
    const int64_t s = static_cast<int64_t>(slots[t]);
    TORCH_CHECK(s < num_slots, "lora: slot ", s, " of ", num_slots);
    if (s < 0) continue;
    if (open[s] < 0 || tiles[open[s]].count == TILE) {
      open[s] = static_cast<int64_t>(tiles.size());
      tiles.push_back(Tile{s, {}, 0});
    }
    Tile& tile = tiles[open[s]];
    tile.rows[tile.count++] = t;
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v(TILE * jr);
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      switch (tile.count) {
#define LORA_TILE(M) \
  case M: run_tile<M>(tile, xp, sx, ap, bp, op, so, jr, k, n, rank, bounds, v.data()); break;
        LORA_TILE(1)
        LORA_TILE(2)
        LORA_TILE(3)
        LORA_TILE(4)
#undef LORA_TILE
        default: break;
      }
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
