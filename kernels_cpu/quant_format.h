// What the kernels of every instruction set share, with no intrinsics: the weight
// formats and their layouts, the rows of integer activations (`IntRows`), the tile
// sizes and the instruction-set tag of a handler (`Isa`). x86-64 builds add the
// AVX-512 and AVX2 tiles (quant_dot.h, quant_int.h, quant_gemm.h, kquant_dot.h,
// quant_dot_avx2.h), aarch64 builds the NEON ones (quant_dot_neon.h).

#ifndef XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_
#define XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_

#include <cstdint>
#include <vector>

namespace xlaserve {

// The instruction set a handler's loops use: the AVX-512 ones (quant_dot.h,
// attention.h), the AVX2 ones (quant_dot_avx2.h, attention_avx2.h) or, on aarch64,
// the NEON ones (quant_dot_neon.h, attention_neon.h).
enum class Isa { kAvx512, kAvx2, kNeon };

constexpr int kGroup = 32;
constexpr int kMaxRows = 32;  // rows of one fused decode step (decoder.cc, decoder.py)
constexpr int kTileRows = 8;  // activation rows per pass (their register accumulators)

// Q4_K, Q5_K, Q6_K: GGUF K-quants, with super-block scales (kquant_dot.h).
enum Format { kU8, kS8, kQ4_1, kQ4_0, kQ4_K, kQ5_K, kQ6_K };

constexpr bool HasMin(Format f) { return f == kU8 || f == kQ4_1; }
constexpr int64_t GroupBytes(Format f) { return f == kQ4_1 || f == kQ4_0 ? kGroup / 2 : kGroup; }

constexpr int64_t kSuper = 256;  // inputs per K-quant super-block

constexpr bool IsKQuant(Format f) { return f == kQ4_K || f == kQ5_K || f == kQ6_K; }

// The operands of one K-quant matrix (pointers to its first output row; kquant_dot.h).
struct KWeight {
  const uint8_t* q = nullptr;       // [O, I/2] nibbles
  const uint8_t* q_high = nullptr;  // [O, I/8] (Q5_K), [O, I/4] (Q6_K); Q4_K: unused
  const uint8_t* scale = nullptr;   // [O, I/32] uint8 (Q4_K, Q5_K) | [O, I/16] int8 (Q6_K)
  const uint8_t* offset = nullptr;  // [O, I/32] uint8 min codes (Q4_K, Q5_K)
  const uint16_t* super_scale = nullptr;   // f16 [O, I/256]: d
  const uint16_t* super_offset = nullptr;  // f16 [O, I/256]: -dmin (Q4_K, Q5_K)
};

// Bytes per input row of each operand (scale codes: one byte per sub-block).
constexpr int64_t KHighBytes(Format f, int64_t in) {
  return f == kQ5_K ? in / 8 : f == kQ6_K ? in / 4 : 0;
}
constexpr int64_t KScaleCount(Format f, int64_t in) { return f == kQ6_K ? in / 16 : in / kGroup; }

// Activation rows rounded per group of 32 to 8 or 16 bits (quant_dot.h
// `QuantizeRowRange` and each set's copy of its operations), in the layouts the
// instruction set's integer tiles read.
struct IntRows {
  bool has_lo = false;           // rounded to 16 bits (hi and lo) or to 8 (hi only)
  bool nibble_order = true;      // fill hi, lo, dx (the nibble tiles read them)
  bool plain_order = true;       // fill hi_plain, lo_plain (the exact and AMX tiles)
  std::vector<int8_t> hi, lo;    // [rows, pairs, 64] nibble order
  std::vector<int8_t> hi_plain, lo_plain;  // [rows, groups * 32] input order
  std::vector<float> dx;         // [rows, pairs, 16] lane scales (dx_g, dx_g+1 pattern)
  std::vector<int16_t> x8, x16;  // [rows, groups * 32] input order: hi, 256 hi + lo (AVX2 tiles)
  bool avx_vnni = false;         // the AVX2 tiles use AVX-VNNI (avx2::PrepareRows)
  bool sdot = false;             // the NEON tiles use SDOT (neon::PrepareRows)
  std::vector<float> xsum8;      // [rows, groups] sums of x rounded to 8 bits
  std::vector<float> xsum16;     // [rows, groups] sums of x rounded to 16 bits (has_lo)
  std::vector<float> dx_group;   // [rows, groups] each group's dx (the exact tiles)
  std::vector<int32_t> xint8;    // [rows, groups] sum of hi (exact)
  std::vector<int32_t> xint16;   // [rows, groups] 256 * sum of hi + sum of lo (has_lo)
};

// `call` with the compile-time constant R = rows (1..kTileRows): tiles keep their
// accumulators in registers only when the row count is known to the compiler.
#define XLASERVE_WITH_TILE_ROWS(rows, call)        \
  switch (rows) {                                   \
    case 1: { constexpr int R = 1; call; } break;   \
    case 2: { constexpr int R = 2; call; } break;   \
    case 3: { constexpr int R = 3; call; } break;   \
    case 4: { constexpr int R = 4; call; } break;   \
    case 5: { constexpr int R = 5; call; } break;   \
    case 6: { constexpr int R = 6; call; } break;   \
    case 7: { constexpr int R = 7; call; } break;   \
    default: { constexpr int R = 8; call; } break;  \
  }

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_
