// What the AMX kernels (gemm_amx.cpp, det_attention_amx.cpp) share: the tile
// configuration's layout (palette 1) and the OS's permission to use the tiles.
// Linux lends the tile registers to a process that asks (arch_prctl), once.
#pragma once

#include <cstdint>

#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#define AMX_FN __attribute__((target("amx-tile,amx-bf16")))

namespace damx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Load a configuration. The barrier keeps its stores: GCC does not see that
// LDTILECFG reads the struct, and dropped every field but the palette.
AMX_FN inline void load_config(const TileConfig& c) {
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

inline bool tiles_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline bool tiles_available() {
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         tiles_permitted();
}

}  // namespace damx
