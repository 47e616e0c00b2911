// Quantized weights x integer activations, block-exact (AVX-512): the integer
// tiles behind the matvec custom calls (matvec.cc) and the fused decoder
// (decoder.cc), for Q8_0 (signed bytes), Q4_0 and Q4_1 (nibbles) and the GGUF
// K-quants Q4_K, Q5_K, Q6_K (IntWeight; the codes as stored, kquant_dot.h).
//
// Numerics, the same for every row count and every path (VNNI or AMX): for each
// activation row b, output column o and group g of 32 inputs, the integer dot
// product of the weight codes with the row's rounded activations (quant_dot.h
// `QuantizeRowRange`) is exact in int32:
//   a8:  isum = sum_i w_i * hi_i,
//   a16: isum = sum_i w_i * (256 * hi_i + lo_i)   (|isum| <= 32 * 128 * 32639 < 2^31),
// with w = the Q8_0 code, or the Q4_0 nibble - 8, or the Q4_1 nibble. Then one
// float32 epilogue, sequential over the groups:
//   acc = fma(float(isum_g), dx_g * d_g, acc)       (g = 0, 1, ...; acc from 0)
//   mins = fma(m_g, xsum_g, mins)                   (Q4_1 only; xsum: IntRows xsum8/16)
//   y = acc * unit  (Q4_1: fma(acc, unit, mins)),   unit = 1/256 for a16, 1 for a8,
// dx_g the row's group scale (IntRows dx_group), d_g and m_g the column's float16
// scale and min. K-quants: Q4_K and Q5_K exactly as Q4_1, with w the code (0..15,
// 0..31), d_g = d * the group's scale code and m_g = -dmin * its min code (float32
// products, `KColumnValues`); Q6_K per 16 inputs h = 0, 1 of each group, w = code - 32
// (the sums of the unsigned codes less 32 x the rounded inputs' sum, IntRows
// xint8_half / xint16_half), two steps a group:
//   acc = fma(float(isum_g,h), dx_g * d_g,h, acc)   (h = 0, 1; d_g,h = d * its int8 code)
// and no min (|isum| <= 16 * 63 * 32767 + 32 * 16 * 32767 < 2^31).
// How the integers are formed does not matter (they are exact), so:
//  - `ExactIntTile` (VNNI): per pair of groups, one VPDPBUSD per column gives 16
//    int32 lanes of 4-product sums (quant_dot.h DotBytes layouts); 16 columns' lanes
//    are reduced in integers (`ReduceBlocks`) to one lane per column and group, and
//    the epilogue runs on 16 columns at once;
//  - `AmxTile8` / `AmxTile16` (AMX-INT8, `AmxFormat`; Q6_K, column-tiled only, a product
//    per 16 inputs: `AmxTileHalves`): the codes of 16 columns as signed bytes in the
//    TDPBSSD B-tile layout (packed once per call from the stored rows, `PackColumns` /
//    `PackColumnsUnsigned`; from the column-tiled layout a group's chunk vectors as
//    they are, Q8_0's codes read in place), the rows once per rounding into A tiles
//    (quant_dot.h QuantizeRowRange, IntRows amx_a), and every 16-row tile of
//    activations meets them, one 16 x 16 int32 product per group (two for a16: hi and
//    lo bytes), stored and taken through the same epilogue.
// Each output is thus bitwise the same whatever the other rows of the call, whether
// AMX runs or not (`AmxEnabled`, XLASERVE_NATIVE_AMX=0 turns it off), and in the
// decoder as in the matvec.

#ifndef XLASERVE_KERNELS_CPU_QUANT_INT_H_
#define XLASERVE_KERNELS_CPU_QUANT_INT_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kquant_dot.h"
#include "quant_dot.h"

namespace xlaserve {

// Whether format f's integer epilogue has a min term (Q4_1, Q4_K, Q5_K). (The offsets
// the codes carry in the integer sums, Q4_0's -8, Q6_K's -32 per 16 inputs and Q8_0's
// +128 (VPDPBUSD takes unsigned codes), come back in `GroupEpilogue`, `ExactIntTile`
// and `PackedIntTile`.)
constexpr bool IntMin(Format f) { return f == kQ4_1 || f == kQ4_K || f == kQ5_K; }
// Q6_K's scales are per 16 inputs: two per group of 32 (dcol [groups * 2][16]).
constexpr int ScalesPerGroup(Format f) { return f == kQ6_K ? 2 : 1; }

// Sums each 128-bit lane of 16 columns' dot lanes (dot[c]: 16 int32 lanes of column c
// for a pair of groups): 128-bit lane L of s2[k] holds the sums of lanes 4L..4L+3 of
// columns 4k..4k+3. Integer adds: exact in any order.
__attribute__((target("avx512f"), always_inline)) inline void LaneQuarterSums(
    const __m512i* dot, __m512i* s2) {
  __m512i s1[8];
  for (int k = 0; k < 8; ++k) {  // per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3]
    s1[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(dot[2 * k], dot[2 * k + 1]),
                             _mm512_unpackhi_epi32(dot[2 * k], dot[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {  // per 128 bits: columns 4k .. 4k + 3
    s2[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * k], s1[2 * k + 1]),
                             _mm512_unpackhi_epi64(s1[2 * k], s1[2 * k + 1]));
  }
}

// Reduces 16 columns' dot lanes to one lane per column: *even = group 2p of columns
// 0-15, *odd = 2p + 1. kNibble: lanes 0-3 and 8-11 hold group 2p (quant_dot.h nibble
// order), else lanes 0-7 (input order).
template <bool kNibble>
__attribute__((target("avx512f"))) inline void ReduceBlocks(const __m512i* dot, __m512i* even,
                                                            __m512i* odd) {
  __m512i s2[4];
  LaneQuarterSums(dot, s2);
  // 128-bit lanes of s2[k]: nibble order [g, g', g, g'], input order [g, g, g', g'].
  constexpr int kA = kNibble ? 0x44 : 0x88, kB = kNibble ? 0xEE : 0xDD;
  const __m512i v = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[0], s2[1], kA),
                                     _mm512_shuffle_i32x4(s2[0], s2[1], kB));
  const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2], s2[3], kA),
                                     _mm512_shuffle_i32x4(s2[2], s2[3], kB));
  *even = _mm512_shuffle_i32x4(v, w, 0x88);
  *odd = _mm512_shuffle_i32x4(v, w, 0xDD);
}

// Transposes 16 x 16 floats in registers: v[i][j] becomes v[j][i].
__attribute__((target("avx512f"), always_inline)) inline void Transpose16(__m512* v) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // per 128 bits: [r0[k], r1[k], r0[k+1], r1[k+1]]
    a[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + k], 128-bit lane L: rows 4i..4i+3 at column 4L + k
    const __m512d x0 = _mm512_castps_pd(a[4 * i]), x1 = _mm512_castps_pd(a[4 * i + 1]);
    const __m512d x2 = _mm512_castps_pd(a[4 * i + 2]), x3 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(x0, x2));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x0, x2));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(x1, x3));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(x1, x3));
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of b[k], b[4 + k], b[8 + k], b[12 + k]
    const __m512 c0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x44);
    const __m512 c1 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xEE);
    const __m512 d0 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x44);
    const __m512 d1 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xEE);
    v[k] = _mm512_shuffle_f32x4(c0, d0, 0x88);
    v[4 + k] = _mm512_shuffle_f32x4(c0, d0, 0xDD);
    v[8 + k] = _mm512_shuffle_f32x4(c1, d1, 0x88);
    v[12 + k] = _mm512_shuffle_f32x4(c1, d1, 0xDD);
  }
}

// The float16 values (scales or mins, [O, groups]) of columns [o, o + n), n <= 16, as
// floats [groups][16] (zero past n): 16 groups of 16 columns at a time, loaded along
// each column's row and transposed in registers (a gather per pair of groups was a
// sixth of a 1B model's decode step on AMD Zen 4).
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void ColumnValues(
    const uint16_t* values, int64_t groups, int64_t o, int n, float* dst) {
  for (int64_t g = 0; g < groups; g += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, groups - g));
    const __mmask16 in_row = static_cast<__mmask16>((1u << m) - 1);
    __m512 v[16];
    for (int c = 0; c < 16; ++c) {
      const uint16_t* row = values + (o + c) * groups + g;
      v[c] = c < n ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in_row, row)) : _mm512_setzero_ps();
    }
    Transpose16(v);
    for (int j = 0; j < m; ++j) _mm512_storeu_ps(dst + (g + j) * 16, v[j]);
  }
}

// A K-quant's float scales (and mins) of columns [o, o + n), n <= 16, as [values][16]
// (zero past n): the super-block's d times each sub-block's scale code (Q4_K / Q5_K:
// one per group of 32, and -dmin times each min code; Q6_K: one per 16 inputs). The
// super-blocks' values once per call as [supers][16] (ColumnValues); the codes 16 at a
// time, widened along each column's row, transposed in registers, then converted and
// multiplied 16 columns at once.
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline void KColumnValues(
    const IntWeight& w, int64_t o, int n, float* dcol, float* mcol) {
  constexpr int64_t kPerSuper = kFmt == kQ6_K ? 16 : 8;
  constexpr int kArrays = kFmt == kQ6_K ? 1 : 2;  // scales (and mins)
  const int64_t supers = w.in / kSuper, values = supers * kPerSuper;
  thread_local std::vector<float> super_values[2];  // [supers][16] each
  const uint8_t* codes[2] = {w.k.scale, w.k.offset};
  const uint16_t* super[2] = {w.k.super_scale, w.k.super_offset};
  float* dst[2] = {dcol, mcol};
  for (int a = 0; a < kArrays; ++a) {
    super_values[a].resize(supers * 16);
    ColumnValues(super[a], supers, o, n, super_values[a].data());
  }
  for (int64_t v = 0; v < values; v += 16) {
    const int count = static_cast<int>(std::min<int64_t>(16, values - v));
    const __mmask16 in_row = static_cast<__mmask16>((1u << count) - 1);
    for (int a = 0; a < kArrays; ++a) {
      __m512 t[16];
      for (int c = 0; c < 16; ++c) {
        __m512i wide = _mm512_setzero_si512();
        if (c < n) {
          const __m128i b = _mm_maskz_loadu_epi8(in_row, codes[a] + (o + c) * values + v);
          wide = kFmt == kQ6_K ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
        }
        t[c] = _mm512_castsi512_ps(wide);
      }
      Transpose16(t);  // t[j]: code v + j of the 16 columns
      for (int j = 0; j < count; ++j) {
        const float* d = super_values[a].data() + (v + j) / kPerSuper * 16;
        _mm512_storeu_ps(dst[a] + (v + j) * 16,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(t[j])),
                                       _mm512_loadu_ps(d)));
      }
    }
  }
}

// Columns [o, o + n)'s scales and mins as [values][16] (ColumnValues, KColumnValues).
template <Format kFmt>
inline void IntColumnValues(const IntWeight& w, int64_t o, int n, float* dcol, float* mcol) {
  if constexpr (IsKQuant(kFmt)) {
    KColumnValues<kFmt>(w, o, n, dcol, mcol);
  } else {
    const int64_t groups = w.in / kGroup;
    ColumnValues(w.scale, groups, o, n, dcol);
    if constexpr (IntMin(kFmt)) ColumnValues(w.offset, groups, o, n, mcol);
  }
}

// Reduces 16 columns' Q6_K dot lanes (nibble order) to one lane per column and 16
// inputs: q[0] group 2p inputs 0-15, q[1] 2p + 1 inputs 0-15, q[2] 2p inputs 16-31,
// q[3] 2p + 1 inputs 16-31 (lanes 0-3, 4-7, 8-11, 12-15). Integer adds: exact.
__attribute__((target("avx512f"))) inline void ReduceQuarters(const __m512i* dot, __m512i* q) {
  __m512i s2[4];  // 128-bit lane L: quarter L of columns 4k..4k+3
  LaneQuarterSums(dot, s2);
  const __m512i a = _mm512_shuffle_i32x4(s2[0], s2[1], 0x44), b = _mm512_shuffle_i32x4(s2[2], s2[3], 0x44);
  const __m512i c = _mm512_shuffle_i32x4(s2[0], s2[1], 0xEE), d = _mm512_shuffle_i32x4(s2[2], s2[3], 0xEE);
  q[0] = _mm512_shuffle_i32x4(a, b, 0x88);
  q[1] = _mm512_shuffle_i32x4(a, b, 0xDD);
  q[2] = _mm512_shuffle_i32x4(c, d, 0x88);
  q[3] = _mm512_shuffle_i32x4(c, d, 0xDD);
}

// The final value of 16 columns from the epilogue's accumulators (module comment).
template <bool kMin, bool kLo>
__attribute__((target("avx512f,fma"))) inline __m512 Finish(__m512 acc, __m512 mins) {
  const __m512 unit = _mm512_set1_ps(kLo ? 1.0f / 256.0f : 1.0f);
  if constexpr (kMin) return _mm512_fmadd_ps(acc, unit, mins);
  if constexpr (kLo) return _mm512_mul_ps(acc, unit);
  return acc;
}

// The rounded rows' arrays a VNNI tile of format kFmt reads (kLo: the 16-bit rounding):
// group scales, integer and float group sums (Q6_K: integer sums per 16 inputs), hi
// and lo bytes (nibble order, or kPlain: input order; Q8_0's tiles and the column-tiled
// layout's read input order).
template <Format kFmt, bool kLo, bool kPlain = kFmt == kS8>
struct RowOperands {
  explicit RowOperands(const IntRows& r)
      : dx(r.dx_group.data()),
        xint(kFmt == kQ6_K ? (kLo ? r.xint16_half : r.xint8_half).data()
                           : (kLo ? r.xint16 : r.xint8).data()),
        xsum(IntMin(kFmt) ? (kLo ? r.xsum16 : r.xsum8).data() : nullptr),
        his(!kPlain ? r.hi.data() : r.hi_plain.data()),
        los(kLo ? (!kPlain ? r.lo.data() : r.lo_plain.data()) : nullptr) {}
  const float* dx;
  const int32_t* xint;  // [rows, groups] (Q6_K: [rows, groups * 2])
  const float* xsum;
  const int8_t* his;
  const int8_t* los;
};

// One group's epilogue for 16 columns (module comment): isum the group's exact sums
// (Q6_K: isum[0] / isum[1] its two halves, before the -32 offset), `at` the row's
// group index, d the columns' scales at the group (Q6_K: two rows of 16), m the mins.
template <Format kFmt, bool kLo, bool kPlain>
__attribute__((target("avx512f,fma"), always_inline)) inline void GroupEpilogue(
    const RowOperands<kFmt, kLo, kPlain>& x, const __m512i* isum, int64_t at, const float* d,
    const float* m, __m512* acc, __m512* mins) {
  const __m512 dx = _mm512_set1_ps(x.dx[at]);
  if constexpr (kFmt == kQ6_K) {
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_sub_epi32(isum[h], _mm512_set1_epi32(32 * x.xint[2 * at + h]));
      *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(_mm512_loadu_ps(d + 16 * h), dx),
                             *acc);
    }
  } else {
    __m512i v = isum[0];
    if constexpr (kFmt == kQ4_0) v = _mm512_sub_epi32(v, _mm512_set1_epi32(8 * x.xint[at]));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(_mm512_loadu_ps(d), dx), *acc);
    if constexpr (IntMin(kFmt)) {
      *mins = _mm512_fmadd_ps(_mm512_loadu_ps(m), _mm512_set1_ps(x.xsum[at]), *mins);
    }
  }
}

// The contiguous byte ranges a tile's columns read besides their codes (their rows of
// scales and mins; a K-quant's scale and min codes and super-block values), for the
// tile before it to prefetch.
struct AheadSpans {
  const char* at[4] = {};
  int64_t bytes[4] = {};
  int count = 0;
  void Add(const void* p, int64_t n) {
    at[count] = static_cast<const char*>(p);
    bytes[count++] = n;
  }
  int64_t Lines() const {
    int64_t n = 0;
    for (int i = 0; i < count; ++i) n += (bytes[i] + 63) / 64;
    return n;
  }
  // Prefetches line `line` of the spans laid end to end into L2 (nothing past them).
  void Prefetch(int64_t line) const {
    int64_t byte = line * 64;
    for (int i = 0; i < count; ++i) {
      if (byte < bytes[i]) {
        _mm_prefetch(at[i] + byte, _MM_HINT_T1);
        return;
      }
      byte -= bytes[i];
    }
  }
};

// The spans of columns [o, o + n) of `w` (AheadSpans).
template <Format kFmt>
inline AheadSpans ColumnSpans(const IntWeight& w, int64_t o, int n) {
  AheadSpans s;
  if constexpr (IsKQuant(kFmt)) {
    const int64_t values = KScaleCount(kFmt, w.in), supers = w.in / kSuper;
    s.Add(w.k.scale + o * values, n * values);
    s.Add(w.k.super_scale + o * supers, n * supers * 2);
    if constexpr (kFmt != kQ6_K) {
      s.Add(w.k.offset + o * values, n * values);
      s.Add(w.k.super_offset + o * supers, n * supers * 2);
    }
  } else {
    const int64_t groups = w.in / kGroup;
    s.Add(w.scale + o * groups, n * groups * 2);
    if constexpr (IntMin(kFmt)) s.Add(w.offset + o * groups, n * groups * 2);
  }
  return s;
}

// Columns [o, o + n) (n <= 16) x rows [r0, r0 + kRows) of `r` with VNNI: the
// module comment's numerics. dcol / mcol: the columns' scales / mins (IntColumnValues).
// `ahead` (0..16): columns [o + 16, o + 16 + ahead) are the caller's next tile; their
// codes (and a K-quant's high bits) are prefetched into L2 at the pace this tile reads
// its own (one line per column as each of this tile's columns crosses a line), and
// `ahead_spans` (the next tile's ColumnSpans, or null) two lines a pair, so the next
// tile's 16 row streams do not start with cache misses (at one row the tile waits on
// memory, not on the dot products).
template <Format kFmt, int kRows, bool kLo>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) void ExactIntTile(
    const IntRows& r, int r0, const IntWeight& wt, int64_t o, int n, const float* dcol,
    const float* mcol, float* out, int64_t out_dim, int ahead = 0,
    const AheadSpans* ahead_spans = nullptr) {
  constexpr bool kNibble = kFmt != kS8;
  constexpr int kPer = ScalesPerGroup(kFmt);
  constexpr int64_t kPairBytes = kNibble ? 32 : 64;  // one column's codes of a pair
  constexpr int64_t kHighPairBytes = kFmt == kQ5_K ? 8 : kFmt == kQ6_K ? 16 : 0;
  const int64_t groups = wt.in / kGroup, pairs = groups / 2;
  const int64_t row_bytes = pairs * kPairBytes;
  const uint8_t* codes = IsKQuant(kFmt) ? wt.k.q : wt.codes;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i bias = _mm512_set1_epi8(-128);
  const RowOperands<kFmt, kLo> x(r);
  KWeight krow[IsKQuant(kFmt) ? 16 : 1];
  if constexpr (IsKQuant(kFmt)) {
    for (int c = 0; c < n; ++c) krow[c] = KRow<kFmt>(wt.k, wt.in, o + c);
  }
  __m512 acc[kRows], mins[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = mins[b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if ((p * kPairBytes) % 64 == 0) {
      for (int c = 0; c < ahead; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + (o + 16 + c) * row_bytes +
                                                   p * kPairBytes),
                     _MM_HINT_T1);
      }
    }
    if constexpr (kHighPairBytes > 0) {
      if ((p * kHighPairBytes) % 64 == 0) {
        for (int c = 0; c < ahead; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(wt.k.q_high + (o + 16 + c) * pairs *
                                                     kHighPairBytes + p * kHighPairBytes),
                       _MM_HINT_T1);
        }
      }
    }
    if (ahead_spans != nullptr) {  // the next tile's scale bytes
      ahead_spans->Prefetch(2 * p);
      ahead_spans->Prefetch(2 * p + 1);
    }
    __m512i w[16];
    for (int c = 0; c < 16; ++c) {
      w[c] = _mm512_setzero_si512();
      if (c >= n) continue;
      if constexpr (IsKQuant(kFmt)) {
        w[c] = KPairCodes<kFmt>(krow[c], p);
      } else if constexpr (kNibble) {
        const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(codes + (o + c) * row_bytes + p * 32)));
        w[c] = _mm512_and_si512(
            _mm512_inserti64x4(y, _mm512_castsi512_si256(_mm512_srli_epi16(y, 4)), 1), nib);
      } else {
        w[c] = _mm512_xor_si512(_mm512_loadu_si512(codes + (o + c) * row_bytes + p * 64),
                                bias);  // code + 128
      }
    }
    for (int b = 0; b < kRows; ++b) {
      const int64_t row = (r0 + b) * pairs + p;
      const __m512i xb = _mm512_loadu_si512(x.his + row * 64);
      const __m512i xl = kLo ? _mm512_loadu_si512(x.los + row * 64) : _mm512_setzero_si512();
      __m512i dot[16];
      for (int c = 0; c < 16; ++c) dot[c] = DotBytes<kLo>(w[c], xb, xl);
      // The pair's two groups' sums, column by lane (Q6_K: per 16 inputs).
      __m512i e[2], f[2];
      if constexpr (kFmt == kQ6_K) {
        __m512i q[4];
        ReduceQuarters(dot, q);
        e[0] = q[0], e[1] = q[2], f[0] = q[1], f[1] = q[3];
      } else {
        ReduceBlocks<kNibble>(dot, &e[0], &f[0]);
      }
      const int64_t at = (r0 + b) * groups + 2 * p;
      if constexpr (kFmt == kS8) {  // sum (c + 128) x - 128 sum x
        e[0] = _mm512_sub_epi32(e[0], _mm512_set1_epi32(128 * x.xint[at]));
        f[0] = _mm512_sub_epi32(f[0], _mm512_set1_epi32(128 * x.xint[at + 1]));
      }
      GroupEpilogue<kFmt, kLo>(x, e, at, dcol + 2 * p * kPer * 16, mcol + 2 * p * 16, &acc[b],
                               &mins[b]);
      GroupEpilogue<kFmt, kLo>(x, f, at + 1, dcol + (2 * p + 1) * kPer * 16,
                               mcol + (2 * p + 1) * 16, &acc[b], &mins[b]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  for (int b = 0; b < kRows; ++b) {
    _mm512_mask_storeu_ps(out + (r0 + b) * out_dim + o, mask,
                          Finish<IntMin(kFmt), kLo>(acc[b], mins[b]));
  }
}

// ---- AMX-INT8 ----
//
// Tiles: tmm0 / tmm1 activations (16 rows x 32 bytes: one group of 16 rows, or for
// a16 the hi bytes of 8 rows above their lo bytes), tmm2 / tmm7 codes (8 rows x 64
// bytes: 32 inputs x 16 columns, 4 bytes a column a row), tmm3-tmm6 products (16 x 16
// int32): `AmxTile8` keeps four groups' products in flight, `AmxTile16` two groups' pairs.
// The instructions are written as inline assembly with memory clobbers (so the
// compiler orders them against the buffers' plain loads and stores).

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles' shapes: A tiles tmm0 / tmm1 of 16 rows x 32 bytes (a group), B tiles tmm2 /
// tmm7 of 8 rows x 64 bytes (its 8 chunks of 16 columns), products 16 x 16 int32. `halves`:
// Q6_K's (`AmxTileHalves`), whose products are per 16 inputs: A tiles of half a group (16
// rows x 16 bytes, read at the A tiles' 32-byte row stride), B tiles of its 4 chunks.
inline void AmxConfigure(bool halves = false) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const bool a = t < 2, b = t == 2 || t == 7;
    cfg.rows[t] = b ? (halves ? 4 : 8) : 16;
    cfg.colsb[t] = a ? (halves ? 16 : 32) : 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

inline void AmxRelease() { asm volatile("tilerelease" ::: "memory"); }

#define XLASERVE_TILE_ZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define XLASERVE_TILE_LOAD(t, base, stride)                                    \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<long>(stride)) \
               : "memory")
#define XLASERVE_TILE_STORE(t, base, stride)                                    \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base),                 \
               "r"(static_cast<long>(stride))                                   \
               : "memory")
#define XLASERVE_TILE_DPBSSD(c, a, b) \
  asm volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

// Packs the codes of columns [o, o + 16) as signed bytes (Q8_0: the codes; Q4_0: the
// nibbles - 8; Q4_1: the nibbles) into B tiles, b[g][k][4 n + j] = w[o + n][g][4 k + j]
// (groups x 512 bytes).
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void PackColumns(const uint8_t* codes,
                                                                       int64_t groups,
                                                                       int64_t o, int8_t* b) {
  alignas(64) int8_t tmp[16][32];
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(8));
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    for (int n = 0; n < 16; ++n) {
      if constexpr (kFmt == kS8) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp[n]),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                               codes + ((o + n) * groups + g) * kGroup)));
      } else {
        const __m128i q =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + ((o + n) * groups + g) * 16));
        __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
        if constexpr (kFmt == kQ4_0) {
          lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
          hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
        }
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp[n]), lo);
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp[n] + 16), hi);
      }
    }
    for (int k = 0; k < 8; ++k) {
      _mm512_storeu_si512(b + g * 512 + k * 64, _mm512_i32gather_epi32(idx, tmp[0] + 4 * k, 4));
    }
  }
}

// One group's stored products c (16 tile rows x 16 columns) into the accumulators of
// kAct activation rows: the epilogue of the module comment (a8: tile row i is row i;
// a16: tile rows i and 8 + i are row i's hi and lo products). dg: the columns'
// scales, dx[i]: row i's group scale.
template <bool kLo>
__attribute__((target("avx512f,fma"), always_inline)) inline void AmxEpilogue(
    const int32_t (*c)[16], const float* dg, const float* dx, __m512* acc) {
  constexpr int kAct = kLo ? 8 : 16;
  const __m512 d = _mm512_loadu_ps(dg);
  for (int i = 0; i < kAct; ++i) {
    __m512i v = _mm512_load_si512(c[i]);
    if constexpr (kLo) v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), _mm512_load_si512(c[8 + i]));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(d, _mm512_set1_ps(dx[i])),
                             acc[i]);
  }
}

// The 16 rows' [r0, r0 + 16) accumulators of an AMX tile (columns [o, o + 16)) through
// the epilogue's end: the min term over the groups (Q4_1, Q4_K, Q5_K), the unit, into
// `out`. The min sums run 8 rows at a time, the groups outermost: 8 independent fma
// chains instead of one (a row alone waited on each fma's latency: a fifth of a
// Q4_K_M step at 16 rows), each row's sum still in group order.
template <Format kFmt, bool kLo>
__attribute__((target("avx512f,fma"), always_inline)) inline void AmxFinish(
    const IntRows& r, int r0, int64_t groups, const float* mcol, const __m512* acc, float* out,
    int64_t out_dim, int64_t o) {
  constexpr bool kMin = IntMin(kFmt);
  constexpr int kBlock = 8;
  const float* xsum = kMin ? (kLo ? r.xsum16 : r.xsum8).data() + r0 * groups : nullptr;
  for (int i0 = 0; i0 < 16; i0 += kBlock) {
    __m512 mins[kBlock];
    for (int i = 0; i < kBlock; ++i) mins[i] = _mm512_setzero_ps();
    if constexpr (kMin) {
      for (int64_t g = 0; g < groups; ++g) {
        const __m512 m = _mm512_loadu_ps(mcol + g * 16);
        for (int i = 0; i < kBlock; ++i) {
          mins[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[(i0 + i) * groups + g]), mins[i]);
        }
      }
    }
    for (int i = 0; i < kBlock; ++i) {
      _mm512_storeu_ps(out + (r0 + i0 + i) * out_dim + o,
                       Finish<kMin, kLo>(acc[i0 + i], mins[i]));
    }
  }
}

// The AMX tiles' B tiles, group g's at At(g) once Prepare(g) ran (the tiles prepare one
// group ahead of their products): `AmxBTiles` all laid out before (groups x 512 bytes);
// `AmxBRing` (below TiledColumns) a column tile's unpacked a group at a time.
struct AmxBTiles {
  const int8_t* b;
  const int8_t* At(int64_t g) const { return b + g * 512; }
  void Prepare(int64_t) const {}
};

// Columns [o, o + 16) x rows [r0, r0 + 16) of `r`'s 8-bit rounding with AMX: a the
// rows' A tiles (IntRows amx_a), dxt their scales (amx_dx), b the columns' B tiles
// (groups x 512 bytes), dcol / mcol their values as [groups][16] (IntColumnValues).
// Needs AmxConfigure() on this thread.
// Tile sets (A, B, C) alternate between groups (tmm0, tmm2, tmm3 and tmm1, tmm7, tmm4),
// so a group's loads and product do not wait for the previous group's.
template <Format kFmt, class B>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void AmxTile8(
    const IntRows& r, int r0, int64_t groups, const int8_t* a, const float* dxt,
    const B& b, const float* dcol, const float* mcol, float* out, int64_t out_dim,
    int64_t o) {
  constexpr int64_t kStep = 512;  // amx_a's bytes a group
  alignas(64) int32_t c[4][16][16];
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // Software pipeline over four product tiles: group g's product goes to tmm3 + g % 4
  // (A and B tiles alternate, tmm0 / tmm1 and tmm2 / tmm7), is stored a step later
  // and scaled three steps later (a tile store is not forwarded to vector loads), so
  // the tile unit always has independent products under way.
#define XLASERVE_AMX_ISSUE(g, ta, tb, tc)              \
  do {                                                 \
    XLASERVE_TILE_ZERO(tc);                            \
    XLASERVE_TILE_LOAD(ta, a + (g) * kStep, kGroup);   \
    XLASERVE_TILE_LOAD(tb, b.At(g), 64);               \
    XLASERVE_TILE_DPBSSD(tc, ta, tb);                  \
  } while (0)
  auto issue = [&](int64_t g) {
    switch (g % 4) {
      case 0: XLASERVE_AMX_ISSUE(g, 0, 2, 3); break;
      case 1: XLASERVE_AMX_ISSUE(g, 1, 7, 4); break;
      case 2: XLASERVE_AMX_ISSUE(g, 0, 2, 5); break;
      default: XLASERVE_AMX_ISSUE(g, 1, 7, 6); break;
    }
  };
  auto store = [&](int64_t g) {
    switch (g % 4) {
      case 0: XLASERVE_TILE_STORE(3, c[0], 64); break;
      case 1: XLASERVE_TILE_STORE(4, c[1], 64); break;
      case 2: XLASERVE_TILE_STORE(5, c[2], 64); break;
      default: XLASERVE_TILE_STORE(6, c[3], 64); break;
    }
  };
#undef XLASERVE_AMX_ISSUE
  b.Prepare(0);
  for (int64_t g = 0; g < groups + 3; ++g) {
    if (g + 1 < groups) b.Prepare(g + 1);
    if (g < groups) issue(g);
    if (g >= 1 && g - 1 < groups) store(g - 1);
    if (g >= 3) AmxEpilogue<false>(c[(g - 3) % 4], dcol + (g - 3) * 16, dxt + (g - 3) * 16, acc);
  }
  AmxFinish<kFmt, false>(r, r0, groups, mcol, acc, out, out_dim, o);
}

// Columns [o, o + 16) x rows [r0, r0 + 16) of `r`'s 16-bit rounding with AMX: AmxTile8's
// operands, two products a group (rows 0-7's hi and lo bytes, rows 8-15's) sharing the
// group's B tile (one B load for both: ~10% faster than a pass per half). a: the tile's
// A tiles (amx_a), dxt its scales (amx_dx). Tiles: A tmm0 / tmm1 (rows 0-7 / 8-15), B
// tmm2 / tmm7 (alternating groups), products tmm3 + tmm4 / tmm5 + tmm6 (alternating
// groups), stored a group later and scaled two groups later.
template <Format kFmt, class B>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void AmxTile16(
    const IntRows& r, int r0, int64_t groups, const int8_t* a, const float* dxt,
    const B& b, const float* dcol, const float* mcol, float* out, int64_t out_dim,
    int64_t o) {
  alignas(64) int32_t c[2][2][16][16];  // [group % 2][half][tile row][column]
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // Group g's two products into (c0, c1) from B tile tb (tile numbers: asm constants).
#define XLASERVE_AMX_ISSUE_PAIR(g, tb, c0, c1)          \
  do {                                                  \
    XLASERVE_TILE_ZERO(c0);                             \
    XLASERVE_TILE_ZERO(c1);                             \
    XLASERVE_TILE_LOAD(tb, b.At(g), 64);                \
    XLASERVE_TILE_LOAD(0, a + (g) * 1024, kGroup);      \
    XLASERVE_TILE_DPBSSD(c0, 0, tb);                    \
    XLASERVE_TILE_LOAD(1, a + (g) * 1024 + 512, kGroup); \
    XLASERVE_TILE_DPBSSD(c1, 1, tb);                    \
  } while (0)
  auto issue = [&](int64_t g) {
    if (g % 2 == 0) {
      XLASERVE_AMX_ISSUE_PAIR(g, 2, 3, 4);
    } else {
      XLASERVE_AMX_ISSUE_PAIR(g, 7, 5, 6);
    }
  };
#undef XLASERVE_AMX_ISSUE_PAIR
  auto store = [&](int64_t g) {
    if (g % 2 == 0) {
      XLASERVE_TILE_STORE(3, c[0][0], 64);
      XLASERVE_TILE_STORE(4, c[0][1], 64);
    } else {
      XLASERVE_TILE_STORE(5, c[1][0], 64);
      XLASERVE_TILE_STORE(6, c[1][1], 64);
    }
  };
  b.Prepare(0);
  for (int64_t g = 0; g < groups + 2; ++g) {
    if (g + 1 < groups) b.Prepare(g + 1);
    if (g < groups) issue(g);
    if (g >= 1 && g - 1 < groups) store(g - 1);
    if (g >= 2) {
      const int64_t e = g - 2;
      AmxEpilogue<true>(c[e % 2][0], dcol + e * 16, dxt + e * 16, acc);
      AmxEpilogue<true>(c[e % 2][1], dcol + e * 16, dxt + e * 16 + 8, acc + 8);
    }
  }
  AmxFinish<kFmt, true>(r, r0, groups, mcol, acc, out, out_dim, o);
}

// One Q6_K group's stored products c[h][t] (AmxTileHalves; the codes less 32, so the
// products are GroupEpilogue's isum_h - 32 x the half's rounded inputs' sum) into the
// 16 rows' accumulators: for h = 0, 1, acc = fma(float(isum_h), d_h x dx, acc). d: the
// group's two rows of 16 scales, dx[row] the rows' group scales.
template <bool kLo>
__attribute__((target("avx512f,fma"), always_inline)) inline void AmxEpilogueHalves(
    const int32_t (*c)[2][16][16], const float* d, const float* dx, __m512* acc) {
  const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
  for (int row = 0; row < 16; ++row) {
    const int t = kLo ? row / 8 : 0, i = kLo ? row % 8 : row;  // the 8-row half, its tile row
    const __m512 x = _mm512_set1_ps(dx[row]);
    for (int h = 0; h < 2; ++h) {
      __m512i v = _mm512_load_si512(c[h][t][i]);
      if constexpr (kLo) {
        v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), _mm512_load_si512(c[h][t][8 + i]));
      }
      acc[row] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(h ? d1 : d0, x), acc[row]);
    }
  }
}

// Columns [o, o + 16) x rows [r0, r0 + 16) of a column-tiled Q6_K weight with AMX
// (after AmxConfigure(true)): AmxTile8 / AmxTile16's operands (b: its B tiles, the chunk
// vectors of `TiledColumns::AmxOperands`, codes - 32; dcol: two rows of 16 scales a
// group), one product per 16-input half h and (a16) per 8-row half t of the tile: group
// g's products (tmm3 + t + 2h) are stored into c[g % 2] once issued (the previous
// group's epilogue runs meanwhile) and scaled as the VNNI tiles do.
template <bool kLo, class B>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void AmxTileHalves(
    int r0, int64_t groups, const int8_t* a, const float* dxt, const B& b,
    const float* dcol, float* out, int64_t out_dim, int64_t o) {
  constexpr int64_t kStep = kLo ? 1024 : 512;  // amx_a's bytes a group
  alignas(64) int32_t c[2][2][2][16][16];  // [group % 2][half h][8-row half t][row][column]
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  b.Prepare(0);
  for (int64_t g = 0; g < groups; ++g) {  // a group's tiles are free once stored
    if (g + 1 < groups) b.Prepare(g + 1);
    const int8_t* bg = b.At(g);
    const int8_t* ag = a + g * kStep;
    XLASERVE_TILE_ZERO(3);
    XLASERVE_TILE_ZERO(5);
    XLASERVE_TILE_LOAD(2, bg, 64);
    XLASERVE_TILE_LOAD(0, ag, kGroup);
    XLASERVE_TILE_DPBSSD(3, 0, 2);
    XLASERVE_TILE_LOAD(7, bg + 256, 64);
    XLASERVE_TILE_LOAD(1, ag + 16, kGroup);
    XLASERVE_TILE_DPBSSD(5, 1, 7);
    if constexpr (kLo) {  // rows 8-15
      XLASERVE_TILE_ZERO(4);
      XLASERVE_TILE_ZERO(6);
      XLASERVE_TILE_LOAD(0, ag + 512, kGroup);
      XLASERVE_TILE_DPBSSD(4, 0, 2);
      XLASERVE_TILE_LOAD(1, ag + 512 + 16, kGroup);
      XLASERVE_TILE_DPBSSD(6, 1, 7);
    }
    if (g >= 1) {
      AmxEpilogueHalves<kLo>(c[(g - 1) % 2], dcol + (g - 1) * 32, dxt + (g - 1) * 16, acc);
    }
    int32_t(*cg)[2][16][16] = c[g % 2];
    XLASERVE_TILE_STORE(3, cg[0][0], 64);
    XLASERVE_TILE_STORE(5, cg[1][0], 64);
    if constexpr (kLo) {
      XLASERVE_TILE_STORE(4, cg[0][1], 64);
      XLASERVE_TILE_STORE(6, cg[1][1], 64);
    }
  }
  AmxEpilogueHalves<kLo>(c[(groups - 1) % 2], dcol + (groups - 1) * 32, dxt + (groups - 1) * 16,
                         acc);
  for (int i = 0; i < 16; ++i) {
    _mm512_storeu_ps(out + (r0 + i) * out_dim + o, Finish<false, kLo>(acc[i], acc[i]));
  }
}

// ---- VNNI over packed columns (many rows, no AMX) ----
//
// The codes of 16 columns packed once per call as unsigned bytes in the AMX B layout,
// u[g][k][4 n + j] = w'[o + n][g][4 k + j] (w' = the Q4_0 / Q4_1 nibble, or the Q8_0
// code + 128), so one VPDPBUSD of u[g][k] with a row's 4 activation bytes 4k..4k+3
// broadcast adds those 4 products to each of the 16 columns' lanes: 8 of them give
// the group's sums, column by lane, with no reduction across lanes. The offsets come
// back exactly: sum (n - 8) x = sum n x - 8 xint (Q4_0), sum (c + 128) x - 128 xint
// (Q8_0; |sum| <= 32 * 255 * 32639 < 2^31). Same integers, same epilogue, so the same
// bits as ExactIntTile. Used for calls of kPackedRows rows or more where AMX does not
// run: packing costs a few tiles' work, and a tile of 8 rows then costs ~2.5x fewer
// instructions (per row and group: 8 VPDPBUSD, 16 with lo, instead of 8 / 16 plus the
// lane reduction and the codes' unpacking).
constexpr int kPackedRows = 16;

// The 32 codes of group g of column o as unsigned bytes in input order: the Q8_0 code
// + 128, the Q4_0 / Q4_1 / Q4_K nibble, the Q5_K nibble + 16 x its high bit, the Q6_K
// code (nibble + 16 x its two high bits; its two 16-input sub-blocks: byte j input j
// low, j + 8 high).
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,bmi2"))) inline __m256i GroupCodes(
    const IntWeight& w, int64_t o, int64_t g) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  if constexpr (kFmt == kS8) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                w.codes + (o * (w.in / kGroup) + g) * kGroup)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    const uint8_t* codes = IsKQuant(kFmt) ? w.k.q : w.codes;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + o * w.in / 2 + g * 16));
    const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
    if constexpr (kFmt == kQ6_K) {
      __m256i c = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
      uint64_t h;  // input i's two high bits at bits 2i, 2i + 1
      std::memcpy(&h, w.k.q_high + o * KHighBytes(kFmt, w.in) + g * 8, 8);
      c = _mm256_mask_add_epi8(c, static_cast<__mmask32>(_pext_u64(h, 0x5555555555555555ull)), c,
                               _mm256_set1_epi8(16));
      return _mm256_mask_add_epi8(c, static_cast<__mmask32>(_pext_u64(h, 0xAAAAAAAAAAAAAAAAull)),
                                  c, _mm256_set1_epi8(32));
    } else {
      __m256i c = _mm256_set_m128i(hi, lo);
      if constexpr (kFmt == kQ5_K) {
        uint32_t h;  // input i's fifth bit at bit i
        std::memcpy(&h, w.k.q_high + o * KHighBytes(kFmt, w.in) + g * 4, 4);
        c = _mm256_mask_add_epi8(c, h, c, _mm256_set1_epi8(16));
      }
      return c;
    }
  }
}

// Packs the codes of columns [o, o + n) (n <= 16; lanes past n get zeros) of `w`
// into `u` (groups x 512 bytes), the layout above: 16 rows of 8 dwords transposed.
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,bmi2"))) void PackColumnsUnsigned(
    const IntWeight& w, int64_t o, int n, uint8_t* u) {
  const int64_t groups = w.in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 v[16];
    for (int c = 0; c < 16; ++c) {
      const __m256i bytes = c < n ? GroupCodes<kFmt>(w, o + c, g) : _mm256_setzero_si256();
      v[c] = _mm512_castsi512_ps(_mm512_castsi256_si512(bytes));
    }
    Transpose16(v);  // v[k], k < 8: dword k (inputs 4k..4k+3) of the 16 columns
    for (int k = 0; k < 8; ++k) _mm512_storeu_ps(u + g * 512 + k * 64, v[k]);
  }
}

// Byte offset of inputs 4k..4k+3 of group g in a row of IntRows `hi` / `lo` (nibble
// order: quant_dot.h) or of `hi_plain` / `lo_plain` (input order).
template <bool kNibble>
inline int64_t ChunkOffset(int64_t g, int k) {
  if constexpr (!kNibble) return g * kGroup + 4 * k;
  const int64_t half = (g & 1) * 16;
  return (g / 2) * 64 + half + (k < 4 ? 4 * k : 32 + 4 * (k - 4));
}

// The sums of chunks [k0, k1) (4 inputs each) of one group of 16 packed columns `w`
// times a row's bytes `row` (hi or lo, ChunkOffset's order): column by lane.
template <bool kNibble, int k0 = 0, int k1 = 8>
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i GroupDots(
    const __m512i* w, const int8_t* row, int64_t g) {
  __m512i sums = _mm512_setzero_si512();
  for (int k = k0; k < k1; ++k) {
    int32_t x4;
    std::memcpy(&x4, row + ChunkOffset<kNibble>(g, k), 4);
    sums = _mm512_dpbusd_epi32(sums, w[k], _mm512_set1_epi32(x4));
  }
  return sums;
}

// Chunks [k0, k1) of a group's exact sums (hi, or 256 hi + lo) for one row.
template <bool kNibble, bool kLo, int k0 = 0, int k1 = 8>
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline __m512i RowGroupSums(
    const __m512i* w, const int8_t* hi, const int8_t* lo, int64_t g) {
  __m512i isum = GroupDots<kNibble, k0, k1>(w, hi, g);
  if constexpr (kLo) {
    isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 8), GroupDots<kNibble, k0, k1>(w, lo, g));
  }
  return isum;
}

// One column tile of a weight in the column-tiled layout (quant_format.h
// `IntWeight::tiled`), read a group at a time: `Group(g, w, d, m)` gives the 8 unsigned
// chunk vectors w[k] = inputs 4k..4k+3 of the 16 columns (as PackColumnsUnsigned lays
// them; Q6_K adds 16 x each input's two high bits from `high`, a byte per chunk per
// column, a chunk's four 2-bit values from the lowest bits up) and the group's scales
// `d` (Q6_K: two rows of 16, per 16 inputs) and mins `m` as floats: the float16 values,
// or a K-quant's codes times its super-block's d / -dmin (the products KColumnValues
// forms, float32). Codes, high bits and values are each one sequential stream through
// the tiles, prefetched ahead as the groups go (into the next tile where this one ends:
// the blocks are back to back); the values are read beside the codes, not in a pass of
// their own (which a Q4_K_M decode step spent a sixth of its time waiting on).
template <Format kFmt>
struct TiledColumns {
  static_assert(TiledFormat(kFmt));
  static constexpr int64_t kBytes = kFmt == kS8 ? 512 : 256;  // codes of a group
  static constexpr int64_t kAhead = 1024;  // bytes of codes ahead (2 and 4 KiB: alike)
  static constexpr int64_t kPerGroup = kFmt == kQ6_K ? 2 : 1;  // values a group
  static constexpr int64_t kGroupsPerSuper = kSuper / kGroup;  // K-quants

  TiledColumns(const IntWeight& w, int64_t o) {
    const int64_t groups = w.in / kGroup;
    if constexpr (IsKQuant(kFmt)) {
      const int64_t supers = w.in / kSuper;
      codes = w.k.q + o * groups * 16;
      high = kFmt == kQ6_K ? w.k.q_high + o * groups * 8 : nullptr;
      scale_codes = w.k.scale + o * groups * kPerGroup;
      min_codes = kFmt == kQ4_K ? w.k.offset + o * groups : nullptr;
      super_scale = w.k.super_scale + o * supers;
      super_min = kFmt == kQ4_K ? w.k.super_offset + o * supers : nullptr;
    } else {
      codes = w.codes + o * groups * GroupBytes(kFmt);
      scale = w.scale + o * groups;
      min = IntMin(kFmt) ? w.offset + o * groups : nullptr;
    }
  }

  __attribute__((target("avx512f,avx512bw,avx512vl,f16c"), always_inline)) void Group(
      int64_t g, __m512i* w, float* d, float* m) const {
    const uint8_t* at = codes + g * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(at + kAhead + line), _MM_HINT_T0);
    }
    if constexpr (kFmt == kS8) {
      for (int k = 0; k < 8; ++k) {
        w[k] = _mm512_xor_si512(_mm512_loadu_si512(at + k * 64), _mm512_set1_epi8(-128));
      }
    } else {
      const __m512i nib = _mm512_set1_epi8(0x0F);
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(at + k * 64);
        w[k] = _mm512_and_si512(v, nib);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    }
    if constexpr (kFmt == kQ6_K) {  // byte j of column c's dword: its input j's 2 bits x 16
      const uint8_t* h = high + g * 128;
      _mm_prefetch(reinterpret_cast<const char*>(h + 512), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(h + 512 + 64), _MM_HINT_T0);
      const __m512i two = _mm512_set1_epi32(0x03030303);
      for (int k = 0; k < 8; ++k) {
        const __m512i c = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k * 16)));
        const __m512i spread = _mm512_or_si512(
            _mm512_or_si512(c, _mm512_slli_epi32(c, 6)),
            _mm512_or_si512(_mm512_slli_epi32(c, 12), _mm512_slli_epi32(c, 18)));
        w[k] = _mm512_or_si512(w[k], _mm512_slli_epi32(_mm512_and_si512(spread, two), 4));
      }
    }
    if constexpr (IsKQuant(kFmt)) {
      if (g % 4 == 0) {  // a line of scale / min codes: 4 groups' (Q6_K: 2 groups')
        _mm_prefetch(reinterpret_cast<const char*>(scale_codes + (g + 16) * kPerGroup * 16),
                     _MM_HINT_T0);
        if constexpr (kFmt == kQ6_K) {
          _mm_prefetch(reinterpret_cast<const char*>(scale_codes + (g + 18) * 32), _MM_HINT_T0);
        } else {
          _mm_prefetch(reinterpret_cast<const char*>(min_codes + (g + 16) * 16), _MM_HINT_T0);
        }
      }
      const int64_t super = g / kGroupsPerSuper;  // its 16 values: half a line
      if (g % kGroupsPerSuper == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(super_scale + (super + 2) * 16), _MM_HINT_T0);
        if constexpr (kFmt == kQ4_K) {
          _mm_prefetch(reinterpret_cast<const char*>(super_min + (super + 2) * 16), _MM_HINT_T0);
        }
      }
      const __m512 ds = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(super_scale + super * 16)));
      for (int64_t v = 0; v < kPerGroup; ++v) {
        const __m128i b = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(scale_codes + (g * kPerGroup + v) * 16));
        const __m512i c = kFmt == kQ6_K ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
        _mm512_storeu_ps(d + v * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(c), ds));
      }
      if constexpr (kFmt == kQ4_K) {
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(super_min + super * 16)));
        const __m512i c = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(min_codes + g * 16)));
        _mm512_storeu_ps(m, _mm512_mul_ps(_mm512_cvtepi32_ps(c), dm));
      }
    } else {
      if (g % 2 == 0) {  // a line holds 2 groups' values
        _mm_prefetch(reinterpret_cast<const char*>(scale + (g + 16) * 16), _MM_HINT_T0);
        if constexpr (IntMin(kFmt)) {
          _mm_prefetch(reinterpret_cast<const char*>(min + (g + 16) * 16), _MM_HINT_T0);
        }
      }
      _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(
                              reinterpret_cast<const __m256i*>(scale + g * 16))));
      if constexpr (IntMin(kFmt)) {
        _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256(
                                reinterpret_cast<const __m256i*>(min + g * 16))));
      }
    }
  }

  // The tile's AMX operands (`AmxFormat`): its codes as signed bytes in the B-tile
  // layout, which is the chunk vectors' (b[g]: 512 bytes; Q4_0's nibbles less 8, Q6_K's
  // codes less 32, the others' codes as they are), and its values as [groups * kPerGroup][16] floats in
  // dcol / mcol. Returns the B tiles: `b`, or Q8_0's codes in place (already signed, in
  // that layout).
  __attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) const int8_t* AmxOperands(
      int64_t groups, int8_t* b, float* dcol, float* mcol) const {
    for (int64_t g = 0; g < groups; ++g) AmxGroup(g, b + g * 512, dcol, mcol);
    return kFmt == kS8 ? reinterpret_cast<const int8_t*>(codes) : b;
  }

  // Group g of AmxOperands: its B tile into `bg` (not Q8_0's, read in place), its values
  // into dcol / mcol at the group.
  __attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void AmxGroup(
      int64_t g, int8_t* bg, float* dcol, float* mcol) const {
    static_assert(AmxFormat(kFmt, true));
    __m512i w[8];
    Group(g, w, dcol + g * kPerGroup * 16, IntMin(kFmt) ? mcol + g * 16 : nullptr);
    if constexpr (kFmt != kS8) {
      for (int k = 0; k < 8; ++k) {
        if constexpr (kFmt == kQ4_0) w[k] = _mm512_sub_epi8(w[k], _mm512_set1_epi8(8));
        if constexpr (kFmt == kQ6_K) w[k] = _mm512_sub_epi8(w[k], _mm512_set1_epi8(32));
        _mm512_storeu_si512(bg + k * 64, w[k]);
      }
    }
  }

  const uint8_t* codes = nullptr;
  const uint8_t* high = nullptr;
  const uint16_t* scale = nullptr;  // Q8_0 / Q4_0 / Q4_1 float16 values
  const uint16_t* min = nullptr;
  const uint8_t* scale_codes = nullptr;  // K-quants
  const uint8_t* min_codes = nullptr;
  const uint16_t* super_scale = nullptr;
  const uint16_t* super_min = nullptr;
};

// A column tile's B tiles unpacked a group at a time (`TiledColumns::AmxGroup`) into a ring
// of 4 (2 KB: stays in L1), its values into dcol / mcol as the group comes: for a single
// 16-row tile, which would write the full buffer once and read it once (at 8,192 inputs
// 128 KB, whose stores missed L1: `perf` put a third of a 16-row Q4_K_M step there).
// The AMX tiles prepare a group one ahead of its product, so a slot is rewritten three
// groups after its B tile was loaded.
template <Format kFmt>
struct AmxBRing {
  const TiledColumns<kFmt>* tile;
  int8_t* ring;  // 4 x 512 bytes
  float* dcol;
  float* mcol;
  const int8_t* At(int64_t g) const {
    if constexpr (kFmt == kS8) return reinterpret_cast<const int8_t*>(tile->codes) + g * 512;
    return ring + g % 4 * 512;
  }
  void Prepare(int64_t g) const { tile->AmxGroup(g, ring + g % 4 * 512, dcol, mcol); }
};

// Rows [r0, r0 + kRows) of `r` x 16 columns: the packed columns `u`
// (PackColumnsUnsigned) with their values `dcol` / `mcol`, or, kTiled, a column tile in
// the column-tiled layout (`tiled`: codes and values a group at a time; the rows' bytes
// in input order): the module comment's numerics.
template <Format kFmt, int kRows, bool kLo, bool kTiled = false>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))) void PackedIntTile(
    const IntRows& r, int r0, int64_t groups, const uint8_t* u, int64_t o, int n,
    const float* dcol, const float* mcol, float* out, int64_t out_dim,
    const TiledColumns<kFmt>* tiled = nullptr) {
  constexpr bool kPlain = kTiled || kFmt == kS8;
  constexpr int kPer = ScalesPerGroup(kFmt);
  const int64_t row_bytes = groups * kGroup;  // of hi / lo, either order
  const RowOperands<kFmt, kLo, kPlain> rows(r);
  __m512 acc[kRows], mins[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = mins[b] = _mm512_setzero_ps();
  alignas(64) float dg[2 * 16], mg[16];  // kTiled: the group's values (TiledColumns)
  constexpr bool kMinArrays = IntMin(kFmt);  // mcol is read only where there are mins
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[8];
    const float* d = dg;  // kTiled: this group's values; else the columns' arrays
    const float* m = mg;
    if constexpr (kTiled) {
      tiled->Group(g, w, dg, mg);
    } else {
      for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(u + g * 512 + k * 64);
      d = dcol + g * kPer * 16;  // (the tiled calls pass no arrays: null)
      m = kMinArrays ? mcol + g * 16 : mg;
    }
    for (int b = 0; b < kRows; ++b) {
      const int8_t* hi = rows.his + (r0 + b) * row_bytes;
      const int8_t* lo = kLo ? rows.los + (r0 + b) * row_bytes : nullptr;
      const int64_t at = (r0 + b) * groups + g;
      __m512i isum[2];
      if constexpr (kFmt == kQ6_K) {  // inputs 0-15 and 16-31 apart
        isum[0] = RowGroupSums<!kPlain, kLo, 0, 4>(w, hi, lo, g);
        isum[1] = RowGroupSums<!kPlain, kLo, 4, 8>(w, hi, lo, g);
      } else {
        isum[0] = RowGroupSums<!kPlain, kLo>(w, hi, lo, g);
        if constexpr (kFmt == kS8) {  // sum (c + 128) x - 128 sum x
          isum[0] = _mm512_sub_epi32(isum[0], _mm512_set1_epi32(128 * rows.xint[at]));
        }
      }
      GroupEpilogue<kFmt, kLo>(rows, isum, at, d, m, &acc[b], &mins[b]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  for (int b = 0; b < kRows; ++b) {
    _mm512_mask_storeu_ps(out + (r0 + b) * out_dim + o, mask,
                          Finish<IntMin(kFmt), kLo>(acc[b], mins[b]));
  }
}

// Output columns [o0, o1) for rows [r_begin, r_end) of `r` (kLo: its 16-bit
// rounding), the module comment's numerics: the whole 16-row tiles that `r` packed
// for AMX (IntRows amx_a; r_begin a multiple of 16) through AMX while AmxEnabled()
// (the `AmxFormat`s), the other rows through the VNNI tiles, 16 columns at a time.
template <Format kFmt, bool kLo>
void ExactIntColumns(const IntRows& r, int r_begin, int r_end, const IntWeight& w, float* out,
                     int64_t out_dim, int64_t o0, int64_t o1) {
  constexpr bool kMin = IntMin(kFmt);
  constexpr int64_t kStep = kLo ? 1024 : 512;  // amx_a's bytes a tile a group
  const int64_t groups = w.in / kGroup;
  thread_local std::vector<float> dcol, mcol;
  thread_local std::vector<int8_t> packed;
  thread_local std::vector<uint8_t> packed_u;  // PackColumnsUnsigned
  dcol.resize(groups * ScalesPerGroup(kFmt) * 16);
  if (kMin) mcol.resize(groups * 16);
  // The A tiles hold the rounding r was made for: 8-bit tiles reading a 16-bit rounding
  // (its high bytes, as the decoder does for a phase of mixed weights) take VNNI.
  const int packed_rows = r.has_lo == kLo ? static_cast<int>(AmxPackedRows(r, groups)) : 0;
  const int amx_rows = std::min(r_end, packed_rows) - r_begin;
  const bool amx = AmxFormat(kFmt, w.tiled) && amx_rows >= kAmxRows &&
                   r_begin % kAmxRows == 0 && AmxEnabled();
  const int amx_end = amx ? r_begin + amx_rows / kAmxRows * kAmxRows : r_begin;
  if (amx) {
    packed.resize(groups * 512);
    AmxConfigure(kFmt == kQ6_K);
  }
  // 16 columns' B tiles b (groups x 512 bytes) and values through AMX, rows
  // [r_begin, amx_end).
  auto amx_tiles = [&](const auto& b, int64_t o) {
    for (int r0 = r_begin; r0 < amx_end; r0 += kAmxRows) {
      const int8_t* a = r.amx_a.data() + r0 / kAmxRows * groups * kStep;
      const float* dxt = r.amx_dx.data() + r0 / kAmxRows * groups * 16;
      if constexpr (kFmt == kQ6_K) {
        AmxTileHalves<kLo>(r0, groups, a, dxt, b, dcol.data(), out, out_dim, o);
      } else if constexpr (kLo) {  // two halves of 8 rows sharing each B tile
        AmxTile16<kFmt>(r, r0, groups, a, dxt, b, dcol.data(), mcol.data(), out, out_dim, o);
      } else {
        AmxTile8<kFmt>(r, r0, groups, a, dxt, b, dcol.data(), mcol.data(), out, out_dim, o);
      }
    }
  };
  if constexpr (TiledFormat(kFmt)) {
    if (w.tiled) {  // the column tiles as laid out: AMX operands unpacked, else read in place
      for (int64_t o = o0; o < o1; o += kTileCols) {
        const TiledColumns<kFmt> tile(w, o);
        int vnni_begin = r_begin;
        if (amx) {  // one row tile: a group at a time; more: unpacked once for all
          if (amx_end - r_begin == kAmxRows) {
            alignas(64) int8_t ring[4 * 512];
            amx_tiles(AmxBRing<kFmt>{&tile, ring, dcol.data(), mcol.data()}, o);
          } else {
            amx_tiles(AmxBTiles{tile.AmxOperands(groups, packed.data(), dcol.data(), mcol.data())},
                      o);
          }
          vnni_begin = amx_end;
        }
        for (int r0 = vnni_begin; r0 < r_end; r0 += kTileRows) {
          XLASERVE_WITH_TILE_ROWS(
              std::min(kTileRows, r_end - r0),
              (PackedIntTile<kFmt, R, kLo, true>(r, r0, groups, nullptr, o, kTileCols, nullptr,
                                                 nullptr, out, out_dim, &tile)));
        }
      }
      if (amx) AmxRelease();
      return;
    }
  }
  if (r_end - r_begin >= kPackedRows) packed_u.resize(groups * 512);
  if (o1 > o0) {  // the first tile's scales (later tiles' come with the tile before them)
    const AheadSpans first = ColumnSpans<kFmt>(w, o0, static_cast<int>(std::min<int64_t>(16, o1 - o0)));
    for (int64_t line = 0; line < first.Lines(); ++line) first.Prefetch(line);
  }
  for (int64_t o = o0; o < o1; o += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, o1 - o));
    IntColumnValues<kFmt>(w, o, n, dcol.data(), mcol.data());
    int vnni_begin = r_begin;
    if (amx && n == 16) {  // (not Q6_K: AmxFormat)
      if constexpr (IsKQuant(kFmt)) {  // unsigned codes below 128: the same signed bytes
        PackColumnsUnsigned<kFmt>(w, o, n, reinterpret_cast<uint8_t*>(packed.data()));
      } else {
        PackColumns<kFmt>(w.codes, groups, o, packed.data());
      }
      amx_tiles(AmxBTiles{packed.data()}, o);
      vnni_begin = amx_end;
    }
    if (r_end - vnni_begin >= kPackedRows) {  // many rows: packed once, no lane reduction
      PackColumnsUnsigned<kFmt>(w, o, n, packed_u.data());
      for (int r0 = vnni_begin; r0 < r_end; r0 += kTileRows) {
        XLASERVE_WITH_TILE_ROWS(
            std::min(kTileRows, r_end - r0),
            (PackedIntTile<kFmt, R, kLo>(r, r0, groups, packed_u.data(), o, n, dcol.data(),
                                         mcol.data(), out, out_dim)));
      }
      continue;
    }
    // The first row tile over these columns prefetches the next 16 columns (the
    // others find this tile's codes in cache).
    const int ahead = static_cast<int>(std::clamp<int64_t>(o1 - (o + 16), 0, 16));
    const AheadSpans next = ColumnSpans<kFmt>(w, o + 16, ahead);
    for (int r0 = vnni_begin; r0 < r_end; r0 += kTileRows) {
      const bool first = r0 == vnni_begin;
      XLASERVE_WITH_TILE_ROWS(
          std::min(kTileRows, r_end - r0),
          (ExactIntTile<kFmt, R, kLo>(r, r0, w, o, n, dcol.data(), mcol.data(), out, out_dim,
                                      first ? ahead : 0,
                                      first && ahead > 0 ? &next : nullptr)));
    }
  }
  if (amx) AmxRelease();
}

// Output columns [o0, o1) of `w` for every row of `r` (`lo`: its 16-bit rounding, else
// its 8-bit one).
template <Format kFmt>
void IntColumns(const IntRows& r, bool lo, int rows, const IntWeight& w, float* out,
                int64_t out_dim, int64_t o0, int64_t o1) {
  if (lo) {
    ExactIntColumns<kFmt, true>(r, 0, rows, w, out, out_dim, o0, o1);
  } else {
    ExactIntColumns<kFmt, false>(r, 0, rows, w, out, out_dim, o0, o1);
  }
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_INT_H_
