// The float-activation column loops of quant_dot.h for CPUs with AVX2, FMA and
// F16C but no AVX-512 (most laptops, many desktops): the same formats, operands
// and numerics (float32 products and sums, up to summation order), in 8-float
// vectors, a group of 32 inputs being 4 of them.
//
// Differences from the AVX-512 tiles: AVX2 has 16 vector registers, so a tile
// takes up to kAvx2TileRows = 4 rows (4 accumulators, 4 code vectors), and the
// min term sum_g m_g * xsum_g is added after the code loop, per row, instead of
// in a second set of accumulators.
//
// Integer activations (nibbles and Q8_0 times activations rounded per group to 8
// or 16 bits, quant_dot.h's rounding) take quant_int.h's block-exact numerics, so
// they give the AVX-512 set's bits (VNNI or AMX) exactly: per row, column and group
// the exact int32 dot product, then the same float32 epilogue in group order. A
// row's rounded activations are kept as int16 in input order (`x8`: hi, `x16`:
// 256 hi + lo, at most 32639 in magnitude), the codes widened to int16 (a nibble
// group's 16 bytes: low nibbles = inputs 0-15, high = 16-31), and each group's 32
// products summed in pairs by VPMADDWD (or AVX-VNNI's VPDPWSSD where the CPU has
// it: Alder Lake and later, Zen 5) into 8 int32 lanes; 8 columns' lanes are then
// reduced to one lane per column (`Reduce8`) and the epilogue runs on 8 columns at
// once (`ExactIntTile`). 16-bit activations cost the same as 8-bit ones here (one
// int16 vector pair a group either way).

#ifndef XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_
#define XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant_dot.h"

namespace xlaserve {

namespace avx2 {

#define XLASERVE_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

constexpr int kAvx2TileRows = 4;  // activation rows per pass (their register accumulators)

// The sum of the 8 lanes of v.
XLASERVE_AVX2_TARGET inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 32 codes of a group as four float32 vectors (inputs 0-7, 8-15, 16-23, 24-31).
template <Format kFmt>
XLASERVE_AVX2_TARGET inline void Codes(const uint8_t* q, __m256 c[4]) {
  auto bytes8 = [](const uint8_t* p) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  };
  if constexpr (kFmt == kU8) {
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(q + 8 * j)));
  } else if constexpr (kFmt == kS8) {
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(q + 8 * j)));
  } else {
    // Byte j: input j in its low nibble, input j + 16 in its high one.
    const __m256i nib = _mm256_set1_epi32(0x0F);
    const __m256i b0 = _mm256_cvtepu8_epi32(bytes8(q)), b1 = _mm256_cvtepu8_epi32(bytes8(q + 8));
    c[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, nib));
    c[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, nib));
    c[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    c[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
}

// Sums of each group of 32 activations, xsum[b, g] (the min term of a float tile).
XLASERVE_AVX2_TARGET inline void GroupSums(const float* x, int rows, int64_t in, float* xsum) {
  const int64_t groups = in / kGroup;
  for (int b = 0; b < rows; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xg), _mm256_loadu_ps(xg + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(xg + 16),
                                                   _mm256_loadu_ps(xg + 24)));
      xsum[b * groups + g] = Sum8(s);
    }
  }
}

// sum_g m_g * xsum_g of one row (m_g: the group's min, or -8 * scale for Q4_0).
template <Format kFmt>
XLASERVE_AVX2_TARGET inline float MinTerm(const float* xsum, int64_t groups,
                                          const uint16_t* s_row, const uint16_t* m_row) {
  const uint16_t* src = HasMin(kFmt) ? m_row : s_row;
  const float factor = HasMin(kFmt) ? 1.0f : -8.0f;
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + g)));
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + g), acc);
  }
  float sum = Sum8(acc);
  for (; g < groups; ++g) sum += _cvtsh_ss(src[g]) * xsum[g];
  return sum * factor;
}

// Output column o for activation rows [r0, r0 + kRows), kRows <= kAvx2TileRows, as
// sum_g (s_g * sum_i c_i x_i) + sum_g m_g xsum_g (quant_dot.h `Tile`).
template <Format kFmt, int kRows>
XLASERVE_AVX2_TARGET void Tile(const float* x, const float* xsum, int r0, int64_t in,
                               const uint8_t* q, const uint16_t* s_row, const uint16_t* m_row,
                               float* out, int64_t out_dim, int64_t o) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  __m256 acc[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(s_row[g]));
    __m256 c[4];
    Codes<kFmt>(q + g * group_bytes, c);
    for (int b = 0; b < kRows; ++b) {
      const float* xb = x + (r0 + b) * in + g * kGroup;
      __m256 dot = _mm256_mul_ps(c[0], _mm256_loadu_ps(xb));
      dot = _mm256_fmadd_ps(c[1], _mm256_loadu_ps(xb + 8), dot);
      dot = _mm256_fmadd_ps(c[2], _mm256_loadu_ps(xb + 16), dot);
      dot = _mm256_fmadd_ps(c[3], _mm256_loadu_ps(xb + 24), dot);
      acc[b] = _mm256_fmadd_ps(dot, s, acc[b]);
    }
  }
  for (int b = 0; b < kRows; ++b) {
    float y = Sum8(acc[b]);
    if constexpr (kFmt != kS8) y += MinTerm<kFmt>(xsum + (r0 + b) * groups, groups, s_row, m_row);
    out[(r0 + b) * out_dim + o] = y;
  }
}

// Output columns [o0, o1) for all `rows` activation rows (xsum: their GroupSums),
// in tiles of up to kAvx2TileRows rows (quant_dot.h `Columns`).
template <Format kFmt>
void Columns(const float* x, const float* xsum, int rows, int64_t in, const uint8_t* codes,
             const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
             int64_t o0, int64_t o1) {
  ForColumnTiles<kFmt, kAvx2TileRows>(
      rows, in, codes, scale, offset, o0, o1,
      [&](auto r, int r0, const uint8_t* q, const uint16_t* s_row, const uint16_t* m_row,
          int64_t o) {
        Tile<kFmt, decltype(r)::value>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o);
      });
}

// ---- Integer activations: block-exact (quant_int.h's numerics) ----

// Whether this CPU has AVX-VNNI (VPDPWSSD on 8-lane vectors: Alder Lake and later,
// Zen 5) and XLASERVE_NATIVE_AVXVNNI is not 0 (read at each call: tests compare both;
// the integers, hence the results, are the same either way).
inline bool AvxVnniEnabled() {
  static const bool hw = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni") != 0;
  }();
  const char* env = std::getenv("XLASERVE_NATIVE_AVXVNNI");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return hw;
}

// 16 int32 values (a: inputs 0-7, b: 8-15; in int16 range) stored as 16 int16.
XLASERVE_AVX2_TARGET inline void StoreWords(int16_t* dst, __m256i a, __m256i b) {
  const __m256i w = _mm256_packs_epi32(a, b);  // [a0-3 b0-3 | a4-7 b4-7]
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute4x64_epi64(w, 0xD8));
}

XLASERVE_AVX2_TARGET inline int32_t SumEpi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Sizes `r` for `rows` rows of `in` inputs rounded to 16 bits (`with_lo`) or 8, in
// the AVX2 tiles' fields (x8, x16 and the per-group values of quant_dot.h IntRows).
inline void PrepareRows(int rows, int64_t in, bool with_lo, IntRows& r) {
  const int64_t groups = in / kGroup;
  r.avx_vnni = AvxVnniEnabled();
  r.hi.clear();
  r.lo.clear();
  r.hi_plain.clear();
  r.lo_plain.clear();
  r.x8.resize(rows * groups * kGroup);
  r.x16.resize(with_lo ? rows * groups * kGroup : 0);
  SizeGroupFields(rows, groups, with_lo, r);
}

// Rows [b0, b1) of x rounded per group into `r` (sized by PrepareRows), with quant_dot.h
// QuantizeRowRange's operations (the same values): each row on its own.
XLASERVE_AVX2_TARGET inline void QuantizeRowRange(const float* x, int b0, int b1, int64_t in,
                                                  IntRows& r) {
  const int64_t groups = in / kGroup;
  const bool with_lo = r.has_lo;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 k256 = _mm256_set1_ps(256.0f);
  const __m256i lo_max = _mm256_set1_epi32(127), lo_min = _mm256_set1_epi32(-127);
  for (int b = b0; b < b1; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xg + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.0f;
      const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256 sv[4];
      __m256i qv[4], sum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        sv[j] = _mm256_mul_ps(v[j], inv);
        qv[j] = _mm256_cvtps_epi32(sv[j]);  // in [-127, 127]
        sum = _mm256_add_epi32(sum, qv[j]);
      }
      const int64_t at = b * groups + g;
      const int32_t sum8 = SumEpi32(sum);
      r.xsum8[at] = d * static_cast<float>(sum8);
      r.xint8[at] = sum8;
      r.dx_group[at] = d;
      int16_t* x8 = r.x8.data() + at * kGroup;
      StoreWords(x8, qv[0], qv[1]);
      StoreWords(x8 + 16, qv[2], qv[3]);
      if (with_lo) {
        __m256i rv[4], sum_lo = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          rv[j] = _mm256_max_epi32(lo_min, _mm256_min_epi32(lo_max, _mm256_cvtps_epi32(
              _mm256_mul_ps(_mm256_sub_ps(sv[j], _mm256_cvtepi32_ps(qv[j])), k256))));
          sum_lo = _mm256_add_epi32(sum_lo, rv[j]);
          rv[j] = _mm256_add_epi32(_mm256_slli_epi32(qv[j], 8), rv[j]);  // 256 hi + lo
        }
        const int32_t lo_sum = SumEpi32(sum_lo);
        r.xint16[at] = 256 * sum8 + lo_sum;
        r.xsum16[at] =
            d * (static_cast<float>(sum8) + static_cast<float>(lo_sum) * (1.0f / 256.0f));
        int16_t* x16 = r.x16.data() + at * kGroup;
        StoreWords(x16, rv[0], rv[1]);
        StoreWords(x16 + 16, rv[2], rv[3]);
      }
    }
  }
}

// Rows of x rounded per group for the AVX2 integer tiles (`with_lo`: to 16 bits).
inline void QuantizeRows(const float* x, int rows, int64_t in, bool with_lo, IntRows& r) {
  avx2::PrepareRows(rows, in, with_lo, r);
  avx2::QuantizeRowRange(x, 0, rows, in, r);
}

constexpr int kIntCols = 8;  // output columns per integer tile (one int32 / float lane each)

// The float16 values (scales or mins, [O, groups]) of columns [o, o + n), n <= 8, as
// [groups][8]; lanes past n repeat column o + n - 1 (their outputs are not stored).
// 8 groups at a time as an 8 x 8 transpose of 16-bit values, the rest one by one.
XLASERVE_AVX2_TARGET inline void ColumnHalves(const uint16_t* values, int64_t groups, int64_t o,
                                              int n, uint16_t* dst) {
  const uint16_t* src[kIntCols];
  for (int c = 0; c < kIntCols; ++c) src[c] = values + (o + std::min(c, n - 1)) * groups;
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m128i v[8], a[8], b[8];
    for (int c = 0; c < 8; ++c) {
      v[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[c] + g));
    }
    for (int k = 0; k < 4; ++k) {  // pairs of columns, interleaved by group
      a[2 * k] = _mm_unpacklo_epi16(v[2 * k], v[2 * k + 1]);
      a[2 * k + 1] = _mm_unpackhi_epi16(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; ++k) {  // columns 4k .. 4k + 3, two groups a vector
      b[4 * k] = _mm_unpacklo_epi32(a[4 * k], a[4 * k + 2]);
      b[4 * k + 1] = _mm_unpackhi_epi32(a[4 * k], a[4 * k + 2]);
      b[4 * k + 2] = _mm_unpacklo_epi32(a[4 * k + 1], a[4 * k + 3]);
      b[4 * k + 3] = _mm_unpackhi_epi32(a[4 * k + 1], a[4 * k + 3]);
    }
    auto* out = reinterpret_cast<__m128i*>(dst + g * kIntCols);
    for (int k = 0; k < 4; ++k) {  // group g + 2k, g + 2k + 1: columns 0-3 then 4-7
      _mm_storeu_si128(out + 2 * k, _mm_unpacklo_epi64(b[k], b[4 + k]));
      _mm_storeu_si128(out + 2 * k + 1, _mm_unpackhi_epi64(b[k], b[4 + k]));
    }
  }
  for (; g < groups; ++g) {
    for (int c = 0; c < kIntCols; ++c) dst[g * kIntCols + c] = src[c][g];
  }
}

// The 32 codes of column row `q` (a group's bytes) as int16 (w0: inputs 0-15, w1:
// 16-31): Q8_0 codes, or nibbles (Q4_0's - 8 is taken out after the sum).
template <Format kFmt>
XLASERVE_AVX2_TARGET inline void CodeWords(const uint8_t* q, __m256i& w0, __m256i& w1) {
  if constexpr (kFmt == kS8) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  } else {  // byte j: input j in its low nibble, j + 16 in its high one
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(b, 4);
  }
}

// The 8 int32 lanes of a group's 32 code x activation products (pairs summed):
// VPMADDWD twice, or AVX-VNNI's VPDPWSSD (inline assembly: no target attribute needed,
// run only where AvxVnniEnabled()). Exact: |w x| <= 128 * 32639, 32 of them < 2^31.
template <bool kVnni>
XLASERVE_AVX2_TARGET inline __m256i DotWords(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
  if constexpr (kVnni) {
    __m256i acc = _mm256_setzero_si256();
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w0), "x"(x0));
    asm("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(w1), "x"(x1));
    return acc;
  } else {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
  }
}

// The lane sums of 8 vectors: lane c = sum of d[c]'s 8 lanes (integer adds: exact).
XLASERVE_AVX2_TARGET inline __m256i Reduce8(__m256i d0, __m256i d1, __m256i d2, __m256i d3,
                                            __m256i d4, __m256i d5, __m256i d6, __m256i d7) {
  const __m256i b0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
  const __m256i b1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d4, d5), _mm256_hadd_epi32(d6, d7));
  // b0 = [c0..c3 of lanes 0-3 | c0..c3 of lanes 4-7], b1 the same for c4..c7.
  return _mm256_add_epi32(_mm256_blend_epi32(b0, b1, 0xF0),
                          _mm256_permute2x128_si256(b0, b1, 0x21));
}

// Columns [o, o + n) (n <= 8) x rows [r0, r0 + kRows) of `r` (avx2::QuantizeRows),
// nibbles (Q4_1, Q4_0) or Q8_0 codes: quant_int.h's numerics, so the same bits as the
// AVX-512 set's VNNI and AMX tiles. Per group the 8 columns' int32 sums are reduced
// to one lane each (`Reduce8`), then the epilogue runs on 8 columns at once, in group
// order. dcol / mcol: the columns' scales / mins (ColumnHalves).
template <Format kFmt, int kRows, bool kLo, bool kVnni>
XLASERVE_AVX2_TARGET void ExactIntTile(const IntRows& r, int r0, int64_t groups,
                                       const uint8_t* codes, int64_t o, int n,
                                       const uint16_t* dcol, const uint16_t* mcol, float* out,
                                       int64_t out_dim) {
  constexpr bool kMin = HasMin(kFmt);
  constexpr int64_t kBytes = GroupBytes(kFmt);
  const int16_t* xs = (kLo ? r.x16 : r.x8).data();
  const float* dx = r.dx_group.data();
  const int32_t* xint = (kLo ? r.xint16 : r.xint8).data();
  const float* xsum = kMin ? (kLo ? r.xsum16 : r.xsum8).data() : nullptr;
  const uint8_t* col[kIntCols];  // lanes past n repeat the last column (not stored)
  for (int c = 0; c < kIntCols; ++c) col[c] = codes + (o + std::min(c, n - 1)) * groups * kBytes;
  __m256 acc[kRows], mins[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = mins[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i s[kRows];
    // The next tile's codes (right after this tile's 8 columns), a group's share a step.
    const char* ahead = reinterpret_cast<const char*>(codes + (o + kIntCols) * groups * kBytes +
                                                      g * kIntCols * kBytes);
    for (int k = 0; k < kIntCols * kBytes; k += 64) _mm_prefetch(ahead + k, _MM_HINT_T0);
    if constexpr (kRows == 1) {  // codes decoded as they are used
      const __m256i* xv = reinterpret_cast<const __m256i*>(xs + (r0 * groups + g) * kGroup);
      const __m256i x0 = _mm256_loadu_si256(xv), x1 = _mm256_loadu_si256(xv + 1);
      __m256i d[kIntCols];
      for (int c = 0; c < kIntCols; ++c) {
        __m256i w0, w1;
        CodeWords<kFmt>(col[c] + g * kBytes, w0, w1);
        d[c] = DotWords<kVnni>(w0, w1, x0, x1);
      }
      s[0] = Reduce8(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
    } else {  // codes decoded once for all rows
      __m256i w[2 * kIntCols];
      for (int c = 0; c < kIntCols; ++c) {
        CodeWords<kFmt>(col[c] + g * kBytes, w[2 * c], w[2 * c + 1]);
      }
      for (int b = 0; b < kRows; ++b) {
        const __m256i* xv =
            reinterpret_cast<const __m256i*>(xs + ((r0 + b) * groups + g) * kGroup);
        const __m256i x0 = _mm256_loadu_si256(xv), x1 = _mm256_loadu_si256(xv + 1);
        __m256i d[kIntCols];
        for (int c = 0; c < kIntCols; ++c) d[c] = DotWords<kVnni>(w[2 * c], w[2 * c + 1], x0, x1);
        s[b] = Reduce8(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]);
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        dcol + g * kIntCols)));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (kMin) {
      mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mcol + g * kIntCols)));
    }
    for (int b = 0; b < kRows; ++b) {
      const int64_t at = (r0 + b) * groups + g;
      if constexpr (kFmt == kQ4_0) {  // sum (n - 8) x = sum n x - 8 sum x
        s[b] = _mm256_sub_epi32(s[b], _mm256_set1_epi32(8 * xint[at]));
      }
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[b]), _mm256_mul_ps(dv, _mm256_set1_ps(dx[at])),
                               acc[b]);
      if constexpr (kMin) mins[b] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[at]), mins[b]);
    }
  }
  const __m256 unit = _mm256_set1_ps(kLo ? 1.0f / 256.0f : 1.0f);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int b = 0; b < kRows; ++b) {
    __m256 y = acc[b];  // quant_int.h Finish
    if constexpr (kMin) {
      y = _mm256_fmadd_ps(acc[b], unit, mins[b]);
    } else if constexpr (kLo) {
      y = _mm256_mul_ps(acc[b], unit);
    }
    _mm256_maskstore_ps(out + (r0 + b) * out_dim + o, mask, y);
  }
}

// Output columns [o0, o1) of nibbles or Q8_0 codes for rows [r0, r1) of `r`
// (avx2::QuantizeRows; `lo`: its 16-bit rounding, else its 8-bit one), in blocks of
// 8 columns x tiles of up to kAvx2TileRows rows.
template <Format kFmt>
void IntColumns(const IntRows& r, bool lo, int r0, int r1, int64_t in, const uint8_t* codes,
                const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
                int64_t o0, int64_t o1) {
  static_assert(kFmt == kQ4_1 || kFmt == kQ4_0 || kFmt == kS8);
  const int64_t groups = in / kGroup;
  ForIntColumnTiles<kFmt, kIntCols, kAvx2TileRows>(
      r0, r1, in, scale, offset, o0, o1, ColumnHalves,
      [&](auto rows, int b, int64_t o, int n, const uint16_t* dcol, const uint16_t* mcol) {
        WithFlag(lo, [&](auto lo16) {
          WithFlag(r.avx_vnni, [&](auto vnni) {
            constexpr int kRows = decltype(rows)::value;
            ExactIntTile<kFmt, kRows, decltype(lo16)::value, decltype(vnni)::value>(
                r, b, groups, codes, o, n, dcol, mcol, out, out_dim);
          });
        });
      });
}

}  // namespace avx2
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_
