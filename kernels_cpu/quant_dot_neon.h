// The column loops of quant_dot_avx2.h for aarch64 (Advanced SIMD, the ARMv8-A
// baseline): the same formats, operands, entry points and numerics, in 4-float
// vectors, a group of 32 inputs being 8 of them.
//
// Float activations (`Columns`): float32 products and sums, the same values as the
// other sets up to summation order; tiles of up to kNeonTileRows = 4 rows (8 code
// vectors and 4 accumulators of the 32 vector registers), the min term added after
// the code loop (quant_dot_avx2.h's order).
//
// Integer activations (`IntColumns`, nibbles and Q8_0): quant_int.h's block-exact
// numerics, so the same bits as the AVX-512 and AVX2 sets. A row's activations are
// rounded with quant_dot.h QuantizeRowRange's operations (round to nearest even:
// FCVTNS) and kept as int8 in input order (`hi_plain`, `lo_plain`: hi, and for 16
// bits the remainder lo, 256 hi + lo being the value). Per row, column and group the
// exact int32 sum of the 32 code x activation products comes from SDOT (the
// dotprod extension, ARMv8.2-A and later: Cortex-A76+, Neoverse, Apple M; asked at
// run time with getauxval(AT_HWCAP) & HWCAP_ASIMDDP) or, without it, from SMULL
// (int8 x int8 -> int16, |w x| <= 128 * 127) and pairwise adds into int32; for
// 16 bits hi and lo products separately, 256 * hi + lo. 4 columns' lanes are then
// reduced to one lane per column (`Reduce4`) and the float32 epilogue runs on 4
// columns at once, in group order.

#ifndef XLASERVE_KERNELS_CPU_QUANT_DOT_NEON_H_
#define XLASERVE_KERNELS_CPU_QUANT_DOT_NEON_H_

#include <arm_neon.h>
#include <sys/auxv.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant_format.h"

namespace xlaserve {
namespace neon {

constexpr int kNeonTileRows = 4;  // activation rows per pass (their register accumulators)
constexpr int kIntCols = 4;       // output columns per integer tile (one int32 / float lane each)
constexpr uint64_t kHwcapAsimdDp = 1u << 20;  // HWCAP_ASIMDDP (<asm/hwcap.h>)

inline float HalfToFloat(uint16_t h) {
  __fp16 f;
  std::memcpy(&f, &h, sizeof(f));
  return static_cast<float>(f);
}

// 4 float16 values (scales or mins) as float32.
inline float32x4_t Halves4(const uint16_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

// 16 int16 values (a: 8, b: 8) as four float32 vectors.
inline void WordsToFloats(int16x8_t a, int16x8_t b, float32x4_t* c) {
  c[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(a)));
  c[1] = vcvtq_f32_s32(vmovl_high_s16(a));
  c[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(b)));
  c[3] = vcvtq_f32_s32(vmovl_high_s16(b));
}

// 16 code bytes (signed, or unsigned) as four float32 vectors.
template <bool kSigned>
inline void BytesToFloats(uint8x16_t v, float32x4_t* c) {
  if constexpr (kSigned) {
    const int8x16_t s = vreinterpretq_s8_u8(v);
    WordsToFloats(vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s), c);
  } else {
    WordsToFloats(vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(v))),
                  vreinterpretq_s16_u16(vmovl_high_u8(v)), c);
  }
}

// The 32 codes of a group as eight float32 vectors (inputs 0-3, 4-7, ..., 28-31).
template <Format kFmt>
inline void Codes(const uint8_t* q, float32x4_t c[8]) {
  if constexpr (kFmt == kU8 || kFmt == kS8) {
    BytesToFloats<kFmt == kS8>(vld1q_u8(q), c);
    BytesToFloats<kFmt == kS8>(vld1q_u8(q + 16), c + 4);
  } else {  // byte j: input j in its low nibble, input j + 16 in its high one
    const uint8x16_t b = vld1q_u8(q);
    BytesToFloats<false>(vandq_u8(b, vdupq_n_u8(0x0F)), c);
    BytesToFloats<false>(vshrq_n_u8(b, 4), c + 4);
  }
}

// Sums of each group of 32 activations, xsum[b, g] (the min term of a float tile).
inline void GroupSums(const float* x, int rows, int64_t in, float* xsum) {
  const int64_t groups = in / kGroup;
  for (int b = 0; b < rows; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      float32x4_t s = vld1q_f32(xg);
      for (int j = 1; j < 8; ++j) s = vaddq_f32(s, vld1q_f32(xg + 4 * j));
      xsum[b * groups + g] = vaddvq_f32(s);
    }
  }
}

// sum_g m_g * xsum_g of one row (m_g: the group's min, or -8 * scale for Q4_0).
template <Format kFmt>
inline float MinTerm(const float* xsum, int64_t groups, const uint16_t* s_row,
                     const uint16_t* m_row) {
  const uint16_t* src = HasMin(kFmt) ? m_row : s_row;
  const float factor = HasMin(kFmt) ? 1.0f : -8.0f;
  float32x4_t acc = vdupq_n_f32(0.0f);
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) acc = vfmaq_f32(acc, Halves4(src + g), vld1q_f32(xsum + g));
  float sum = vaddvq_f32(acc);
  for (; g < groups; ++g) sum += HalfToFloat(src[g]) * xsum[g];
  return sum * factor;
}

// Output column o for activation rows [r0, r0 + kRows), kRows <= kNeonTileRows, as
// sum_g (s_g * sum_i c_i x_i) + sum_g m_g xsum_g (quant_dot.h `Tile`).
template <Format kFmt, int kRows>
void Tile(const float* x, const float* xsum, int r0, int64_t in, const uint8_t* q,
          const uint16_t* s_row, const uint16_t* m_row, float* out, int64_t out_dim, int64_t o) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  float32x4_t acc[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    const float s = HalfToFloat(s_row[g]);
    float32x4_t c[8];
    Codes<kFmt>(q + g * group_bytes, c);
    for (int b = 0; b < kRows; ++b) {
      const float* xb = x + (r0 + b) * in + g * kGroup;
      float32x4_t dot = vmulq_f32(c[0], vld1q_f32(xb));
      for (int j = 1; j < 8; ++j) dot = vfmaq_f32(dot, c[j], vld1q_f32(xb + 4 * j));
      acc[b] = vfmaq_n_f32(acc[b], dot, s);
    }
  }
  for (int b = 0; b < kRows; ++b) {
    float y = vaddvq_f32(acc[b]);
    if constexpr (kFmt != kS8) y += MinTerm<kFmt>(xsum + (r0 + b) * groups, groups, s_row, m_row);
    out[(r0 + b) * out_dim + o] = y;
  }
}

// Output columns [o0, o1) for all `rows` activation rows (xsum: their GroupSums),
// in tiles of up to kNeonTileRows rows (quant_dot.h `Columns`).
template <Format kFmt>
void Columns(const float* x, const float* xsum, int rows, int64_t in, const uint8_t* codes,
             const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
             int64_t o0, int64_t o1) {
  ForColumnTiles<kFmt, kNeonTileRows>(
      rows, in, codes, scale, offset, o0, o1,
      [&](auto r, int r0, const uint8_t* q, const uint16_t* s_row, const uint16_t* m_row,
          int64_t o) {
        Tile<kFmt, decltype(r)::value>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o);
      });
}

// ---- Integer activations: block-exact (quant_int.h's numerics) ----

// Whether this CPU has SDOT (asked once).
inline bool SdotHardware() {
  static const bool ok = (getauxval(AT_HWCAP) & kHwcapAsimdDp) != 0;
  return ok;
}

// SdotHardware() unless XLASERVE_NATIVE_SDOT is 0 (read at each call: tests compare
// both; the integers, hence the results, are the same either way).
inline bool SdotEnabled() {
  const char* env = std::getenv("XLASERVE_NATIVE_SDOT");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return SdotHardware();
}

// 32 int32 values (in int8 range) stored as 32 int8.
inline void StoreBytes(int8_t* dst, const int32x4_t v[8]) {
  for (int h = 0; h < 2; ++h) {
    const int16x8_t a = vcombine_s16(vqmovn_s32(v[4 * h]), vqmovn_s32(v[4 * h + 1]));
    const int16x8_t b = vcombine_s16(vqmovn_s32(v[4 * h + 2]), vqmovn_s32(v[4 * h + 3]));
    vst1q_s8(dst + 16 * h, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
  }
}

inline int32_t SumLanes(const int32x4_t v[8]) {
  int32x4_t s = v[0];
  for (int j = 1; j < 8; ++j) s = vaddq_s32(s, v[j]);
  return vaddvq_s32(s);
}

// Sizes `r` for `rows` rows of `in` inputs rounded to 16 bits (`with_lo`) or 8, in
// the NEON tiles' fields (the input-order bytes and the per-group values).
inline void PrepareRows(int rows, int64_t in, bool with_lo, IntRows& r) {
  const int64_t groups = in / kGroup;
  r.nibble_order = false;
  r.plain_order = true;
  r.sdot = SdotEnabled();
  r.hi.clear();
  r.lo.clear();
  r.x8.clear();
  r.x16.clear();
  r.hi_plain.resize(rows * groups * kGroup);
  r.lo_plain.resize(with_lo ? rows * groups * kGroup : 0);
  SizeGroupFields(rows, groups, with_lo, r);
}

// Rows [b0, b1) of x rounded per group into `r` (sized by PrepareRows), with quant_dot.h
// QuantizeRowRange's operations (the same values): each row on its own.
inline void QuantizeRowRange(const float* x, int b0, int b1, int64_t in, IntRows& r) {
  const int64_t groups = in / kGroup;
  const bool with_lo = r.has_lo;
  const float32x4_t k256 = vdupq_n_f32(256.0f);
  const int32x4_t lo_max = vdupq_n_s32(127), lo_min = vdupq_n_s32(-127);
  for (int b = b0; b < b1; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      float32x4_t v[8], amax = vdupq_n_f32(0.0f);
      for (int j = 0; j < 8; ++j) {
        v[j] = vld1q_f32(xg + 4 * j);
        amax = vmaxq_f32(amax, vabsq_f32(v[j]));
      }
      const float d = vmaxvq_f32(amax) / 127.0f;
      const float32x4_t inv = vdupq_n_f32(d > 0.0f ? 1.0f / d : 0.0f);
      float32x4_t sv[8];
      int32x4_t qv[8];
      for (int j = 0; j < 8; ++j) {
        sv[j] = vmulq_f32(v[j], inv);
        qv[j] = vcvtnq_s32_f32(sv[j]);  // in [-127, 127]
      }
      const int64_t at = b * groups + g;
      const int32_t sum8 = SumLanes(qv);
      r.xsum8[at] = d * static_cast<float>(sum8);
      r.xint8[at] = sum8;
      r.dx_group[at] = d;
      StoreBytes(r.hi_plain.data() + at * kGroup, qv);
      if (with_lo) {
        int32x4_t rv[8];
        for (int j = 0; j < 8; ++j) {
          const float32x4_t rest = vmulq_f32(vsubq_f32(sv[j], vcvtq_f32_s32(qv[j])), k256);
          rv[j] = vmaxq_s32(lo_min, vminq_s32(lo_max, vcvtnq_s32_f32(rest)));
        }
        const int32_t lo_sum = SumLanes(rv);
        r.xint16[at] = 256 * sum8 + lo_sum;
        r.xsum16[at] =
            d * (static_cast<float>(sum8) + static_cast<float>(lo_sum) * (1.0f / 256.0f));
        StoreBytes(r.lo_plain.data() + at * kGroup, rv);
      }
    }
  }
}

// Rows of x rounded per group for the NEON integer tiles (`with_lo`: to 16 bits).
inline void QuantizeRows(const float* x, int rows, int64_t in, bool with_lo, IntRows& r) {
  neon::PrepareRows(rows, in, with_lo, r);
  neon::QuantizeRowRange(x, 0, rows, in, r);
}

// The float16 values (scales or mins, [O, groups]) of columns [o, o + n), n <= 4, as
// [groups][4]; lanes past n repeat column o + n - 1 (their outputs are not stored).
inline void ColumnHalves(const uint16_t* values, int64_t groups, int64_t o, int n,
                         uint16_t* dst) {
  for (int c = 0; c < kIntCols; ++c) {
    const uint16_t* src = values + (o + std::min(c, n - 1)) * groups;
    for (int64_t g = 0; g < groups; ++g) dst[g * kIntCols + c] = src[g];
  }
}

// The 32 codes of a group as signed bytes (w0: inputs 0-15, w1: 16-31): Q8_0 codes, or
// nibbles (Q4_0's - 8 is taken out after the sum).
template <Format kFmt>
inline void CodeBytes(const uint8_t* q, int8x16_t& w0, int8x16_t& w1) {
  if constexpr (kFmt == kS8) {
    w0 = vld1q_s8(reinterpret_cast<const int8_t*>(q));
    w1 = vld1q_s8(reinterpret_cast<const int8_t*>(q + 16));
  } else {  // byte j: input j in its low nibble, j + 16 in its high one
    const uint8x16_t b = vld1q_u8(q);
    w0 = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(0x0F)));
    w1 = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
  }
}

// The dotprod extension (ARMv8.2-A+): only the SDOT tiles' functions carry it, so
// the rest of the library stays baseline ARMv8-A code.
#define XLASERVE_SDOT_TARGET __attribute__((target("arch=armv8.2-a+dotprod")))

// The 4 int32 lanes of a group's 32 code x activation byte products with SDOT.
XLASERVE_SDOT_TARGET inline int32x4_t SdotBytes(int8x16_t w0, int8x16_t w1, int8x16_t x0,
                                                int8x16_t x1) {
  return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1);
}

// The same with SMULL (int8 x int8 -> int16) and pairwise adds. Exact: |w x| <= 128 * 127.
inline int32x4_t SmullBytes(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
  int32x4_t acc = vpaddlq_s16(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)));
  acc = vpadalq_s16(acc, vmull_high_s8(w0, x0));
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w1), vget_low_s8(x1)));
  return vpadalq_s16(acc, vmull_high_s8(w1, x1));
}

template <bool kSdot>
inline int32x4_t DotBytes(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
  if constexpr (kSdot) {
    return SdotBytes(w0, w1, x0, x1);
  } else {
    return SmullBytes(w0, w1, x0, x1);
  }
}

// The lane sums of 4 vectors: lane c = sum of d[c]'s 4 lanes (integer adds: exact).
inline int32x4_t Reduce4(int32x4_t d0, int32x4_t d1, int32x4_t d2, int32x4_t d3) {
  return vpaddq_s32(vpaddq_s32(d0, d1), vpaddq_s32(d2, d3));
}

// The exact int32 sums of one row's group (`x`: its 32 bytes of one rounding) with the
// 4 columns' codes w (w[2c], w[2c + 1]: column c), one lane per column.
template <bool kSdot>
inline int32x4_t ColumnSums(const int8x16_t w[2 * kIntCols],
                                                 const int8_t* x) {
  const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
  int32x4_t d[kIntCols];
  for (int c = 0; c < kIntCols; ++c) d[c] = DotBytes<kSdot>(w[2 * c], w[2 * c + 1], x0, x1);
  return Reduce4(d[0], d[1], d[2], d[3]);
}

// Columns [o, o + n) (n <= 4) x rows [r0, r0 + kRows) of `r` (neon::QuantizeRows),
// nibbles (Q4_1, Q4_0) or Q8_0 codes: quant_int.h's numerics, so the same bits as the
// AVX-512 and AVX2 sets. dcol / mcol: the columns' scales / mins (ColumnHalves).
template <Format kFmt, int kRows, bool kLo, bool kSdot>
inline void ExactIntTile(const IntRows& r, int r0, int64_t groups,
                                       const uint8_t* codes, int64_t o, int n,
                                       const uint16_t* dcol, const uint16_t* mcol, float* out,
                                       int64_t out_dim) {
  constexpr bool kMin = HasMin(kFmt);
  constexpr int64_t kBytes = GroupBytes(kFmt);
  const float* dx = r.dx_group.data();
  const int32_t* xint = (kLo ? r.xint16 : r.xint8).data();
  const float* xsum = kMin ? (kLo ? r.xsum16 : r.xsum8).data() : nullptr;
  const uint8_t* col[kIntCols];  // lanes past n repeat the last column (not stored)
  for (int c = 0; c < kIntCols; ++c) col[c] = codes + (o + std::min(c, n - 1)) * groups * kBytes;
  float32x4_t acc[kRows], mins[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = mins[b] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    int8x16_t w[2 * kIntCols];
    for (int c = 0; c < kIntCols; ++c) CodeBytes<kFmt>(col[c] + g * kBytes, w[2 * c], w[2 * c + 1]);
    const float32x4_t dv = Halves4(dcol + g * kIntCols);
    const float32x4_t mv = kMin ? Halves4(mcol + g * kIntCols) : vdupq_n_f32(0.0f);
    for (int b = 0; b < kRows; ++b) {
      const int64_t at = (r0 + b) * groups + g;
      int32x4_t s = ColumnSums<kSdot>(w, r.hi_plain.data() + at * kGroup);
      if constexpr (kLo) {  // 256 * (w . hi) + w . lo
        s = vaddq_s32(vshlq_n_s32(s, 8), ColumnSums<kSdot>(w, r.lo_plain.data() + at * kGroup));
      }
      if constexpr (kFmt == kQ4_0) s = vsubq_s32(s, vdupq_n_s32(8 * xint[at]));  // (n - 8) x
      acc[b] = vfmaq_f32(acc[b], vcvtq_f32_s32(s), vmulq_n_f32(dv, dx[at]));
      if constexpr (kMin) mins[b] = vfmaq_n_f32(mins[b], mv, xsum[at]);
    }
  }
  const float32x4_t unit = vdupq_n_f32(kLo ? 1.0f / 256.0f : 1.0f);
  for (int b = 0; b < kRows; ++b) {
    float32x4_t y = acc[b];  // quant_int.h Finish
    if constexpr (kMin) {
      y = vfmaq_f32(mins[b], acc[b], unit);
    } else if constexpr (kLo) {
      y = vmulq_f32(acc[b], unit);
    }
    alignas(16) float lanes[kIntCols];
    vst1q_f32(lanes, y);
    std::memcpy(out + (r0 + b) * out_dim + o, lanes, n * sizeof(float));
  }
}

// ExactIntTile with SDOT: compiled for the dotprod target, with the tile's helpers
// inlined into it (`flatten`), so SDOT runs in the loop while the template stays one.
template <Format kFmt, int kRows, bool kLo>
XLASERVE_SDOT_TARGET __attribute__((flatten)) void ExactIntTileSdot(
    const IntRows& r, int r0, int64_t groups, const uint8_t* codes, int64_t o, int n,
    const uint16_t* dcol, const uint16_t* mcol, float* out, int64_t out_dim) {
  ExactIntTile<kFmt, kRows, kLo, true>(r, r0, groups, codes, o, n, dcol, mcol, out, out_dim);
}

// Output columns [o0, o1) of nibbles or Q8_0 codes for rows [r0, r1) of `r`
// (neon::QuantizeRows; `lo`: its 16-bit rounding, else its 8-bit one), in blocks of
// 4 columns x tiles of up to kNeonTileRows rows; SDOT where r.sdot.
template <Format kFmt>
void IntColumns(const IntRows& r, bool lo, int r0, int r1, int64_t in, const uint8_t* codes,
                const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
                int64_t o0, int64_t o1) {
  static_assert(kFmt == kQ4_1 || kFmt == kQ4_0 || kFmt == kS8);
  const int64_t groups = in / kGroup;
  ForIntColumnTiles<kFmt, kIntCols, kNeonTileRows>(
      r0, r1, in, scale, offset, o0, o1, ColumnHalves,
      [&](auto rows, int b, int64_t o, int n, const uint16_t* dcol, const uint16_t* mcol) {
        WithFlag(lo, [&](auto lo16) {
          constexpr int kRows = decltype(rows)::value;
          constexpr bool kLo = decltype(lo16)::value;
          if (r.sdot) {
            ExactIntTileSdot<kFmt, kRows, kLo>(r, b, groups, codes, o, n, dcol, mcol, out,
                                               out_dim);
          } else {
            ExactIntTile<kFmt, kRows, kLo, false>(r, b, groups, codes, o, n, dcol, mcol, out,
                                                  out_dim);
          }
        });
      });
}

}  // namespace neon
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_DOT_NEON_H_
