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
// or 16 bits, quant_dot.h's scheme and rounding) use llama.cpp's AVX2 byte products
// instead of VNNI: VPMADDUBSW multiplies 32 unsigned code bytes by 32 signed
// activation bytes into 16 int16 pair sums (at most 2 * 15 * 127 for nibbles,
// 2 * 128 * 127 for |Q8_0 codes|: no saturation) and VPMADDWD with ones adds
// those pairs into 8 int32 lanes. A group is one 32-byte vector in input order
// (a nibble group's 16 bytes as [low nibbles | high nibbles] is inputs 0-31), so
// these tiles read IntRows' input-order fields (`hi_plain`, `lo_plain`,
// `dx_plain`), filled by `avx2::QuantizeRows`.

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

// ---- Integer activations (AVX2 byte products) ----

// 4 vectors of int32 in [-127, 127] -> 32 bytes in input order.
XLASERVE_AVX2_TARGET inline void PackBytes(const __m256i v[4], int8_t* dst) {
  const __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
  const __m256i b = _mm256_packs_epi16(w01, w23);  // 4-byte runs interleaved by 128-bit lane
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

XLASERVE_AVX2_TARGET inline int32_t SumEpi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Rows of x rounded per group for the AVX2 integer tiles (quant_dot.h QuantizeRows'
// rounding; `with_lo`: to 16 bits): the input-order fields, dx_plain and the sums.
XLASERVE_AVX2_TARGET inline void QuantizeRows(const float* x, int rows, int64_t in, bool with_lo,
                                              IntRows& r) {
  const int64_t groups = in / kGroup, pairs = groups / 2;
  r.has_lo = with_lo;
  r.hi.clear();
  r.lo.clear();
  r.dx.clear();
  r.hi_plain.assign(rows * groups * kGroup, 0);
  r.dx_plain.assign(rows * pairs * 16, 0.0f);
  r.xsum8.assign(rows * groups, 0.0f);
  r.lo_plain.assign(with_lo ? rows * groups * kGroup : 0, 0);
  r.xsum16.assign(with_lo ? rows * groups : 0, 0.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 k256 = _mm256_set1_ps(256.0f);
  const __m256i lo_max = _mm256_set1_epi32(127), lo_min = _mm256_set1_epi32(-127);
  for (int b = 0; b < rows; ++b) {
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
      const int32_t sum8 = SumEpi32(sum);
      r.xsum8[b * groups + g] = d * static_cast<float>(sum8);
      const int64_t plain_at = (b * groups + g) * kGroup;
      PackBytes(qv, r.hi_plain.data() + plain_at);
      if (with_lo) {
        __m256i rv[4], sum_lo = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          rv[j] = _mm256_max_epi32(lo_min, _mm256_min_epi32(lo_max, _mm256_cvtps_epi32(
              _mm256_mul_ps(_mm256_sub_ps(sv[j], _mm256_cvtepi32_ps(qv[j])), k256))));
          sum_lo = _mm256_add_epi32(sum_lo, rv[j]);
        }
        r.xsum16[b * groups + g] = d * (static_cast<float>(sum8) +
                                        static_cast<float>(SumEpi32(sum_lo)) * (1.0f / 256.0f));
        PackBytes(rv, r.lo_plain.data() + plain_at);
      }
      float* plain_lanes = r.dx_plain.data() + (b * pairs + g / 2) * 16;
      for (int j = 0; j < 8; ++j) plain_lanes[8 * (g % 2) + j] = d;
    }
  }
}

// The 8 int32 lanes of 32 unsigned codes times a group's activation bytes: hi only,
// or 256 * (codes . hi) + codes . lo (16-bit activations). `sign`: Q8_0's codes, whose
// signs the activations take (their magnitudes are `codes`); nullptr for nibbles.
template <bool kLo>
XLASERVE_AVX2_TARGET inline __m256i DotBytes(__m256i codes, const int8_t* hi, const int8_t* lo,
                                             const __m256i* sign) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
  if (sign != nullptr) h = _mm256_sign_epi8(h, *sign);
  __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, h), ones);
  if constexpr (kLo) {
    __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    if (sign != nullptr) l = _mm256_sign_epi8(l, *sign);
    dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8),
                           _mm256_madd_epi16(_mm256_maddubs_epi16(codes, l), ones));
  }
  return dot;
}

// Nibbles (kFmt Q4_1 / Q4_0) or Q8_0 codes (kS8) x rows [r0, r0 + kRows) of `r`
// (kLo: 16-bit activations): output column o (quant_dot.h IntTile / S8IntTile).
template <Format kFmt, int kRows, bool kLo>
XLASERVE_AVX2_TARGET void IntTile(const IntRows& r, int r0, int64_t groups, const uint8_t* q,
                                  const uint16_t* s_row, const uint16_t* m_row, float* out,
                                  int64_t out_dim, int64_t o) {
  const int64_t pairs = groups / 2;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float d = _cvtsh_ss(s_row[g]);
    __m256i codes, sign;
    if constexpr (kFmt == kS8) {
      sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroup));
      codes = _mm256_sign_epi8(sign, sign);  // |w| (-128 stays 0x80: 128 unsigned)
    } else {
      const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
      codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(y, 4), y), nib);
    }
    for (int b = 0; b < kRows; ++b) {
      const int64_t at = ((r0 + b) * groups + g) * kGroup;
      const __m256i dot = DotBytes<kLo>(codes, r.hi_plain.data() + at,
                                        kLo ? r.lo_plain.data() + at : nullptr,
                                        kFmt == kS8 ? &sign : nullptr);
      const float dx = r.dx_plain[((r0 + b) * pairs + g / 2) * 16 + 8 * (g % 2)];
      acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * dx), acc[b]);
    }
  }
  const float unit = kLo ? 1.0f / 256.0f : 1.0f;  // the lanes count dx / 256 with lo
  for (int b = 0; b < kRows; ++b) {
    float y = Sum8(acc[b]) * unit;
    if constexpr (kFmt != kS8) {
      const float* xsum = (kLo ? r.xsum16 : r.xsum8).data() + (r0 + b) * groups;
      y += MinTerm<kFmt>(xsum, groups, s_row, m_row);
    }
    out[(r0 + b) * out_dim + o] = y;
  }
}

// Output columns [o0, o1) of nibbles or Q8_0 codes for every row of `r`
// (avx2::QuantizeRows; `lo`: its 16-bit rounding, else its 8-bit one).
template <Format kFmt>
void IntColumns(const IntRows& r, bool lo, int rows, int64_t in, const uint8_t* codes,
                const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
                int64_t o0, int64_t o1) {
  static_assert(kFmt == kQ4_1 || kFmt == kQ4_0 || kFmt == kS8);
  const int64_t groups = in / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * groups * GroupBytes(kFmt);
    const uint16_t* s_row = scale + o * groups;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    for (int r0 = 0; r0 < rows; r0 += kAvx2TileRows) {
#define XLASERVE_AVX2_INT_TILE(R)                                                            \
  (lo ? avx2::IntTile<kFmt, R, true>(r, r0, groups, q, s_row, m_row, out, out_dim, o)              \
      : avx2::IntTile<kFmt, R, false>(r, r0, groups, q, s_row, m_row, out, out_dim, o))
      switch (std::min(kAvx2TileRows, rows - r0)) {
        case 1: XLASERVE_AVX2_INT_TILE(1); break;
        case 2: XLASERVE_AVX2_INT_TILE(2); break;
        case 3: XLASERVE_AVX2_INT_TILE(3); break;
        default: XLASERVE_AVX2_INT_TILE(4); break;
      }
#undef XLASERVE_AVX2_INT_TILE
    }
  }
}

}  // namespace avx2
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_DOT_AVX2_H_
