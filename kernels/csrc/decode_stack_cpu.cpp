// A Llama-family model's decoder layers over a step of decode rows, in one call, for
// CPUs.
//
// A batch-1 decode step on a small model is ~11 small ops a layer (two norms, four
// quantized linears, two rotaries, the KV store, attention, SiLU-and-mul): 330 for
// SmolLM2's 30 layers, each tens of microseconds of kernel. From Python every op also
// pays the interpreter, kernels.ops's path checks and the dispatcher. This op loops
// over the layers in C++ and calls the same kernel functions directly (ops_cpu.h), so
// its numbers are the Python layer loop's, bit for bit (tests/engine/test_decode_stack).
//
//   x          [T, hidden]  the step's embedded tokens, all decode rows (decodes and
//              speculative verify rows; engine/attention/torch_backend.py)
//   weights    per layer, in order: input norm weight; qkv bias or None; qkv (parts);
//              o (parts); post-attention norm weight; gate_up (parts); down (parts).
//              A linear of p parts is p x (codes, scales, mins or None), its output
//              the parts' outputs side by side (kernels/quant.py); a dense linear is
//              one part (weight, vnni, None) of group 0 whose n is the rows up to
//              which the small-M GEMV runs it, then the VNNI GEMM on `vnni` (the same
//              weight packed) where given, else torch's linear (kernels.ops.linear);
//              a linear with only a packed weight that serves every row count (all of
//              them with `--deterministic`) one part (packed, None, None) of group -1
//              (VNNI GEMM), -2 (AMX GEMM) or -3 (fp32-arithmetic GEMM, n its output
//              features)
//   dims       per linear: p, then (group, n) of each part
//   kv_caches  per layer [blocks, 2, block, KVH, row]  (row D, or D + 2 for int8 / fp8)
//   cos, sin   fp32 [T, D/2]; slots int64 [T]; block_table, seq_lens: the decode rows'
//   attention  0: the decode kernel; 1 or 2 (`--deterministic`): the batch-invariant
//              kernel (det_attention_cpu.cpp; 2: on AMX tiles) with `row_seq`, row i
//              of block_table and seq_lens being sequence i's
//   returns    (h, residual) after the last layer; the final norm is the caller's
//
// The fixed-order GEMMs and the batch-invariant attention are reached through the
// dispatcher (their files build them only at some ISA levels); a typed call costs
// well under a microsecond, against ~10 us for each op called from Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops_cpu.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// `diptych_cpu::<name>` with the C++ signature its file registers, found on first use.
template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using PackedGemm = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, bool);
using F32accGemm = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&,
                              bool);
using DetAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                          int64_t, at::Tensor);

// x @ W^T (+ bias) on a packed weight of one of our GEMMs (kernels.cpu_ops.packed_linear)
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                         int64_t n, const OptTensor& bias) {
  if (group == -1) {
    static const auto gemm = op<PackedGemm>("diptych_cpu::gemm_vnni");
    return gemm.call(x, packed, bias, false);
  }
  if (group == -2) {
    static const auto gemm = op<PackedGemm>("diptych_cpu::gemm_amx");
    return gemm.call(x, packed, bias, false);
  }
  TORCH_CHECK(group == -3, "decode_layers: unknown packed kind ", group);
  static const auto gemm = op<F32accGemm>("diptych_cpu::gemm_f32acc");
  return gemm.call(x, packed, n, bias, false);
}

// Reads the flat weight and dims lists front to back.
struct Cursor {
  const c10::List<OptTensor>& weights;
  at::IntArrayRef dims;
  size_t w = 0, d = 0;

  OptTensor next() {
    TORCH_CHECK(w < weights.size(), "decode_layers: weight list too short");
    return weights.get(w++);
  }
  at::Tensor tensor() {
    OptTensor t = next();
    TORCH_CHECK(t.has_value(), "decode_layers: a required weight is None");
    return *t;
  }
  int64_t dim() {
    TORCH_CHECK(d < dims.size(), "decode_layers: dims list too short");
    return dims[d++];
  }

  // y = x @ W^T (+ bias) for the next linear of the lists, as engine.models.layers.Linear
  // computes it: a dense weight through the small-M GEMV with its bias inside (the
  // caller keeps the rows within the GEMV's), quantized parts side by side, then + bias.
  // `gemv_rows`: rows up to which every dense weight takes the GEMV (a row-invariant
  // step, kernels.ops.row_invariant), whatever its own limit.
  int64_t gemv_rows = 0;
  at::Tensor linear(const at::Tensor& x, const OptTensor& bias = std::nullopt) {
    const int64_t parts = dim();
    TORCH_CHECK(parts >= 1, "decode_layers: a linear needs a part");
    std::vector<at::Tensor> outs;
    outs.reserve(parts);
    for (int64_t p = 0; p < parts; ++p) {
      at::Tensor codes = tensor();
      OptTensor scales = next(), mins = next();
      const int64_t group = dim(), n = dim();
      if (group < 0) {
        TORCH_CHECK(parts == 1, "decode_layers: a packed linear is one part");
        return packed_linear(x, codes, group, n, bias);
      }
      if (group == 0) {  // dense; n is the most rows the GEMV takes, then the packed copy
        TORCH_CHECK(parts == 1, "decode_layers: a dense linear is one part");
        if (x.size(0) <= std::max(n, gemv_rows))
          return diptych_cpu::small_m_linear(x, codes, bias, false);
        if (scales.has_value()) return packed_linear(x, *scales, -1, n, bias);
        return at::linear(x, codes, bias);
      }
      TORCH_CHECK(scales.has_value(), "decode_layers: a quantized part needs scales");
      outs.push_back(diptych_cpu::quant_linear(x, codes, *scales, mins, group, n, false));
    }
    at::Tensor y = parts == 1 ? outs[0] : at::cat(outs, -1);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
};

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& x0, const c10::List<OptTensor>& weights, at::IntArrayRef dims,
    at::TensorList kv_caches, const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& slots, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window,
    int64_t gemv_rows, const OptTensor& row_seq, int64_t attention) {
  TORCH_CHECK(x0.dim() == 2 && x0.is_contiguous(), "decode_layers: x must be contiguous [T, H]");
  const int64_t T = x0.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
  TORCH_CHECK(block_table.size(0) == T && seq_lens.size(0) == T && slots.size(0) == T,
              "decode_layers: one block-table row, length and slot per token");
  TORCH_CHECK(attention >= 0 && attention <= 2 && (attention == 0 || row_seq.has_value()),
              "decode_layers: attention is 0, or 1 or 2 with row_seq");
  const c10::TypedOperatorHandle<DetAttention>* det = nullptr;
  if (attention == 1) {
    static const auto plain = op<DetAttention>("diptych_cpu::det_attention");
    det = &plain;
  } else if (attention == 2) {
    static const auto amx = op<DetAttention>("diptych_cpu::det_attention_amx");
    det = &amx;
  }
  Cursor c{weights, dims};
  c.gemv_rows = gemv_rows;
  at::Tensor x = x0;
  OptTensor residual;
  for (const at::Tensor& kv : kv_caches) {
    at::Tensor h;
    std::tie(h, x) = diptych_cpu::rms_norm(x, residual, c.tensor(), eps);
    OptTensor bias = c.next();
    at::Tensor qkv = c.linear(h, bias);
    TORCH_CHECK(qkv.size(1) == qs + 2 * kvs, "decode_layers: qkv width");
    at::Tensor q = qkv.narrow(1, 0, qs).view({T, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, qs, kvs).view({T, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({T, num_kv_heads, head_dim});
    diptych_cpu::rotary_(q, cos, sin);
    diptych_cpu::rotary_(k, cos, sin);
    at::Tensor k_cache = kv.select(1, 0), v_cache = kv.select(1, 1);
    diptych_cpu::store_kv(k, v, k_cache, v_cache, slots);
    at::Tensor o = at::empty({T, num_heads, head_dim}, x.options());
    if (det)
      det->call(q, k_cache, v_cache, block_table, seq_lens, *row_seq, scale, window, o);
    else
      diptych_cpu::paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale,
                                          window, o);
    h = c.linear(o.view({T, qs}));
    std::tie(h, x) = diptych_cpu::rms_norm(h, x, c.tensor(), eps);
    h = c.linear(diptych_cpu::silu_and_mul(c.linear(h)));
    residual = x;
    x = h;
  }
  TORCH_CHECK(c.w == weights.size() && c.d == dims.size(),
              "decode_layers: weights or dims left over after the last layer");
  TORCH_CHECK(residual.has_value(), "decode_layers: no layers");
  return {x, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor?[] weights, int[] dims, Tensor[] kv_caches, "
        "Tensor block_table, Tensor seq_lens, Tensor slots, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int window, "
        "int gemv_rows=0, Tensor? row_seq=None, int attention=0) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(diptych_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
