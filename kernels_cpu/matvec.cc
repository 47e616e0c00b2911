// int8 weight x float activation products for few rows, as XLA FFI custom calls (CPU).
//
// y[B, O] = x[B, I] @ W^T, W stored [O, I] as one-byte codes in groups of 32
// inputs with a float16 scale (and, for unsigned codes, a float16 min) per
// group: W = code * scale (+ min). XLA:CPU computes this by writing a float32
// copy of W and reading it back in a dot; here each group of codes is
// converted in registers and multiplied into the rows, so W is read once, as
// bytes. Numerics: float32 products and sums, the same values as the XLA path
// up to summation order.
//
// Built by the package's own build (setup.py) with per-function target
// attributes, so the library loads on any x86-64 CPU; `xlaserve_native_isa()`
// says at run time whether this CPU has what the kernels use (AVX-512 F/BW/VL,
// F16C, FMA). Python (kernels_cpu/matvec.py) falls back to the XLA path
// otherwise. Docs: docs/performance.md, "Native int8 matvec".

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kGroup = 32;
constexpr int kMaxRows = 8;

template <bool kSigned>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline __m512 Codes16(__m128i c) {
  return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c));
}

// Output rows [o0, o1) for B <= kMaxRows activation rows.
template <bool kSigned>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void Rows(
    const float* x, int rows, int64_t in, const uint8_t* codes, const uint16_t* scale,
    const uint16_t* offset, float* out, int64_t out_dim, int64_t o0, int64_t o1) {
  const int64_t groups = in / kGroup;
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* q = codes + o * in;
    const uint16_t* s_row = scale + o * groups;
    const uint16_t* m_row = offset == nullptr ? nullptr : offset + o * groups;
    __m512 acc[kMaxRows];
    for (int b = 0; b < rows; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
      const int64_t n = std::min<int64_t>(16, groups - g0);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const __m512 sv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s_row + g0));
      const __m512 mv = m_row == nullptr
                            ? _mm512_setzero_ps()
                            : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m_row + g0));
      for (int64_t k = 0; k < n; ++k) {
        const int64_t g = g0 + k;
        const __m512i lane = _mm512_set1_epi32(static_cast<int>(k));
        const __m512 s = _mm512_permutexvar_ps(lane, sv);
        const __m512 m = _mm512_permutexvar_ps(lane, mv);
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kGroup));
        const __m512 w_lo = _mm512_fmadd_ps(Codes16<kSigned>(_mm256_castsi256_si128(c)), s, m);
        const __m512 w_hi = _mm512_fmadd_ps(Codes16<kSigned>(_mm256_extracti128_si256(c, 1)), s, m);
        for (int b = 0; b < rows; ++b) {
          const float* xb = x + b * in + g * kGroup;
          acc[b] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xb), acc[b]);
          acc[b] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xb + 16), acc[b]);
        }
      }
    }
    for (int b = 0; b < rows; ++b) out[b * out_dim + o] = _mm512_reduce_add_ps(acc[b]);
  }
}

ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& codes, ffi::Buffer<ffi::F16>& scale,
                       int64_t& rows, int64_t& in, int64_t& out_dim) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("int8 matvec: x, codes and scale must be 2-D");
  }
  rows = xd[0];
  in = xd[1];
  out_dim = cd[0];
  if (rows < 1 || rows > kMaxRows || cd[1] != in || in % kGroup || sd[0] != out_dim ||
      sd[1] != in / kGroup) {
    return ffi::Error::InvalidArgument("int8 matvec: shapes do not match [B<=8, I] x [O, I] "
                                       "with [O, I/32] scales");
  }
  return ffi::Error::Success();
}

template <bool kSigned>
ffi::Error MatvecImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes, ffi::Buffer<ffi::F16> scale,
                      ffi::Buffer<ffi::F16> offset, ffi::ResultBuffer<ffi::F32> out) {
  int64_t rows = 0, in = 0, out_dim = 0;
  if (ffi::Error err = CheckShapes(x, codes, scale, rows, in, out_dim); err.failure()) return err;
  const uint16_t* m = nullptr;
  if (!kSigned) {
    auto od = offset.dimensions();
    auto sd = scale.dimensions();
    if (od.size() != 2 || od[0] != sd[0] || od[1] != sd[1]) {
      return ffi::Error::InvalidArgument("int8 matvec: offset must have the scale's shape");
    }
    m = reinterpret_cast<const uint16_t*>(offset.typed_data());
  }
  Rows<kSigned>(x.typed_data(), static_cast<int>(rows), in,
                reinterpret_cast<const uint8_t*>(codes.untyped_data()),
                reinterpret_cast<const uint16_t*>(scale.typed_data()), m, out->typed_data(),
                out_dim, 0, out_dim);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int xlaserve_native_isa() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("fma");
  return ok ? 1 : 0;
}

// Both handlers take x, codes, scales and an offset operand, and return [B, O].
inline auto Binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

// Unsigned codes with a min (xlaserve's int8 groups); the offset operand is the mins.
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecU8, MatvecImpl<false>, Binding());

// Signed codes (GGUF Q8_0); the offset operand is unused (pass the scales again).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8, MatvecImpl<true>, Binding());
