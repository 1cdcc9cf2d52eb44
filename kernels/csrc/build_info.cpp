// build_info(): what this build of the C++ ops was compiled to use, as "key=value"
// pairs, so tests and the start-up log can check the ISA paths that are compiled in.
#include <torch/library.h>

#include <string>

#include "isa.h"

namespace {

std::string build_info() {
  std::string s;
  auto add = [&s](const char* key, long value) {
    if (!s.empty()) s += ' ';
    s += key;
    s += '=';
    s += std::to_string(value);
  };
#ifdef __AVX2__
  add("avx2", 1);
#else
  add("avx2", 0);
#endif
#ifdef __FMA__
  add("fma", 1);
#else
  add("fma", 0);
#endif
#ifdef __AVX512F__
  add("avx512f", 1);
#else
  add("avx512f", 0);
#endif
#ifdef DIPTYCH_HAVE_AVX512_BF16
  add("avx512_bf16", 1);
#else
  add("avx512_bf16", 0);
#endif
#ifdef __aarch64__
  add("neon", 1);
#else
  add("neon", 0);
#endif
  add("vec_lanes", disa::VEC_LANES);
  add("f32acc_lanes", disa::F32ACC_LANES);
  add("f32acc_rows", disa::F32ACC_ROWS);
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(diptych_cpu, m) {
  m.def("build_info() -> str", &build_info);
}
