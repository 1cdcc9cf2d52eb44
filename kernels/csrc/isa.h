// What this build of the C++ ops may use, decided by the compiler flags alone
// (kernels/cpu_isa.py picks them per ISA level; never -march=native). Every kernel
// that has an ISA-specific path tests these macros, and `build_info` reports them,
// so the paths compiled in are exactly the paths the Python dispatch expects.
#pragma once

// VDPBF16PS (AVX512-BF16): the bf16 GEMV, the VNNI-packed GEMM, the bf16 attention.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DIPTYCH_HAVE_AVX512_BF16 1
#endif

namespace disa {

// Float lanes of the widest vector register this build may use, and how many such
// registers there are (what register-tiled kernels size their tiles by).
#if defined(__AVX512F__)
#define DIPTYCH_VEC_LANES 16
constexpr int VEC_REGS = 32;
#elif defined(__AVX2__)
#define DIPTYCH_VEC_LANES 8
constexpr int VEC_REGS = 16;
#elif defined(__aarch64__)
#define DIPTYCH_VEC_LANES 4
constexpr int VEC_REGS = 32;  // NEON
#else
#define DIPTYCH_VEC_LANES 4
constexpr int VEC_REGS = 16;  // SSE2
#endif
constexpr int VEC_LANES = DIPTYCH_VEC_LANES;

// The bf16-weight fp32-arithmetic GEMM (gemm_f32acc.cpp): lanes per vector and rows
// per register tile (2 accumulators a row, plus weights, a broadcast and a mask).
constexpr int F32ACC_LANES = VEC_LANES;
constexpr int F32ACC_ROWS = VEC_REGS == 32 ? 12 : 6;

}  // namespace disa
