// 16-lane fp32 vectors via GCC/Clang vector extensions (AVX-512 where the CPU has
// it, pairs of AVX2/NEON registers elsewhere), with loads and stores that widen and
// round bf16/fp16, a shuffle-tree horizontal sum and a polynomial exp.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace dvec {

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr int64_t W = 16;

inline v16f splat(float x) { return v16f{} + x; }

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// An fp32 vector of any width from / to memory, unaligned.
template <typename VF>
inline VF loadu(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename VF>
inline void storeu(float* p, VF v) {
  std::memcpy(p, &v, sizeof(v));
}
// bf16 <-> fp32 at any width (VF: float lanes, VU / VH: uint32 / uint16 of as many):
// widening is a 16-bit shift; narrowing rounds to nearest even, as
// c10::BFloat16(float) does (NaN inputs are not expected), leaving the bf16 in the
// upper half of each lane.
template <typename VF, typename VU, typename VH>
inline VF widen_bf16(const c10::BFloat16* p) {
  VH h;
  std::memcpy(&h, p, sizeof(h));
  const VU u = __builtin_convertvector(h, VU) << 16;
  VF v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
template <typename VU, typename VF>
inline VU round_to_bf16(VF v) {
  VU u;
  std::memcpy(&u, &v, sizeof(u));
  return u + (0x7fffu + ((u >> 16) & 1u));
}
template <typename VF, typename VU, typename VH>
inline void narrow_bf16(c10::BFloat16* p, VF v) {
  const VH h = __builtin_convertvector(round_to_bf16<VU>(v) >> 16, VH);
  std::memcpy(p, &h, sizeof(h));
}

inline v16f load16(const c10::BFloat16* p) { return widen_bf16<v16f, v16u, v16h>(p); }
inline v16f load16(const c10::Half* p) {
  float tmp[W];
  for (int64_t i = 0; i < W; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}
// 16 int8 codes as floats (the int8 KV cache, kernels/kv_quant.py)
inline v16f load16(const int8_t* p) {
  typedef int8_t v16b __attribute__((vector_size(16)));
  v16b b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, v16f);
}
// 16 fp8 e4m3 codes as floats (the fp8 KV cache, kernels/kv_quant.py), with integer
// operations only, so any CPU runs it and no value passes through a denormal: a
// normal code's exponent and mantissa bits move into fp32's fields and the exponent
// is rebiased (+120); a subnormal one (exponent 0) is its mantissa times 2^-9.
inline v16f load16(const c10::Float8_e4m3fn* p) {
  typedef uint8_t v16b __attribute__((vector_size(16)));
  v16b b;
  std::memcpy(&b, p, sizeof(b));
  const v16u u = __builtin_convertvector(b, v16u);
  const v16u mag = u & 0x7fu, sign = (u & 0x80u) << 24;
  const v16u normal = ((mag << 20) + (120u << 23)) | sign;
  const v16f sub = __builtin_convertvector(mag, v16f) * 0x1p-9f;
  v16u subu;
  std::memcpy(&subu, &sub, sizeof(subu));
  const v16u is_sub = reinterpret_cast<v16u>(mag < 8u);
  const v16u bits = ((subu | sign) & is_sub) | (normal & ~is_sub);
  v16f v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }
inline void store16(c10::BFloat16* p, v16f v) { narrow_bf16<v16f, v16u, v16h>(p, v); }
inline void store16(c10::Half* p, v16f v) {
  for (int64_t i = 0; i < W; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// Horizontal sum as a tree of shuffles: 4 adds instead of 15.
inline float hsum(v16f v) {
  v += __builtin_shuffle(v, v16i{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, v16i{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, v16i{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, v16i{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// Sixteen horizontal sums at once: lane t of the result is the sum of v[t]'s lanes.
// Four rounds of pairwise merges (15 merges of 2 shuffles + 1 add) instead of 16
// separate trees.
inline v16f hsum16(v16f* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1],
                             v16i{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  return __builtin_shuffle(v[0], v[1],
                           v16i{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(v[0], v[1],
                           v16i{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
}

// exp on any float vector (VI: the int vector of its width): 2^n * P(r),
// r = x - n ln2, |r| <= ln2 / 2 (Cephes coefficients, about 1 ulp); inputs are
// clamped to the finite range.
template <typename VF, typename VI>
inline VF vexp_n(VF x) {
  const VF lo = VF{} - 87.3f, hi = VF{} + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  VF y = x * 1.44269504088896341f;
  y += (y >= 0.f ? VF{} + 0.5f : VF{} - 0.5f);
  const VI n = __builtin_convertvector(y, VI);
  const VF nf = __builtin_convertvector(n, VF);
  const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (n + 127) << 23;
  VF scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline v16f vexp(v16f x) { return vexp_n<v16f, v16i>(x); }

}  // namespace dvec
