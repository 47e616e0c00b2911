// Quantized weight x activation products for any number of rows: the blocked
// drivers behind the matvec custom calls (matvec.cc).
//
// `Columns` (quant_dot.h) and `IntColumns` (quant_int.h) loop per output column
// over all rows, which re-reads every row of x per column: fine for the few rows
// of a decode step, slow once x outgrows the caches (a prefill chunk). Here a call
// is cut into row blocks x column ranges (`Plan`), the work items of one
// ParallelFor; an item walks its column range in sub-blocks whose codes stay in
// L2, and within a sub-block each tile of rows (in L1 or L2) meets every column.
// Float activations: columns go four at a time through the `Wide*` tiles, which
// load each row's activations once for four columns. Integer activations: the
// block-exact tiles of quant_int.h (16 columns a tile; AMX for 16-row tiles).
//
// Batch invariance: every tile here computes each (row, column) output with
// exactly the operations, in the same order, as the one-column tiles of
// quant_dot.h (`Tile`; the integer tiles: quant_int.h's numerics), whatever the other rows and
// columns of the call, and a row's activations are rounded on their own
// (`QuantizeRowRange`). So a row's result is bitwise the same alone or among any
// number of other rows, and the same as the decoder's (decoder.cc).

#ifndef XLASERVE_KERNELS_CPU_QUANT_GEMM_H_
#define XLASERVE_KERNELS_CPU_QUANT_GEMM_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "quant_dot.h"
#include "quant_int.h"

namespace xlaserve {

// Wide tiles' activation rows x output columns, float activations:
// 16 accumulators in registers. (8 x 2, 4 x 3 and, for the integer tiles, 8 x 2
// measured no faster on an AVX-512 Xeon, in core-seconds at 256 rows.)
constexpr int kWideRows = 4, kWideCols = 4;

// Output columns [o, o + kCols) for activation rows [r0, r0 + kRows): `Tile`'s
// operations for each (row, column), the rows' activations loaded once per group
// for all kCols columns.
template <Format kFmt, int kRows, int kCols>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void WideTile(
    const float* x, const float* xsum, int r0, int64_t in, const uint8_t* codes,
    const uint16_t* scale, const uint16_t* offset, float* out, int64_t out_dim, int64_t o) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  __m512 acc[kCols][kRows], mins[kCols][kRows];
  for (int c = 0; c < kCols; ++c) {
    for (int b = 0; b < kRows; ++b) acc[c][b] = mins[c][b] = _mm512_setzero_ps();
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    alignas(64) float s16[kCols][16];
    for (int c = 0; c < kCols; ++c) {
      const uint16_t* s_row = scale + (o + c) * groups;
      const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + g0));
      if constexpr (kFmt != kS8) {
        const __m512 mv =
            HasMin(kFmt)
                ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, offset + (o + c) * groups + g0))
                : _mm512_mul_ps(sv, _mm512_set1_ps(-8.0f));
        for (int b = 0; b < kRows; ++b) {
          mins[c][b] = _mm512_fmadd_ps(
              mv, _mm512_maskz_loadu_ps(mask, xsum + (r0 + b) * groups + g0), mins[c][b]);
        }
      }
      _mm512_store_ps(s16[c], sv);
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t g = g0 + k;
      __m512 c_lo[kCols], c_hi[kCols], s[kCols];
      for (int c = 0; c < kCols; ++c) {
        Codes<kFmt>(codes + ((o + c) * groups + g) * group_bytes, &c_lo[c], &c_hi[c]);
        s[c] = _mm512_set1_ps(s16[c][k]);
      }
      for (int b = 0; b < kRows; ++b) {
        const float* xb = x + (r0 + b) * in + g * kGroup;
        const __m512 x_lo = _mm512_loadu_ps(xb), x_hi = _mm512_loadu_ps(xb + 16);
        for (int c = 0; c < kCols; ++c) {
          const __m512 dot = _mm512_fmadd_ps(c_hi[c], x_hi, _mm512_mul_ps(c_lo[c], x_lo));
          acc[c][b] = _mm512_fmadd_ps(dot, s[c], acc[c][b]);
        }
      }
    }
  }
  for (int c = 0; c < kCols; ++c) {
    for (int b = 0; b < kRows; ++b) {
      out[(r0 + b) * out_dim + o + c] =
          _mm512_reduce_add_ps(_mm512_add_ps(acc[c][b], mins[c][b]));
    }
  }
}

// How one call is cut: rows in blocks of `row_block`, columns in `col_parts`
// ranges; work item i is row block i / col_parts, column range i % col_parts.
struct Plan {
  int64_t row_block = 0, row_blocks = 0, col_parts = 0;
  int64_t items() const { return row_blocks * col_parts; }
};

// A plan for `rows` x `out_dim` over `threads` threads whose row blocks hold about
// `block_bytes` of activations (`row_bytes` a row) and whose items number at least
// four per thread where the columns allow (a thread that starts late still finds
// work, and two threads both work when the rows are few).
inline Plan PlanBlocks(int64_t rows, int64_t out_dim, int64_t row_bytes, int64_t threads,
                       int64_t block_bytes = 512 << 10, int64_t row_multiple = kTileRows,
                       int64_t max_rows = 64) {
  Plan p;
  p.row_block = std::clamp<int64_t>(block_bytes / std::max<int64_t>(row_bytes, 1) /
                                        row_multiple * row_multiple, row_multiple, max_rows);
  p.row_block = std::min(p.row_block, rows);
  p.row_blocks = (rows + p.row_block - 1) / p.row_block;
  const int64_t want = 4 * threads;
  p.col_parts = std::min(out_dim, std::max<int64_t>(1, (want + p.row_blocks - 1) / p.row_blocks));
  return p;
}

// The columns a sub-block holds so that its codes (`col_bytes` a column) stay in L2
// while each row tile passes over them: a multiple of kWideCols.
inline int64_t SubBlockColumns(int64_t col_bytes, int64_t bytes = 256 << 10) {
  return std::max<int64_t>(kWideCols, bytes / std::max<int64_t>(col_bytes, 1) / kWideCols *
                                          kWideCols);
}

// Calls wide(r0, o) for kWideRows rows x kWideCols columns and narrow(r0, rows, o)
// for one column of the rest (of every column with `narrow_only`), over rows
// [r_begin, r_end) x columns [o0, o1): per column sub-block of `sub` columns, each
// tile of up to kTileRows rows meets every column of the sub-block.
template <int kWideRows, int kWideCols, typename Wide, typename Narrow>
inline void BlockLoop(int r_begin, int r_end, int64_t o0, int64_t o1, int64_t sub,
                      bool narrow_only, Wide wide, Narrow narrow) {
  for (int64_t c0 = o0; c0 < o1; c0 += sub) {
    const int64_t c1 = std::min(o1, c0 + sub);
    for (int r0 = r_begin; r0 < r_end; r0 += kTileRows) {
      const int n = std::min(kTileRows, r_end - r0);
      const int wide_rows = narrow_only ? 0 : n / kWideRows * kWideRows;
      int64_t o = c0;
      if (wide_rows > 0) {
        for (; o + kWideCols <= c1; o += kWideCols) {
          for (int rr = 0; rr < wide_rows; rr += kWideRows) wide(r0 + rr, o);
        }
        if (wide_rows < n) {
          for (int64_t oc = c0; oc < o; ++oc) narrow(r0 + wide_rows, n - wide_rows, oc);
        }
      }
      for (; o < c1; ++o) narrow(r0, n, o);
    }
  }
}

// Whether rows [r_begin, r_end) (`row_bytes` of activations each) take the
// one-column tiles alone: one row tile (a decode step) of at most 64 KiB, where a
// tile converts each column's codes once for all its rows. Wider rows go through
// the wide tiles, which load them once per four columns. (Core-seconds at 8 rows:
// the one-column tiles ~1.1-1.4x faster at 2048 inputs, the wide ones ~1.3-1.5x
// at 8192.)
inline bool NarrowOnly(int r_begin, int r_end, int64_t row_bytes) {
  return r_end - r_begin <= kTileRows && (r_end - r_begin) * row_bytes <= (64 << 10);
}

// Float activations: output columns [o0, o1) for rows [r_begin, r_end) of x.
template <Format kFmt>
void BlockColumns(const float* x, const float* xsum, int r_begin, int r_end, int64_t in,
                  const uint8_t* codes, const uint16_t* scale, const uint16_t* offset,
                  float* out, int64_t out_dim, int64_t o0, int64_t o1) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  BlockLoop<kWideRows, kWideCols>(
      r_begin, r_end, o0, o1, SubBlockColumns(groups * group_bytes),
      NarrowOnly(r_begin, r_end, in * static_cast<int64_t>(sizeof(float))),
      [&](int r0, int64_t o) {
        WideTile<kFmt, kWideRows, kWideCols>(x, xsum, r0, in, codes, scale, offset, out,
                                             out_dim, o);
      },
      [&](int r0, int rows, int64_t o) {
        const uint8_t* q = codes + o * groups * group_bytes;
        const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
        XLASERVE_WITH_TILE_ROWS(rows, (Tile<kFmt, R>(x, xsum, r0, in, q, scale + o * groups,
                                                     m_row, out, out_dim, o)));
      });
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_QUANT_GEMM_H_
