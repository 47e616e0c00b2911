// GGUF K-quant weights x activation rows: the column loops for Q4_K, Q5_K and
// Q6_K blocks kept as stored (serving/models/quantized.py, checkpoints/quantize.py).
//
// A K-quant matrix [O, I] (I a multiple of 256) has per super-block of 256
// inputs a float16 d (and for Q4_K / Q5_K a float16 -dmin), and per sub-block
// integer scale codes:
//   Q4_K: nibbles in groups of 32 (byte j: input j low, j + 16 high, as Q4_1),
//         uint8 6-bit scale and min codes per 32: w = code * sc * d + mn * (-dmin);
//   Q5_K: the same plus the fifth bit in q_high (byte k: inputs 8k..8k+7, one bit
//         each from the lowest): code 0..31;
//   Q6_K: nibbles in groups of 16 (byte j: input j low, j + 8 high), the top two
//         bits in q_high (byte k: inputs 4k..4k+3, two bits each from the lowest),
//         an int8 scale per 16: w = d * sc * (code - 32).
// The group's float scale (and min) is the code times its super-block's value,
// computed in registers per super-block: the weights are read as stored.
//
// `KTile` converts each 32 inputs of a column to float32 weights in registers and
// multiplies them into up to kTileRows float rows. With activations rounded to 8 or
// 16 bits the integer tiles of quant_int.h take K-quants as they take Q4_1 (exact
// integer sums per group, Q6_K's per 16 inputs); `KPairCodes` gives them a pair of
// groups' codes as bytes and `SuperScales` the sub-block scales.

#ifndef XLASERVE_KERNELS_CPU_KQUANT_DOT_H_
#define XLASERVE_KERNELS_CPU_KQUANT_DOT_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_dot.h"

namespace xlaserve {

// Output row o's operands.
template <Format kFmt>
inline KWeight KRow(const KWeight& w, int64_t in, int64_t o) {
  KWeight r;
  r.q = w.q + o * in / 2;
  r.q_high = kFmt == kQ4_K ? nullptr : w.q_high + o * KHighBytes(kFmt, in);
  r.scale = w.scale + o * KScaleCount(kFmt, in);
  r.offset = kFmt == kQ6_K ? nullptr : w.offset + o * (in / kGroup);
  r.super_scale = w.super_scale + o * (in / kSuper);
  r.super_offset = kFmt == kQ6_K ? nullptr : w.super_offset + o * (in / kSuper);
  return r;
}

inline __attribute__((target("f16c"))) float HalfToFloat(uint16_t h) { return _cvtsh_ss(h); }

// A super-block's float sub-block scales (and mins): Q4_K / Q5_K 8 of each, Q6_K 16
// (times d; its -32 folded into `m` as -32 * scale per 16).
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline void SuperScales(
    const KWeight& row, int64_t sb, float* s, float* m) {
  const __m512 d = _mm512_set1_ps(HalfToFloat(row.super_scale[sb]));
  if constexpr (kFmt == kQ6_K) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.scale + sb * 16));
    const __m512 sv = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), d);
    _mm512_storeu_ps(s, sv);
    _mm512_storeu_ps(m, _mm512_mul_ps(sv, _mm512_set1_ps(-32.0f)));
  } else {
    const __m256 dm = _mm256_set1_ps(HalfToFloat(row.super_offset[sb]));
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.scale + sb * 8));
    const __m128i mn = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.offset + sb * 8));
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)),
                                      _mm512_castps512_ps256(d)));
    _mm256_storeu_ps(m, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), dm));
  }
}

// Inputs 0-15 and 16-31 of a group-16 nibble pair (Q6_K: 16 bytes, 8 per 16 inputs)
// as int32 codes 0..15.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void Q6Nibbles(
    const uint8_t* q, __m512i* lo, __m512i* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i low = _mm512_and_si512(b, _mm512_set1_epi32(0x0F));  // [A0-7, B0-7]
  const __m512i high = _mm512_srli_epi32(b, 4);                       // [A8-15, B8-15]
  *lo = _mm512_permutex2var_epi32(
      low, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23), high);
  *hi = _mm512_permutex2var_epi32(
      low, _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31),
      high);
}

// Float32 weights of 32 inputs (chunk j of super-block sb): lo = inputs 0-15, hi = 16-31.
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline void KWeights32(
    const KWeight& row, int64_t chunk, int64_t j, const float* s, const float* m, __m512* lo,
    __m512* hi) {
  if constexpr (kFmt == kQ6_K) {
    __m512i c_lo, c_hi;
    Q6Nibbles(row.q + chunk * 16, &c_lo, &c_hi);
    uint32_t h[2];
    std::memcpy(h, row.q_high + chunk * 8, 8);
    const __m512i shifts =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i three = _mm512_set1_epi32(3);
    c_lo = _mm512_or_si512(c_lo, _mm512_slli_epi32(_mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(h[0])), shifts), three), 4));
    c_hi = _mm512_or_si512(c_hi, _mm512_slli_epi32(_mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(h[1])), shifts), three), 4));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c_lo), _mm512_set1_ps(s[2 * j]),
                          _mm512_set1_ps(m[2 * j]));
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c_hi), _mm512_set1_ps(s[2 * j + 1]),
                          _mm512_set1_ps(m[2 * j + 1]));
  } else {
    __m512 c_lo, c_hi;
    Codes<kQ4_1>(row.q + chunk * 16, &c_lo, &c_hi);
    if constexpr (kFmt == kQ5_K) {
      uint32_t h;
      std::memcpy(&h, row.q_high + chunk * 4, 4);
      const __m512 k16 = _mm512_set1_ps(16.0f);
      c_lo = _mm512_mask_add_ps(c_lo, static_cast<__mmask16>(h & 0xFFFF), c_lo, k16);
      c_hi = _mm512_mask_add_ps(c_hi, static_cast<__mmask16>(h >> 16), c_hi, k16);
    }
    const __m512 sv = _mm512_set1_ps(s[j]), mv = _mm512_set1_ps(m[j]);
    *lo = _mm512_fmadd_ps(c_lo, sv, mv);
    *hi = _mm512_fmadd_ps(c_hi, sv, mv);
  }
}

// Output column o (operands `row`) for float rows [r0, r0 + kRows): per 32 inputs the
// float32 weights once, then two FMAs per row (two accumulators a row).
template <Format kFmt, int kRows>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void KTile(
    const float* x, int r0, int64_t in, const KWeight& row, float* out, int64_t out_dim,
    int64_t o) {
  __m512 acc_lo[kRows], acc_hi[kRows];
  for (int b = 0; b < kRows; ++b) acc_lo[b] = acc_hi[b] = _mm512_setzero_ps();
  alignas(64) float s[16] = {}, m[16] = {};
  for (int64_t sb = 0; sb < in / kSuper; ++sb) {
    SuperScales<kFmt>(row, sb, s, m);
    for (int64_t j = 0; j < kSuper / kGroup; ++j) {
      const int64_t chunk = sb * (kSuper / kGroup) + j;
      __m512 w_lo, w_hi;
      KWeights32<kFmt>(row, chunk, j, s, m, &w_lo, &w_hi);
      for (int b = 0; b < kRows; ++b) {
        const float* xb = x + (r0 + b) * in + chunk * kGroup;
        acc_lo[b] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xb), acc_lo[b]);
        acc_hi[b] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xb + 16), acc_hi[b]);
      }
    }
  }
  for (int b = 0; b < kRows; ++b) {
    out[(r0 + b) * out_dim + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[b], acc_hi[b]));
  }
}

// Output columns [o0, o1) of a K-quant matrix for `rows` float rows.
template <Format kFmt>
void KColumns(const float* x, int rows, int64_t in, const KWeight& w, float* out,
              int64_t out_dim, int64_t o0, int64_t o1) {
  static_assert(IsKQuant(kFmt));
  for (int64_t o = o0; o < o1; ++o) {
    const KWeight row = KRow<kFmt>(w, in, o);
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      XLASERVE_WITH_TILE_ROWS(std::min(kTileRows, rows - r0),
                              (KTile<kFmt, R>(x, r0, in, row, out, out_dim, o)));
    }
  }
}

// ---- K-quant codes for the integer tiles (quant_int.h) ----

// Q6_K's high-bit bytes: 128-bit lane L of the pair layout takes the 4 q_high bytes
// (16 inputs) at 4 * {0, 2, 1, 3}[L]; byte i of the lane their byte i / 4.
alignas(64) inline constexpr uint8_t kQ6HighBytes[64] = {
    0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
    8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11,
    4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7,
    12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15};

// The 64 codes of pair p (groups 2p, 2p + 1) in the nibble-pair layout as bytes.
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i KPairCodes(
    const KWeight& row, int64_t p) {
  const __m512i y = _mm512_castsi256_si512(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.q + p * 32)));
  __m512i c = _mm512_and_si512(
      _mm512_inserti64x4(y, _mm512_castsi512_si256(_mm512_srli_epi16(y, 4)), 1),
      _mm512_set1_epi8(0x0F));
  if constexpr (kFmt == kQ5_K) {
    // Bytes 0-15: group 2p inputs 0-15, 16-31: 2p + 1 inputs 0-15, 32-47: 2p 16-31,
    // 48-63: 2p + 1 16-31; q_high holds each group's 32 bits in input order.
    uint64_t h;
    std::memcpy(&h, row.q_high + p * 8, 8);
    const uint64_t mask = (h & 0xFFFF) | (((h >> 32) & 0xFFFF) << 16) |
                          (((h >> 16) & 0xFFFF) << 32) | ((h >> 48) << 48);
    c = _mm512_mask_add_epi8(c, mask, c, _mm512_set1_epi8(16));
  } else if constexpr (kFmt == kQ6_K) {
    // Group-16 nibbles: qwords [g 0-7, g 16-23, g+1 0-7, g+1 16-23 | g 8-15, g 24-31,
    // g+1 8-15, g+1 24-31] -> the pair layout.
    c = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 4, 2, 6, 1, 5, 3, 7), c);
    const __m512i h = _mm512_shuffle_epi8(
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            row.q_high + p * 16))),
        _mm512_load_si512(kQ6HighBytes));
    const __mmask64 bit0 = _mm512_test_epi8_mask(h, _mm512_set1_epi32(0x40100401));
    const __mmask64 bit1 = _mm512_test_epi8_mask(h, _mm512_set1_epi32(static_cast<int>(0x80200802)));
    c = _mm512_mask_add_epi8(c, bit0, c, _mm512_set1_epi8(16));
    c = _mm512_mask_add_epi8(c, bit1, c, _mm512_set1_epi8(32));
  }
  return c;
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_KQUANT_DOT_H_
