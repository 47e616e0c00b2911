// The float-activation column loops of quant_dot.h for CPUs with AVX2, FMA and
// F16C but no AVX-512 (most laptops, many desktops): the same formats, operands
// and numerics (float32 products and sums, up to summation order), in 8-float
// vectors, a group of 32 inputs being 4 of them.
//
// Differences from the AVX-512 tiles: AVX2 has 16 vector registers, so a tile
// takes up to kAvx2TileRows = 4 rows (4 accumulators, 4 code vectors), and the
// min term sum_g m_g * xsum_g is added after the code loop, per row, instead of
// in a second set of accumulators. There are no integer-activation tiles here:
// on this path the weights take float activations (kernels_cpu/library.py
// `vnni()` is False), so `activation_bits` falls back to 32.

#ifndef XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_
#define XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant_dot.h"

namespace xlaserve {

// The instruction set a handler's loops use: the AVX-512 ones (quant_dot.h,
// attention.h) or the AVX2 ones (quant_dot_avx2.h, attention_avx2.h).
enum class Isa { kAvx512, kAvx2 };

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
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * groups * group_bytes;
    const uint16_t* s_row = scale + o * groups;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    for (int r0 = 0; r0 < rows; r0 += kAvx2TileRows) {
      switch (std::min(kAvx2TileRows, rows - r0)) {
        case 1: Tile<kFmt, 1>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o); break;
        case 2: Tile<kFmt, 2>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o); break;
        case 3: Tile<kFmt, 3>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o); break;
        default: Tile<kFmt, 4>(x, xsum, r0, in, q, s_row, m_row, out, out_dim, o); break;
      }
    }
  }
}

}  // namespace avx2
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_
