// Small fused CPU ops for the decoder layer: each replaces several torch ops, which
// at decode batch sizes cost more in dispatch than in arithmetic.
//
//   rms_norm(x, residual?, weight, eps) -> (y, residual')
//       residual' = x + residual (or x), y = weight * rms_normalize(residual') in fp32,
//       rounded to the input dtype once.
//   rotary_(x [T, heads, D], cos [T, D/2], sin [T, D/2])      in place, half-split layout
//   silu_and_mul(x [T, 2I]) -> [T, I]                          silu(x[:, :I]) * x[:, I:]
//   store_kv(k, v [T, KVH, D], k_cache, v_cache [blocks, block, KVH, D], slots [T])
//       writes row t to slot slots[t]; slot -1 (padding) is skipped. int8 and fp8
//       caches ([..., D + 2], kernels/kv_quant.py) take each head's row quantized: D
//       codes x / s rounded (to an integer, or to e4m3), then s = max|x| / QMAX as
//       fp16 (QMAX 127, or 448).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_cpu.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

namespace {

using dvec::load16;
using dvec::store16;
using dvec::v16f;
constexpr int64_t W = dvec::W;

template <typename T>
inline float f32(T x) { return static_cast<float>(x); }

#define DISPATCH_FLOAT(TYPE, NAME, ...)                                      \
  switch (TYPE) {                                                           \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__(); break; }      \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__(); break; } \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__(); break; }   \
    default: TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE);       \
  }

}  // namespace

namespace diptych_cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x,
                                            const std::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [T, H]");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be [H] in x's dtype");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be contiguous and shaped like x");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor res = has_res ? at::empty_like(x) : x;
  at::Tensor w = weight.contiguous();
  DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = has_res ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* op = res.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> buf(H);
      const int64_t Hv = H - H % W;
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* xr = xp + t * H;
        v16f acc = v16f{};
        int64_t i = 0;
        for (; i < Hv; i += W) {
          v16f v = load16(xr + i);
          if (rp) {
            // round the sum to the dtype, as the residual stream is stored
            store16(op + t * H + i, v + load16(rp + t * H + i));
            v = load16(op + t * H + i);
          }
          store16(buf.data() + i, v);
          acc += v * v;
        }
        float ss = dvec::hsum(acc);
        for (; i < H; ++i) {
          float v = f32(xr[i]);
          if (rp) {
            const scalar_t s = static_cast<scalar_t>(v + f32(rp[t * H + i]));
            op[t * H + i] = s;
            v = f32(s);
          }
          buf[i] = v;
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
        scalar_t* yr = yp + t * H;
        i = 0;
        for (; i < Hv; i += W) {
          // normalized value rounded to the dtype, then scaled by the weight
          scalar_t tmp[W];
          store16(tmp, load16(buf.data() + i) * inv);
          store16(yr + i, load16(wp + i) * load16(tmp));
        }
        for (; i < H; ++i) {
          const scalar_t normed = static_cast<scalar_t>(buf[i] * inv);
          yr[i] = static_cast<scalar_t>(f32(wp[i]) * f32(normed));
        }
      }
    });
  });
  return {y, res};
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be [T, heads, D], rows contiguous");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary: cos/sin must be contiguous fp32 [T, D/2]");
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  DISPATCH_FLOAT(x.scalar_type(), "rotary", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cp + t * half;
        const float* s = sp + t * half;
        for (int64_t h = 0; h < NH; ++h) {
          scalar_t* r = xp + t * st + h * sh;
          for (int64_t i = 0; i < half; ++i) {
            const float a = f32(r[i]), b = f32(r[i + half]);
            r[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
            r[i + half] = static_cast<scalar_t>(b * c[i] + a * s[i]);
          }
        }
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x must be contiguous [T, 2I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({T, I}, x.options());
  DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      const int64_t Iv = I - I % W;
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* g = xp + t * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* o = yp + t * I;
        int64_t i = 0;
        for (; i < Iv; i += W) {
          const v16f gv = load16(g + i);
          // silu rounded to the dtype first, as F.silu(gate) * up does
          scalar_t act[W];
          store16(act, gv / (1.f + dvec::vexp(-gv)));
          store16(o + i, load16(act) * load16(u + i));
        }
        for (; i < I; ++i) {
          const float gv = f32(g[i]);
          const scalar_t act = static_cast<scalar_t>(gv / (1.f + std::exp(-gv)));
          o[i] = static_cast<scalar_t>(f32(act) * f32(u[i]));
        }
      }
    });
  });
  return y;
}

}  // namespace diptych_cpu

namespace {

// One head's row x[0, D) as codes and an fp16 scale at dst[D] (kv_quant.quantize):
// int8 codes round(x / s) (half to even), or x / s rounded to e4m3 (c10's conversion,
// the one torch's .to() takes: nearest even).
template <typename T, typename Code>
void quantize_kv_row(const T* x, Code* dst, int64_t D) {
  constexpr bool fp8 = std::is_same_v<Code, c10::Float8_e4m3fn>;
  constexpr float qmax = fp8 ? 448.f : 127.f;
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(f32(x[i])));
  const c10::Half stored(amax / qmax);
  const float s = static_cast<float>(stored);
  for (int64_t i = 0; i < D; ++i) {
    const float c = std::min(qmax, std::max(-qmax, s > 0.f ? f32(x[i]) / s : 0.f));
    if constexpr (fp8)
      dst[i] = c10::Float8_e4m3fn(c);
    else
      dst[i] = static_cast<int8_t>(std::nearbyint(c));
  }
  std::memcpy(dst + D, &stored, sizeof(stored));
}

}  // namespace

namespace diptych_cpu {

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "store_kv: k and v must be [T, KVH, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "store_kv: caches must be [blocks, block, KVH, D]");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  const bool f8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t D = k.size(2), width = q8 || f8 ? D + 2 : D;
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k_cache.size(3) == width,
              "store_kv: head geometry differs from the cache");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "store_kv: k and v (and the two caches) must share a dtype");
  TORCH_CHECK(q8 || f8 || k.scalar_type() == k_cache.scalar_type(),
              "store_kv: dtype differs from the cache");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  v_cache.stride(3) == 1 && k_cache.stride(2) == width &&
                  v_cache.stride(2) == width && k.stride(1) == D && v.stride(1) == D,
              "store_kv: each token's [KVH, D] must be contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "store_kv: slots must be contiguous int64 [T]");
  const int64_t T = k.size(0), KVH = k.size(1), bs = k_cache.size(1), nblocks = k_cache.size(0);
  const int64_t es = k.element_size(), ces = k_cache.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sp[t];
    if (slot < 0) continue;
    const int64_t blk = slot / bs, off = slot % bs;
    TORCH_CHECK(blk < nblocks, "store_kv: slot ", slot, " is outside the cache");
    char* kd = kc + (blk * k_cache.stride(0) + off * k_cache.stride(1)) * ces;
    char* vd = vc + (blk * v_cache.stride(0) + off * v_cache.stride(1)) * ces;
    const char* ks = kp + t * k.stride(0) * es;
    const char* vs = vp + t * v.stride(0) * es;
    if (!q8 && !f8) {
      std::memcpy(kd, ks, KVH * D * es);
      std::memcpy(vd, vs, KVH * D * es);
      continue;
    }
    DISPATCH_FLOAT(k.scalar_type(), "store_kv", [&] {
      auto rows = [&](auto* kcodes, auto* vcodes) {
        for (int64_t h = 0; h < KVH; ++h) {
          quantize_kv_row(reinterpret_cast<const scalar_t*>(ks) + h * D, kcodes + h * width, D);
          quantize_kv_row(reinterpret_cast<const scalar_t*>(vs) + h * D, vcodes + h * width, D);
        }
      };
      if (f8)
        rows(reinterpret_cast<c10::Float8_e4m3fn*>(kd), reinterpret_cast<c10::Float8_e4m3fn*>(vd));
      else
        rows(reinterpret_cast<int8_t*>(kd), reinterpret_cast<int8_t*>(vd));
    });
  }
}

}  // namespace diptych_cpu

namespace {

// Index of the first maximum of each row (what torch.argmax returns), 16 lanes at a
// time; bf16 rows are widened on the fly (torch's bf16 argmax is scalar).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows: x must be [B, V], rows contiguous");
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  DISPATCH_FLOAT(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t rs = x.stride(0);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const scalar_t* r = xp + b * rs;
        float best = -std::numeric_limits<float>::infinity();
        int64_t arg = 0;
        int64_t i = 0;
        // per-lane running max; the winning chunk is rescanned for the first index
        v16f vmax = dvec::splat(best);
        for (; i + W <= V; i += W) {
          const v16f v = load16(r + i);
          vmax = v > vmax ? v : vmax;
        }
        float m = best;
        for (int64_t l = 0; l < W; ++l) m = std::max(m, vmax[l]);
        for (int64_t k = i; k < V; ++k) m = std::max(m, f32(r[k]));
        for (int64_t k = 0; k < V; ++k)
          if (f32(r[k]) == m) {
            arg = k;
            break;
          }
        op[b] = arg;
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) {
  m.impl("rms_norm", &diptych_cpu::rms_norm);
  m.impl("rotary_", &diptych_cpu::rotary_);
  m.impl("silu_and_mul", &diptych_cpu::silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("store_kv", &diptych_cpu::store_kv);
}
