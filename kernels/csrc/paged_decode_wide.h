// Decode attention in fp32 arithmetic at the build's native vector width, for every
// CPU (AVX2, AVX-512, SSE2, NEON); bf16 or fp32 K/V, widened in registers.
//
// The generic kernel (paged_decode_cpu.cpp) works in 16-lane vectors whatever the
// CPU: on AVX2 each of its shuffles becomes a sequence of 256-bit ones and its
// accumulators live in memory, so at batch 64 it ran 3.5x slower than the same code
// with AVX-512. Here every vector is one register of the build's width (N lanes),
// and for compile-time G (query heads per KV head) and D (head dim):
//
//   scores  per token, G dot products of D; the partial vectors of N tokens are
//           reduced together by a transpose tree (log2 N rounds of two shuffles and
//           an add), giving N scores in one vector; the query is pre-scaled;
//   softmax online, the running max moved only when a score passes it by
//           kMaxSlack (most runs skip the rescale);
//   P @ V   fp32 probabilities broadcast into the accumulators of a slice of the
//           head, G x (slice / N) registers, held across a run of N tokens.
//
// Unlike the bf16 dot-product kernel, probabilities are not rounded to bf16.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "paged_decode_driver.h"
#include "vec16.h"

namespace wattn {

constexpr int N = DIPTYCH_VEC_LANES;
typedef float vf __attribute__((vector_size(4 * N)));
typedef int32_t vi __attribute__((vector_size(4 * N)));
typedef uint32_t vu __attribute__((vector_size(4 * N)));
typedef uint16_t vh __attribute__((vector_size(2 * N)));

using pattn::kMaxSlack;
using pattn::kStep;
using pattn::Prefetcher;

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load(const c10::BFloat16* p) { return dvec::widen_bf16<vf, vu, vh>(p); }

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline void store(c10::BFloat16* p, vf v) { dvec::narrow_bf16<vf, vu, vh>(p, v); }

// N horizontal sums at once: lane t of the result is the sum of v[t]'s lanes. Each
// round halves the lanes per input and merges pairs, keeping inputs in order.
inline vf hsum_n(vf* v) {
#if DIPTYCH_VEC_LANES == 16
  return dvec::hsum16(v);
#elif DIPTYCH_VEC_LANES == 8
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{4, 5, 6, 7, 12, 13, 14, 15});
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{0, 1, 4, 5, 8, 9, 12, 13}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{2, 3, 6, 7, 10, 11, 14, 15});
  return __builtin_shuffle(v[0], v[1], vi{0, 2, 4, 6, 8, 10, 12, 14}) +
         __builtin_shuffle(v[0], v[1], vi{1, 3, 5, 7, 9, 11, 13, 15});
#else
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{0, 1, 4, 5}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], vi{2, 3, 6, 7});
  return __builtin_shuffle(v[0], v[1], vi{0, 2, 4, 6}) +
         __builtin_shuffle(v[0], v[1], vi{1, 3, 5, 7});
#endif
}

inline float lane_max(vf v) {
  float m = v[0];
  for (int i = 1; i < N; ++i) m = std::max(m, v[i]);
  return m;
}
inline float lane_sum(vf v) {
  float s = 0.f;
  for (int i = 0; i < N; ++i) s += v[i];
  return s;
}

// Online-softmax state of one query row: the running max and an N-lane running sum.
struct RowState {
  vf l;
  float m;
};

// Accumulator vectors per query row that stay in registers while P @ V walks a run of
// tokens (a power of two dividing D / N; G of them, plus the V row slice and a
// broadcast, must fit the register file).
template <int G, int D>
constexpr int slice_vectors() {
  const int budget = disa::VEC_REGS - 4;
  int na = D / N;
  while (na > 1 && G * na > budget) na /= 2;
  return na;
}

template <int G, int D, typename T>
struct Worker {
  static constexpr int NV = D / N;
  static constexpr int NA = slice_vectors<G, D>();
  static_assert(D % N == 0 && NV % NA == 0, "head dim must be a multiple of the vector width");
  int64_t hs;
  float scale;
  std::vector<float> acc;  // [hs * G][D]
  std::vector<RowState> st;
  std::vector<vf> qv;      // [hs * G][NV], pre-scaled
  alignas(64) float p[G][N];

  Worker(int64_t hs_, float scale_) : hs(hs_), scale(scale_), acc(hs_ * G * D), st(hs_ * G),
                                      qv(hs_ * G * NV) {}

  void begin(const T* q) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (auto& s : st) s = {vf{}, -std::numeric_limits<float>::infinity()};
    for (int64_t r = 0; r < hs * G; ++r)
      for (int c = 0; c < NV; ++c) qv[r * NV + c] = load(q + r * D + c * N) * scale;
  }

  // Scores of tokens [c0, c1) (at most N) for the G rows, then the softmax update;
  // leaves the probabilities in p[g][0 .. c1 - c0).
  inline void scores(const vf* q, const T* kb, int64_t kst, int64_t c0, int64_t c1,
                     RowState* rs, float* a, Prefetcher& pf) {
    alignas(64) vf part[G][N];
    const int64_t n = c1 - c0;
    for (int64_t t = 0; t < n; ++t) {
      const T* kr = kb + (c0 + t) * kst;
      pf.step(kStep);
      vf kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = load(kr + c * N);
      for (int g = 0; g < G; ++g) {
        const vf* qg = q + g * NV;
        vf s0 = qg[0] * kv[0], s1 = vf{};
        for (int c = 1; c < NV; c += 2) {
          s1 += qg[c] * kv[c];
          if (c + 1 < NV) s0 += qg[c + 1] * kv[c + 1];
        }
        part[g][t] = s0 + s1;
      }
    }
    vi live;
    for (int i = 0; i < N; ++i) live[i] = i < n ? -1 : 0;
    const vf neg_inf = vf{} - std::numeric_limits<float>::infinity();
    for (int g = 0; g < G; ++g) {
      for (int64_t t = n; t < N; ++t) part[g][t] = vf{};
      const vf s = live ? hsum_n(part[g]) : neg_inf;
      RowState& r = rs[g];
      const float mx = lane_max(s);
      if (mx > r.m + kMaxSlack) {
        const float corr = std::exp(r.m - mx);  // 0 on the first run (m = -inf)
        r.l *= corr;
        float* ag = a + g * D;
        for (int c = 0; c < NV; ++c) store(ag + c * N, load(ag + c * N) * corr);
        r.m = mx;
      }
      const vf e = live ? dvec::vexp_n<vf, vi>(s - r.m) : vf{};
      r.l += e;
      store(p[g], e);
    }
  }

  // a[g][:] += sum over tokens [c0, c1) of p[g][t] * V[t][:].
  inline void pv(const T* vb, int64_t vst, int64_t c0, int64_t c1, float* a) {
    const int64_t n = c1 - c0;
    for (int d0 = 0; d0 < D; d0 += NA * N) {
      vf ac[G][NA];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < NA; ++i) ac[g][i] = load(a + g * D + d0 + i * N);
      for (int64_t t = 0; t < n; ++t) {
        const T* vr = vb + (c0 + t) * vst + d0;
        vf v[NA];
        for (int i = 0; i < NA; ++i) v[i] = load(vr + i * N);
        for (int g = 0; g < G; ++g) {
          const float pg = p[g][t];
          for (int i = 0; i < NA; ++i) ac[g][i] += pg * v[i];
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < NA; ++i) store(a + g * D + d0 + i * N, ac[g][i]);
    }
  }

  void block(int64_t hh, const T* kb, const T* vb, int64_t kst, int64_t vst, int64_t t0,
             int64_t t1, Prefetcher& pf) {
    float* a = acc.data() + hh * G * D;
    for (int64_t c0 = t0; c0 < t1; c0 += N) {
      const int64_t c1 = std::min<int64_t>(c0 + N, t1);
      scores(qv.data() + hh * G * NV, kb, kst, c0, c1, st.data() + hh * G, a, pf);
      pv(vb, vst, c0, c1, a);
    }
  }

  void end(T* out) {
    for (int64_t r = 0; r < hs * G; ++r) {
      const float l = lane_sum(st[r].l);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int c = 0; c < NV; ++c) store(out + r * D + c * N, load(acc.data() + r * D + c * N) * inv);
    }
  }
};

// Runs the kernel and returns true when (dtype, G, D) has an instantiation.
template <typename T, typename I>
bool dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
              const at::Tensor& table, const at::Tensor& lens, float scale, int64_t window,
              at::Tensor& out) {
  const int64_t D = q.size(2), G = q.size(1) / kc.size(2);
#define W_CASE(g, d)                                                                  \
  if (G == g && D == d) {                                                             \
    pattn::run_items<T, I>(q, kc, vc, table, lens, window, out,                       \
                           [scale](int64_t hs) { return Worker<g, d, T>(hs, scale); }); \
    return true;                                                                      \
  }
  PATTN_TILED_SHAPES(W_CASE)
#undef W_CASE
  return false;
}

}  // namespace wattn
