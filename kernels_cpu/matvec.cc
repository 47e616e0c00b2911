// Quantized weight x float activation products for up to 32 rows, as XLA FFI
// custom calls (CPU), split by output columns over XLA's intra-op threads.
//
// y[B, O] = x[B, I] @ W^T, W stored [O, I] in groups of 32 inputs with a
// float16 scale per group, W = code * scale + min, in four code formats:
//   U8:   one-byte unsigned codes and a float16 min per group (xlaserve int8);
//   S8:   one-byte signed codes, no min (GGUF Q8_0);
//   Q4_1: 16 bytes per group, byte j holding input j in its low nibble and
//         input j + 16 in its high nibble, and a float16 min (GGUF Q4_1);
//   Q4_0: the same nibbles with min = -8 * scale (GGUF Q4_0).
// XLA:CPU computes this by writing a float32
// copy of W and reading it back in a dot; here each group of codes is
// converted in registers and multiplied into the rows, so W is read once, as
// bytes. Numerics: float32 products and sums, the same values as the XLA path
// up to summation order.
//
// Built by the package's own build (setup.py) with per-function target
// attributes, so the library loads on any x86-64 CPU; `xlaserve_native_isa()`
// says at run time whether this CPU has what the kernels use (AVX-512 F/BW/VL,
// F16C, FMA). Python (kernels_cpu/matvec.py) falls back to the XLA path
// otherwise. Docs: docs/performance.md, "Native CPU kernels".

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGroup = 32;
constexpr int kMaxRows = 32;
constexpr int kTileRows = 8;  // activation rows per pass (their register accumulators)

enum Format { kU8, kS8, kQ4_1, kQ4_0 };

constexpr bool HasMin(Format f) { return f == kU8 || f == kQ4_1; }
constexpr int64_t GroupBytes(Format f) { return f == kQ4_1 || f == kQ4_0 ? kGroup / 2 : kGroup; }

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

// Output columns [o0, o1) for activation rows [r0, r0 + rows), rows <= kTileRows.
template <Format kFmt>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void Tile(
    const float* x, int r0, int rows, int64_t in, const uint8_t* q, const uint16_t* s_row,
    const uint16_t* m_row, float* out, int64_t out_dim, int64_t o) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  __m512 acc[kTileRows];
  for (int b = 0; b < rows; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = std::min<int64_t>(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + g0));
    __m512 mv = _mm512_setzero_ps();
    if constexpr (HasMin(kFmt)) {
      mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_row + g0));
    } else if constexpr (kFmt == kQ4_0) {
      mv = _mm512_mul_ps(sv, _mm512_set1_ps(-8.0f));
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t g = g0 + k;
      const __m512i lane = _mm512_set1_epi32(static_cast<int>(k));
      const __m512 s = _mm512_permutexvar_ps(lane, sv);
      const __m512 m = _mm512_permutexvar_ps(lane, mv);
      __m512 c_lo, c_hi;
      Codes<kFmt>(q + g * group_bytes, &c_lo, &c_hi);
      const __m512 w_lo = _mm512_fmadd_ps(c_lo, s, m);
      const __m512 w_hi = _mm512_fmadd_ps(c_hi, s, m);
      for (int b = 0; b < rows; ++b) {
        const float* xb = x + (r0 + b) * in + g * kGroup;
        acc[b] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xb), acc[b]);
        acc[b] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xb + 16), acc[b]);
      }
    }
  }
  for (int b = 0; b < rows; ++b) out[(r0 + b) * out_dim + o] = _mm512_reduce_add_ps(acc[b]);
}

// Output columns [o0, o1) for all `rows` activation rows: each column's codes are
// read from memory once and converted once per tile of kTileRows rows (L1 hits).
template <Format kFmt>
void Columns(const float* x, int rows, int64_t in, const uint8_t* codes, const uint16_t* scale,
             const uint16_t* offset, float* out, int64_t out_dim, int64_t o0, int64_t o1) {
  const int64_t groups = in / kGroup;
  const int64_t group_bytes = GroupBytes(kFmt);
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * groups * group_bytes;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    for (int r0 = 0; r0 < rows; r0 += kTileRows) {
      Tile<kFmt>(x, r0, std::min(kTileRows, rows - r0), in, q, scale + o * groups, m_row, out,
                 out_dim, o);
    }
  }
}

ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& codes, ffi::Buffer<ffi::F16>& scale,
                       int64_t group_bytes, int64_t& rows, int64_t& in, int64_t& out_dim) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("quantized matvec: x, codes and scale must be 2-D");
  }
  rows = xd[0];
  in = xd[1];
  out_dim = cd[0];
  if (rows < 1 || rows > kMaxRows || in % kGroup || cd[1] != in / kGroup * group_bytes ||
      sd[0] != out_dim || sd[1] != in / kGroup) {
    return ffi::Error::InvalidArgument("quantized matvec: shapes do not match [B<=32, I] x "
                                       "[O, I/32 groups] with [O, I/32] scales");
  }
  return ffi::Error::Success();
}

// CheckShapes, then the offset operand of a format with a min (its pointer in `m`).
template <Format kFmt>
ffi::Error CheckOperands(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& codes,
                         ffi::Buffer<ffi::F16>& scale, ffi::Buffer<ffi::F16>& offset,
                         int64_t& rows, int64_t& in, int64_t& out_dim, const uint16_t*& m) {
  if (ffi::Error err = CheckShapes(x, codes, scale, GroupBytes(kFmt), rows, in, out_dim);
      err.failure()) {
    return err;
  }
  if constexpr (HasMin(kFmt)) {
    auto od = offset.dimensions();
    auto sd = scale.dimensions();
    if (od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]) {
      return ffi::Error::InvalidArgument("quantized matvec: offset must have the scale's shape");
    }
    m = reinterpret_cast<const uint16_t*>(offset.typed_data());
  }
  return ffi::Error::Success();
}

template <Format kFmt>
ffi::Error MatvecImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                      ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                      ffi::ResultBuffer<ffi::F32> out) {
  int64_t rows = 0, in = 0, out_dim = 0;
  const uint16_t* m = nullptr;
  if (ffi::Error err = CheckOperands<kFmt>(x, codes, scale, offset, rows, in, out_dim, m);
      err.failure()) {
    return err;
  }
  const float* xs = x.typed_data();
  const auto* q = reinterpret_cast<const uint8_t*>(codes.untyped_data());
  const auto* s = reinterpret_cast<const uint16_t*>(scale.typed_data());
  float* y = out->typed_data();
  // Column ranges over the caller and XLA's intra-op threads (parallel.h): a few
  // per thread, so a thread that starts late still finds work.
  const int64_t parts = std::min<int64_t>(out_dim, 4 * (pool.num_threads() + 1));
  xlaserve::ParallelFor(pool, parts, [=](int64_t i) {
    Columns<kFmt>(xs, static_cast<int>(rows), in, q, s, m, y, out_dim, out_dim * i / parts,
                  out_dim * (i + 1) / parts);
  });
  return ffi::Error::Success();
}

// ---- Nibbles x int8 activations (VNNI), llama.cpp's Q4_1 x Q8 scheme ----
//
// Each row's activations are rounded per group of 32 to int8 with a float32 scale
// (dx = max|x| / 127) and laid out per pair of groups (g, g + 1) as the nibble
// bytes expand: [x_g[0:16], x_g+1[0:16], x_g[16:32], x_g+1[16:32]]. A pair's 32
// code bytes become 64 unsigned codes (low nibbles, then high) and one VPDPBUSD
// sums 4 code x activation products per int32 lane (lanes 0-3 and 8-11: group g,
// 4-7 and 12-15: g + 1); lanes are scaled by d * dx into float accumulators. The
// min (Q4_1: m; Q4_0: -8 d) multiplies the sum of each group's rounded x.
// Numerics: activations carry int8 rounding (relative ~1/254 of each group's max).

struct Q8Rows {
  std::vector<int8_t> xq;    // [rows, pairs, 64]
  std::vector<float> dx;     // [rows, pairs, 16] lane scales (dx_g, dx_g+1 pattern)
  std::vector<float> xsum;   // [rows, groups] sums of the rounded activations
};

__attribute__((target("avx512f,avx512bw,avx512vl"))) void QuantizeRows(
    const float* x, int rows, int64_t in, Q8Rows& r) {
  const int64_t groups = in / kGroup, pairs = groups / 2;
  r.xq.assign(rows * pairs * 64, 0);
  r.dx.assign(rows * pairs * 16, 0.0f);
  r.xsum.assign(rows * groups, 0.0f);
  for (int b = 0; b < rows; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + b * in + g * kGroup;
      const __m512 lo = _mm512_loadu_ps(xg), hi = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // in [-127, 127]
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      // The sum of the rounded values, so the min term rounds as the code term does
      // (their errors then cancel where W is small, as in llama.cpp's Q8_1 sums).
      r.xsum[b * groups + g] = d * static_cast<float>(
          _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      const int64_t p = g / 2, half = g % 2;
      int8_t* dst = r.xq.data() + (b * pairs + p) * 64;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * half), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 + 16 * half),
                       _mm512_cvtsepi32_epi8(qhi));
      float* lanes = r.dx.data() + (b * pairs + p) * 16;
      for (int j = 0; j < 4; ++j) lanes[4 * half + j] = lanes[8 + 4 * half + j] = d;
    }
  }
}

template <bool kMin>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma"))) void Q8Tile(
    const Q8Rows& r, int r0, int rows, int64_t groups, const uint8_t* q, const uint16_t* s_row,
    const uint16_t* m_row, float* out, int64_t out_dim, int64_t o) {
  const int64_t pairs = groups / 2;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[kTileRows];
  for (int b = 0; b < rows; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += 8) {  // 8 pairs = the 16 scales of one load
    const int64_t n = std::min<int64_t>(16, groups - 2 * p0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + 2 * p0));
    for (int64_t p = p0; p < std::min(pairs, p0 + 8); ++p) {
      const int k = static_cast<int>(2 * (p - p0));
      const __m512i idx = _mm512_set_epi32(k + 1, k + 1, k + 1, k + 1, k, k, k, k,
                                           k + 1, k + 1, k + 1, k + 1, k, k, k, k);
      const __m512 d = _mm512_permutexvar_ps(idx, dv);
      const __m512i y = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32)));
      const __m512i c = _mm512_and_si512(
          _mm512_inserti64x4(y, _mm512_castsi512_si256(_mm512_srli_epi16(y, 4)), 1), nib);
      for (int b = 0; b < rows; ++b) {
        const int64_t row = (r0 + b) * pairs + p;
        const __m512i dot = _mm512_dpbusd_epi32(
            _mm512_setzero_si512(), c, _mm512_loadu_si512(r.xq.data() + row * 64));
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(r.dx.data() + row * 16));
        acc[b] = _mm512_fmadd_ps(f, d, acc[b]);
      }
    }
  }
  for (int b = 0; b < rows; ++b) {
    __m512 mins = _mm512_setzero_ps();
    const float* xsum = r.xsum.data() + (r0 + b) * groups;
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t n = std::min<int64_t>(16, groups - g0);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const __m512 mv = kMin ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_row + g0))
                             : _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + g0)),
                                             _mm512_set1_ps(-8.0f));
      mins = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, xsum + g0), mins);
    }
    out[(r0 + b) * out_dim + o] = _mm512_reduce_add_ps(acc[b]) + _mm512_reduce_add_ps(mins);
  }
}

template <Format kFmt>
ffi::Error MatvecQ8Impl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                        ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                        ffi::ResultBuffer<ffi::F32> out) {
  static_assert(kFmt == kQ4_1 || kFmt == kQ4_0);
  int64_t rows = 0, in = 0, out_dim = 0;
  const uint16_t* m = nullptr;
  if (ffi::Error err = CheckOperands<kFmt>(x, codes, scale, offset, rows, in, out_dim, m);
      err.failure()) {
    return err;
  }
  const int64_t groups = in / kGroup;
  if (groups % 2) {
    return ffi::Error::InvalidArgument("quantized matvec (int8 activations): odd group count");
  }
  auto r = std::make_shared<Q8Rows>();
  QuantizeRows(x.typed_data(), static_cast<int>(rows), in, *r);
  const auto* q = reinterpret_cast<const uint8_t*>(codes.untyped_data());
  const auto* s = reinterpret_cast<const uint16_t*>(scale.typed_data());
  float* y = out->typed_data();
  const int64_t parts = std::min<int64_t>(out_dim, 4 * (pool.num_threads() + 1));
  const int nrows = static_cast<int>(rows);
  xlaserve::ParallelFor(pool, parts, [=](int64_t i) {
    for (int64_t o = out_dim * i / parts; o < out_dim * (i + 1) / parts; ++o) {
      for (int r0 = 0; r0 < nrows; r0 += kTileRows) {
        Q8Tile<HasMin(kFmt)>(*r, r0, std::min(kTileRows, nrows - r0), groups,
                             q + o * groups * 16, s + o * groups,
                             m == nullptr ? nullptr : m + o * groups, y, out_dim, o);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int xlaserve_native_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") ? 1 : 0;
}

extern "C" int xlaserve_native_isa() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("fma");
  return ok ? 1 : 0;
}

// Every handler takes x, codes, scales and an offset operand, and returns [B, O].
inline auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

// Formats with a min (U8: xlaserve's int8 groups; Q4_1) take the mins as the offset
// operand; the others (S8: GGUF Q8_0; Q4_0) ignore it (pass the scales again).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecU8, MatvecImpl<kU8>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8, MatvecImpl<kS8>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1, MatvecImpl<kQ4_1>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0, MatvecImpl<kQ4_0>, Binding());
// The same operands, activations rounded to int8 (VNNI; needs xlaserve_native_vnni()).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q8, MatvecQ8Impl<kQ4_1>, Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q8, MatvecQ8Impl<kQ4_0>, Binding());
