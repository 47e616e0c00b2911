// Quantized weight x float activation products: the tiles shared by the matvec
// custom calls (matvec.cc, through the blocked drivers of quant_gemm.h) and the
// fused decoder layers (decoder.cc, through the column loops here).
//
// W is stored [O, I] in groups of 32 inputs with a float16 scale per group,
// W = code * scale + min, in four code formats:
//   U8:   one-byte unsigned codes and a float16 min per group (xlaserve int8);
//   S8:   one-byte signed codes, no min (GGUF Q8_0);
//   Q4_1: 16 bytes per group, byte j holding input j in its low nibble and
//         input j + 16 in its high nibble, and a float16 min (GGUF Q4_1);
//   Q4_0: the same nibbles with min = -8 * scale (GGUF Q4_0).
// `Columns` converts each group of codes in registers and multiplies it into
// up to kTileRows float rows at a time (float32 products and sums). The integer
// activations (`IntRows`, rounded per group to 8 bits, llama.cpp's Q4 x Q8 scheme,
// or 16 bits) are made here; the tiles that multiply nibbles / Q8_0 codes by them
// (`IntColumns`, VNNI and AMX, block-exact) are in quant_int.h.

#ifndef XLASERVE_KERNELS_CPU_QUANT_DOT_H_
#define XLASERVE_KERNELS_CPU_QUANT_DOT_H_

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant_format.h"

namespace xlaserve {

// The 32 codes of a group as two float32 vectors (inputs 0-15, 16-31).
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline void Codes(
    const uint8_t* q, __m512* lo, __m512* hi) {
  if constexpr (kFmt == kU8 || kFmt == kS8) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m128i c0 = _mm256_castsi256_si128(c), c1 = _mm256_extracti128_si256(c, 1);
    if constexpr (kFmt == kS8) {
      *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0));
      *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1));
    } else {
      *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0));
      *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1));
    }
  } else {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
}

// Sums of each group of 32 activations, xsum[b, g] (the min term of a float tile).
inline __attribute__((target("avx512f"))) void GroupSums(const float* x, int rows, int64_t in,
                                                        float* xsum) {
  const int64_t groups = in / kGroup;
  for (int b = 0; b < rows; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      xsum[b * groups + g] =
          _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)));
    }
  }
}

// Output column o for activation rows [r0, r0 + kRows), kRows <= kTileRows, as
// sum_g (s_g * sum_i c_i x_i + m_g * xsum_g): per group the codes times x (two
// FMA chains), scaled once; the mins meet the group sums of x (`GroupSums`) at
// the end. Float32 throughout; the same value as sum_i (c_i s_g + m_g) x_i up to
// rounding.
template <Format kFmt, int kRows>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void Tile(
    const float* x, const float* xsum, int r0, int64_t in, const uint8_t* q,
    const uint16_t* s_row, const uint16_t* m_row, float* out, int64_t out_dim, int64_t o) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  __m512 acc[kRows], mins[kRows];
  for (int b = 0; b < kRows; ++b) acc[b] = mins[b] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + g0));
    if constexpr (kFmt != kS8) {
      const __m512 mv = HasMin(kFmt) ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_row + g0))
                                     : _mm512_mul_ps(sv, _mm512_set1_ps(-8.0f));
      for (int b = 0; b < kRows; ++b) {
        mins[b] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, xsum + (r0 + b) * groups + g0),
                                  mins[b]);
      }
    }
    // The 16 groups' scales as floats in L1: each group broadcasts its own from
    // memory (a load, not a shuffle on the vector ports the conversions need).
    alignas(64) float s16[16];
    _mm512_store_ps(s16, sv);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t g = g0 + k;
      const __m512 s = _mm512_set1_ps(s16[k]);
      __m512 c_lo, c_hi;
      Codes<kFmt>(q + g * group_bytes, &c_lo, &c_hi);
      for (int b = 0; b < kRows; ++b) {
        const float* xb = x + (r0 + b) * in + g * kGroup;
        const __m512 dot = _mm512_fmadd_ps(c_hi, _mm512_loadu_ps(xb + 16),
                                           _mm512_mul_ps(c_lo, _mm512_loadu_ps(xb)));
        acc[b] = _mm512_fmadd_ps(dot, s, acc[b]);
      }
    }
  }
  for (int b = 0; b < kRows; ++b) {
    out[(r0 + b) * out_dim + o] = _mm512_reduce_add_ps(_mm512_add_ps(acc[b], mins[b]));
  }
}


// Output columns [o0, o1) for all `rows` activation rows (xsum: their GroupSums):
// each column's codes are read from memory once and converted once per tile of
// kTileRows rows (L1 hits).
template <Format kFmt>
void Columns(const float* x, const float* xsum, int rows, int64_t in, const uint8_t* codes,
             const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim,
             int64_t o0, int64_t o1) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * groups * group_bytes;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      XLASERVE_WITH_TILE_ROWS(std::min(kTileRows, rows - r0),
                              (Tile<kFmt, R>(x, xsum, r0, in, q, scale + o * groups, m_row, out,
                                             out_dim, o)));
    }
  }
}

// ---- Nibbles x integer activations (VNNI), llama.cpp's Q4_1 x Q8 scheme ----
//
// Each row's activations are rounded per group of 32 to int8 with a float32 scale
// (dx = max|x| / 127): hi = round(x / dx) in [-127, 127]. With 16-bit activations
// the remainder is rounded too, lo = round((x / dx - hi) * 256) in [-127, 127], so
// x ~ dx / 256 * (256 hi + lo): 2^-16 of the group's max instead of 2^-8, at one
// more VPDPBUSD per 64 weights (the codes are unpacked once for both).
// Layout per pair of groups (g, g + 1), as the nibble bytes expand:
// [x_g[0:16], x_g+1[0:16], x_g[16:32], x_g+1[16:32]]. A pair's 32 code bytes become
// 64 unsigned codes (low nibbles, then high) and one VPDPBUSD sums 4 code x
// activation products per int32 lane (lanes 0-3 and 8-11: group g, 4-7 and 12-15:
// g + 1; `DotBytes`). quant_int.h reduces the lanes to exact per-group integers.
//
// Signed one-byte codes (Q8_0) take the same rounded activations in input order
// (`hi_plain`, `lo_plain`): a pair's 64 code bytes are groups g and g + 1 back to
// back, so int32 lanes 0-7 sum group g and 8-15 group g + 1. VPDPBUSD multiplies
// unsigned by signed bytes: it gets |w| and x with w's sign (hence lo >= -127).
// The AMX tiles (quant_int.h) read their own copy of the bytes, packed in 16-row A tiles
// (IntRows amx_a) while the rows are rounded.

// Rows from which a call of the column functions uses AMX tiles (16-row tiles; the
// rest of the rows take the VNNI tiles).
constexpr int kAmxRows = 16;

// Whether this CPU has AMX-TILE and AMX-INT8 and Linux lets the process use the
// tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asked once.
inline bool AmxHardware() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// AmxHardware() unless XLASERVE_NATIVE_AMX=0 (read at each call: tests compare both).
inline bool AmxEnabled() {
  const char* env = std::getenv("XLASERVE_NATIVE_AMX");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  return AmxHardware();
}

// Rows of `r` (rounded in `groups` groups) whose AMX A tiles it holds: its whole 16-row
// tiles where PrepareRows asked for them, else 0.
inline int64_t AmxPackedRows(const IntRows& r, int64_t groups) {
  return static_cast<int64_t>(r.amx_dx.size()) / (groups * 16) * kAmxRows;
}

// 16 activations of a group as int8 bytes (saturating; the values are in range).
inline __attribute__((target("avx512f"))) void StoreBytes(int8_t* dst, __m512i v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(v));
}

// Sizes `r` for `rows` rows of `in` inputs (an even number of groups, as the
// integer tiles take) rounded to 16 bits (`with_lo`) or 8, in the layouts its flags
// ask for. QuantizeRowRange writes every entry, so buffers are only grown.
inline void PrepareRows(int rows, int64_t in, bool with_lo, IntRows& r) {
  const int64_t groups = in / kGroup, pairs = groups / 2;
  auto size = [](auto& v, bool used, int64_t n) {
    if (used) {
      v.resize(n);
    } else {
      v.clear();
    }
  };
  r.has_lo = with_lo;
  size(r.hi, r.nibble_order, rows * pairs * 64);
  size(r.lo, r.nibble_order && with_lo, rows * pairs * 64);
  size(r.hi_plain, r.plain_order, rows * groups * kGroup);
  size(r.x8, false, 0);  // the AVX2 tiles' (quant_dot_avx2.h)
  size(r.x16, false, 0);
  size(r.lo_plain, r.plain_order && with_lo, rows * groups * kGroup);
  const bool amx = r.amx_order && rows >= kAmxRows && AmxEnabled();
  const int64_t tiles = rows / kAmxRows;
  size(r.amx_a, amx, tiles * groups * (with_lo ? 1024 : 512));
  size(r.amx_dx, amx, tiles * groups * 16);
  size(r.xsum8, true, rows * groups);
  size(r.xsum16, with_lo, rows * groups);
  size(r.dx_group, true, rows * groups);
  size(r.xint8, true, rows * groups);
  size(r.xint16, with_lo, rows * groups);
  size(r.xint8_half, true, rows * groups * 2);
  size(r.xint16_half, with_lo, rows * groups * 2);
}

// Rows [b0, b1) of x rounded per group into `r` (sized by PrepareRows); each row on
// its own, so any split of the rows gives the same bytes.
inline __attribute__((target("avx512f,avx512bw,avx512vl"))) void QuantizeRowRange(
    const float* x, int b0, int b1, int64_t in, IntRows& r) {
  const int64_t groups = in / kGroup, pairs = groups / 2;
  const bool with_lo = r.has_lo, nibbles = r.nibble_order, plain = r.plain_order;
  // Rows of whole 16-row tiles also go into their AMX A tile (PrepareRows sized them).
  const int64_t amx_rows = AmxPackedRows(r, groups);
  const int64_t tile_bytes = with_lo ? 1024 : 512;
  const __m512i lo_max = _mm512_set1_epi32(127), lo_min = _mm512_set1_epi32(-127);
  for (int b = b0; b < b1; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      const __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      const __m512 slo = _mm512_mul_ps(lo, inv), shi = _mm512_mul_ps(hi, inv);
      const __m512i qlo = _mm512_cvtps_epi32(slo);  // in [-127, 127]
      const __m512i qhi = _mm512_cvtps_epi32(shi);
      // The sum of the rounded values, so the min term rounds as the code term does
      // (their errors then cancel where W is small, as in llama.cpp's Q8_1 sums).
      const int32_t half8[2] = {_mm512_reduce_add_epi32(qlo), _mm512_reduce_add_epi32(qhi)};
      const int32_t sum8 = half8[0] + half8[1];
      r.xint8_half[(b * groups + g) * 2] = half8[0];
      r.xint8_half[(b * groups + g) * 2 + 1] = half8[1];
      r.xsum8[b * groups + g] = d * static_cast<float>(sum8);
      r.xint8[b * groups + g] = sum8;
      r.dx_group[b * groups + g] = d;
      // This row's place in its AMX A tile (quant_format.h IntRows amx_a).
      const bool amx = b < amx_rows;
      const int64_t tile_at = (b / kAmxRows * groups + g) * tile_bytes +
                              (with_lo ? (b % 16) / 8 * 512 + (b % 8) * kGroup : (b % 16) * kGroup);
      if (amx) {
        r.amx_dx[(b / kAmxRows * groups + g) * 16 + b % 16] = d;
        StoreBytes(r.amx_a.data() + tile_at, qlo);
        StoreBytes(r.amx_a.data() + tile_at + 16, qhi);
      }
      const int64_t p = g / 2, half = g % 2;
      const int64_t pair_at = (b * pairs + p) * 64, plain_at = (b * groups + g) * kGroup;
      if (nibbles) {
        StoreBytes(r.hi.data() + pair_at + 16 * half, qlo);
        StoreBytes(r.hi.data() + pair_at + 32 + 16 * half, qhi);
      }
      if (plain) {
        StoreBytes(r.hi_plain.data() + plain_at, qlo);
        StoreBytes(r.hi_plain.data() + plain_at + 16, qhi);
      }
      if (with_lo) {
        const __m512 k256 = _mm512_set1_ps(256.0f);
        const __m512i rlo = _mm512_max_epi32(lo_min, _mm512_min_epi32(lo_max, _mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_sub_ps(slo, _mm512_cvtepi32_ps(qlo)), k256))));
        const __m512i rhi = _mm512_max_epi32(lo_min, _mm512_min_epi32(lo_max, _mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_sub_ps(shi, _mm512_cvtepi32_ps(qhi)), k256))));
        const int32_t half_lo[2] = {_mm512_reduce_add_epi32(rlo), _mm512_reduce_add_epi32(rhi)};
        const int32_t sum_lo = half_lo[0] + half_lo[1];
        r.xint16[b * groups + g] = 256 * sum8 + sum_lo;
        r.xint16_half[(b * groups + g) * 2] = 256 * half8[0] + half_lo[0];
        r.xint16_half[(b * groups + g) * 2 + 1] = 256 * half8[1] + half_lo[1];
        r.xsum16[b * groups + g] = d * (static_cast<float>(sum8) +
                                        static_cast<float>(sum_lo) * (1.0f / 256.0f));
        if (nibbles) {
          StoreBytes(r.lo.data() + pair_at + 16 * half, rlo);
          StoreBytes(r.lo.data() + pair_at + 32 + 16 * half, rhi);
        }
        if (plain) {
          StoreBytes(r.lo_plain.data() + plain_at, rlo);
          StoreBytes(r.lo_plain.data() + plain_at + 16, rhi);
        }
        if (amx) {  // 8 rows' hi bytes, then their lo bytes
          StoreBytes(r.amx_a.data() + tile_at + 8 * kGroup, rlo);
          StoreBytes(r.amx_a.data() + tile_at + 8 * kGroup + 16, rhi);
        }
      }
    }
  }
}

// Rows of x rounded per group for the integer tiles (`with_lo`: to 16 bits), in the
// layouts r's flags ask for (both by default).
inline void QuantizeRows(const float* x, int rows, int64_t in, bool with_lo, IntRows& r) {
  PrepareRows(rows, in, with_lo, r);
  QuantizeRowRange(x, 0, rows, in, r);
}

// The int32 lanes of 64 unsigned codes times one pair of activation bytes: hi
// only, or 256 * (codes . hi) + codes . lo (16-bit activations).
template <bool kLo>
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline __m512i DotBytes(
    __m512i codes, __m512i hi, __m512i lo) {
  __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, hi);
  if constexpr (kLo) dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), codes, lo);
  return dot;
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_DOT_H_
