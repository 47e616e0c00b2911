// What the kernels of every instruction set share, with no intrinsics: the weight
// formats and their layouts, the rows of integer activations (`IntRows`), the tile
// sizes and the instruction-set tag of a handler (`Isa`). x86-64 builds add the
// AVX-512 and AVX2 tiles (quant_dot.h, quant_int.h, quant_gemm.h, kquant_dot.h,
// quant_dot_avx2.h), aarch64 builds the NEON ones (quant_dot_neon.h).

#ifndef XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_
#define XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>
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
// Whether the AMX tiles take format f (quant_int.h; `tiled`: in the column-tiled layout):
// the integer formats, Q6_K (a product per 16 inputs) only column-tiled, where its codes
// are in input order (as stored, each group's two 16-input halves are interleaved).
constexpr bool AmxFormat(Format f, bool tiled) {
  return f == kS8 || f == kQ4_0 || f == kQ4_1 || f == kQ4_K || f == kQ5_K ||
         (f == kQ6_K && tiled);
}

// The operands of one K-quant matrix (pointers to its first output row; kquant_dot.h).
struct KWeight {
  const uint8_t* q = nullptr;       // [O, I/2] nibbles
  const uint8_t* q_high = nullptr;  // [O, I/8] (Q5_K), [O, I/4] (Q6_K); Q4_K: unused
  const uint8_t* scale = nullptr;   // [O, I/32] uint8 (Q4_K, Q5_K) | [O, I/16] int8 (Q6_K)
  const uint8_t* offset = nullptr;  // [O, I/32] uint8 min codes (Q4_K, Q5_K)
  const uint16_t* super_scale = nullptr;   // f16 [O, I/256]: d
  const uint16_t* super_offset = nullptr;  // f16 [O, I/256]: -dmin (Q4_K, Q5_K)
};

// Output columns per block of the column-tiled layout (`IntWeight::tiled`).
constexpr int64_t kTileCols = 16;
// The formats the column-tiled layout holds (`IntWeight::tiled`).
constexpr bool TiledFormat(Format f) {
  return f == kS8 || f == kQ4_0 || f == kQ4_1 || f == kQ4_K || f == kQ6_K;
}

// One matrix's operands for the integer tiles (quant_int.h): `codes` with float16 `scale` (and
// `offset`: mins) per group of 32 (Q8_0, Q4_0, Q4_1), or a K-quant's blocks (`k`).
//
// `tiled` (`TiledFormat`: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; AVX-512 only): the arrays keep
// their shapes ([O, I/2] or [O, I] codes, [O, I/32] scales and mins, a K-quant's scale
// and min codes, super-block values and Q6_K's [O, I/4] high bits) but each block of
// kTileCols = 16 output columns is laid out as the integer tiles read it, one
// sequential stream a block: codes [groups][chunks][16 columns][4 bytes] — chunk k of a
// group is its bytes 4k..4k+3 (Q4 / Q4_K / Q6_K: the low nibbles inputs 4k..4k+3, the
// high nibbles inputs 16 + 4k..: 4 chunks a group; Q6_K's nibbles are re-paired into
// that order from its per-16 one; Q8_0: inputs 4k..4k+3, 8 chunks) — and every
// per-column byte or value array [its count][16 columns] (Q6_K's high bits: a byte per
// chunk of 4 inputs). O is a multiple of 16. Made once at load
// (serving/models/quantized.py `tile_for_native`).
struct IntWeight {
  int64_t in = 0;
  const uint8_t* codes = nullptr;
  const uint16_t* scale = nullptr;
  const uint16_t* offset = nullptr;
  KWeight k;
  bool tiled = false;
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
  bool nibble_order = true;      // fill hi, lo (the nibble tiles read them)
  bool plain_order = true;       // fill hi_plain, lo_plain (the exact Q8_0 tiles)
  bool amx_order = true;         // fill amx_a, amx_dx (the AMX tiles) where AMX runs
  std::vector<int8_t> hi, lo;    // [rows, pairs, 64] nibble order
  std::vector<int8_t> hi_plain, lo_plain;  // [rows, groups * 32] input order
  // The AMX A tiles of the whole 16-row tiles, packed once per rounding (quant_int.h
  // AmxTile8 / AmxTile16): [rows / 16, groups, 512] (a8: 16 rows x 32 bytes) or [.., 1024] (a16:
  // rows 0-7's hi bytes above their lo bytes, then rows 8-15's); amx_dx their group
  // scales [rows / 16, groups, 16]. Empty where AMX does not run.
  std::vector<int8_t> amx_a;
  std::vector<float> amx_dx;
  std::vector<int16_t> x8, x16;  // [rows, groups * 32] input order: hi, 256 hi + lo (AVX2 tiles)
  bool avx_vnni = false;         // the AVX2 tiles use AVX-VNNI (avx2::PrepareRows)
  bool sdot = false;             // the NEON tiles use SDOT (neon::PrepareRows)
  std::vector<float> xsum8;      // [rows, groups] sums of x rounded to 8 bits
  std::vector<float> xsum16;     // [rows, groups] sums of x rounded to 16 bits (has_lo)
  std::vector<float> dx_group;   // [rows, groups] each group's dx (the exact tiles)
  std::vector<int32_t> xint8;    // [rows, groups] sum of hi (exact)
  std::vector<int32_t> xint16;   // [rows, groups] 256 * sum of hi + sum of lo (has_lo)
  // [rows, groups * 2] the same sums per 16 inputs (Q6_K's -32; AVX-512 QuantizeRowRange).
  std::vector<int32_t> xint8_half, xint16_half;
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

// fn(std::integral_constant<int, n>{}) for 1 <= n <= kMax: a tile's row count as a
// template argument (the loops below; the AVX-512 tiles use XLASERVE_WITH_TILE_ROWS).
template <int kMax, typename Fn>
inline void WithRows(int n, Fn&& fn) {
  if constexpr (kMax > 1) {
    if (n < kMax) return WithRows<kMax - 1>(n, fn);
  }
  fn(std::integral_constant<int, kMax>{});
}

// fn(std::true_type{}) or fn(std::false_type{}): a run-time flag as a template argument.
template <typename Fn>
inline void WithFlag(bool flag, Fn&& fn) {
  if (flag) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// The float tiles' column loop of the unblocked sets (AVX2, NEON): per output column o
// in [o0, o1) of a groups-of-32 weight, its codes q, scales s_row and mins m_row
// (nullptr without), and rows [0, rows) in tiles of up to kMaxRows:
// tile(R, r0, q, s_row, m_row, o), R a std::integral_constant row count.
template <Format kFmt, int kMaxRows, typename Tile>
inline void ForColumnTiles(int rows, int64_t in, const uint8_t* codes, const uint16_t* scale,
                           const uint16_t* offset, int64_t o0, int64_t o1, Tile&& tile) {
  const int64_t groups = in / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * groups * GroupBytes(kFmt);
    const uint16_t* s_row = scale + o * groups;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    for (int r0 = 0; r0 < rows; r0 += kMaxRows) {
      WithRows<kMaxRows>(std::min(kMaxRows, rows - r0),
                         [&](auto r) { tile(r, r0, q, s_row, m_row, o); });
    }
  }
}

// The integer tiles' column loop of the unblocked sets (AVX2, NEON): output columns
// [o0, o1) in blocks of kCols, each block's float16 scales (and mins) as [groups][kCols]
// (`halves(values, groups, o, n, dst)`, this thread's buffers), then rows [r0, r1) in
// tiles of up to kMaxRows: tile(R, b, o, n, dcol, mcol), n <= kCols the block's columns.
template <Format kFmt, int kCols, int kMaxRows, typename Halves, typename Tile>
inline void ForIntColumnTiles(int r0, int r1, int64_t in, const uint16_t* scale,
                              const uint16_t* offset, int64_t o0, int64_t o1, Halves halves,
                              Tile&& tile) {
  const int64_t groups = in / kGroup;
  thread_local std::vector<uint16_t> dcol, mcol;  // this thread's, reused across calls
  dcol.resize(groups * kCols);
  mcol.resize(HasMin(kFmt) ? groups * kCols : 0);
  for (int64_t o = o0; o < o1; o += kCols) {
    const int n = static_cast<int>(std::min<int64_t>(kCols, o1 - o));
    halves(scale, groups, o, n, dcol.data());
    if (HasMin(kFmt)) halves(offset, groups, o, n, mcol.data());
    for (int b = r0; b < r1; b += kMaxRows) {
      WithRows<kMaxRows>(std::min(kMaxRows, r1 - b),
                         [&](auto r) { tile(r, b, o, n, dcol.data(), mcol.data()); });
    }
  }
}

// Sizes the per-group fields of `r` (the group scales, the sums of the rounded values,
// and with `with_lo` their 16-bit versions) for `rows` rows of `groups` groups.
inline void SizeGroupFields(int rows, int64_t groups, bool with_lo, IntRows& r) {
  r.has_lo = with_lo;
  r.dx_group.resize(rows * groups);
  r.xsum8.resize(rows * groups);
  r.xint8.resize(rows * groups);
  r.xsum16.resize(with_lo ? rows * groups : 0);
  r.xint16.resize(with_lo ? rows * groups : 0);
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_FORMAT_H_
