// Quantized weight x float activation products for up to 8192 rows, as XLA FFI
// custom calls (CPU), split by row blocks x output columns over XLA's intra-op
// threads (quant_gemm.h).
//
// y[B, O] = x[B, I] @ W^T, W stored [O, I] in groups of 32 inputs with a
// float16 scale per group, W = code * scale + min, in four code formats:
//   U8:   one-byte unsigned codes and a float16 min per group (xlaserve int8);
//   S8:   one-byte signed codes, no min (GGUF Q8_0);
//   Q4_1: 16 bytes per group, byte j holding input j in its low nibble and
//         input j + 16 in its high nibble, and a float16 min (GGUF Q4_1);
//   Q4_0: the same nibbles with min = -8 * scale (GGUF Q4_0).
// GGUF K-quants (Q4_K, Q5_K, Q6_K; kquant_dot.h) take their own operands: codes,
// scale and min codes, the high-bit plane and float16 super-block scales.
// XLA:CPU computes this by writing a float32
// copy of W and reading it back in a dot; here each group of codes is
// converted in registers and multiplied into the rows, so W is read once, as
// bytes. Numerics: float32 products and sums, the same values as the XLA path
// up to summation order; the integer-activation variants (nibbles, Q8_0) round
// the activations per group to 8 or 16 bits first (quant_dot.h) and take exact
// per-group integer dot products (VNNI, or AMX-INT8 where the CPU and Linux allow:
// quant_int.h; the same bits either way).
//
// Built by the package's own build (setup.py) with per-function target
// attributes, so the library loads on any x86-64 CPU; `xlaserve_native_isa()`
// says at run time whether this CPU has what the kernels use (AVX-512 F/BW/VL,
// F16C, FMA), `xlaserve_native_avx2()` the same for the AVX2 set. On aarch64 the
// same file builds the NEON set alone (quant_dot_neon.h: the `...Neon` handlers of
// the groups-of-32 formats; no K-quant handlers). Python (kernels_cpu/library.py)
// falls back to the XLA path otherwise. Docs: docs/performance.md, "Native CPU kernels".

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "parallel.h"
#include "quant_format.h"
#if defined(__x86_64__)
#include "kquant_dot.h"
#include "quant_dot.h"
#include "quant_dot_avx2.h"
#include "quant_gemm.h"
#include "quant_int.h"
#elif defined(__aarch64__)
#include "quant_dot_neon.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve;  // NOLINT: the kernels' building blocks (quant_dot.h)

// The unblocked column loops beside the AVX-512 set: AVX2 on x86-64, NEON on aarch64
// (the same entry points: GroupSums, Columns, PrepareRows, QuantizeRowRange,
// IntColumns, kIntCols).
#if defined(__x86_64__)
namespace narrow = xlaserve::avx2;
#elif defined(__aarch64__)
namespace narrow = xlaserve::neon;
#endif

// The AVX-512 set's blocked drivers (x86-64 only; defined below): float activations,
// and activations rounded to 8 or 16 bits (kLo).
template <Format kFmt>
void BlockedMatvec(xla::ffi::ThreadPool& pool, const float* xs, int64_t rows, int64_t in,
                   const uint8_t* q, const uint16_t* s, const uint16_t* m, float* y,
                   int64_t out_dim);
template <Format kFmt, bool kLo>
void BlockedIntMatvec(xla::ffi::ThreadPool& pool, const float* xs, int64_t rows,
                      const IntWeight& w, float* y, int64_t out_dim);

// Activation rows one call takes (matvec.py's MAX_ROWS): prefill chunks and large
// decode batches; the drivers block any count into row tiles (quant_gemm.h).
constexpr int64_t kMaxCallRows = 8192;

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
  if (rows < 1 || rows > kMaxCallRows || in % kGroup || cd[1] != in / kGroup * group_bytes ||
      sd[0] != out_dim || sd[1] != in / kGroup) {
    return ffi::Error::InvalidArgument("quantized matvec: shapes do not match [B<=8192, I] x "
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

template <Isa kIsa, Format kFmt>
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
  if constexpr (kIsa == Isa::kAvx512) {
    BlockedMatvec<kFmt>(pool, xs, rows, in, q, s, m, y, out_dim);
    return ffi::Error::Success();
  }
  // Unblocked column loops (quant_dot_avx2.h, quant_dot_neon.h).
  auto sums = std::make_shared<std::vector<float>>(rows * (in / kGroup));
  narrow::GroupSums(xs, static_cast<int>(rows), in, sums->data());
  const int64_t parts = std::min<int64_t>(out_dim, 4 * (pool.num_threads() + 1));
  xlaserve::ParallelFor(pool, parts, [=](int64_t i) {
    narrow::Columns<kFmt>(xs, sums->data(), static_cast<int>(rows), in, q, s, m, y, out_dim,
                          out_dim * i / parts, out_dim * (i + 1) / parts);
  });
  return ffi::Error::Success();
}

// Integer activations (VNNI; AVX2 int16 products): kBits 8 (llama.cpp's scheme) or 16
// (quant_dot.h). kTiled: the weight in the column-tiled layout (quant_format.h
// `IntWeight::tiled`; the AVX-512 set only).
template <Isa kIsa, Format kFmt, int kBits, bool kTiled = false>
ffi::Error MatvecIntImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                         ffi::Buffer<ffi::F16> scale, ffi::Buffer<ffi::F16> offset,
                         ffi::ResultBuffer<ffi::F32> out) {
  static_assert(kFmt == kQ4_1 || kFmt == kQ4_0 || kFmt == kS8);
  static_assert(kBits == 8 || kBits == 16);
  static_assert(!kTiled || kIsa == Isa::kAvx512);
  int64_t rows = 0, in = 0, out_dim = 0;
  const uint16_t* m = nullptr;
  if (ffi::Error err = CheckOperands<kFmt>(x, codes, scale, offset, rows, in, out_dim, m);
      err.failure()) {
    return err;
  }
  const int64_t groups = in / kGroup;
  if (groups % 2) {
    return ffi::Error::InvalidArgument("quantized matvec (integer activations): odd group count");
  }
  if (kTiled && out_dim % kTileCols) {
    return ffi::Error::InvalidArgument("quantized matvec (column tiles): O not a multiple of 16");
  }
  constexpr bool kLo = kBits == 16;
  const float* xs = x.typed_data();
  const auto* q = reinterpret_cast<const uint8_t*>(codes.untyped_data());
  const auto* s = reinterpret_cast<const uint16_t*>(scale.typed_data());
  float* y = out->typed_data();
  if constexpr (kIsa == Isa::kAvx512) {
    IntWeight w;
    w.in = in;
    w.codes = q;
    w.scale = s;
    w.offset = m;
    w.tiled = kTiled;
    BlockedIntMatvec<kFmt, kLo>(pool, xs, rows, w, y, out_dim);
    return ffi::Error::Success();
  }
  // Exact tiles of kIntCols columns (quant_dot_avx2.h, quant_dot_neon.h).
  auto r = std::make_shared<IntRows>();
  narrow::PrepareRows(static_cast<int>(rows), in, kLo, *r);
  constexpr int64_t kQuantizeRows = 64;
  xlaserve::ParallelFor(pool, (rows + kQuantizeRows - 1) / kQuantizeRows, [=](int64_t i) {
    narrow::QuantizeRowRange(xs, static_cast<int>(i * kQuantizeRows),
                             static_cast<int>(std::min(rows, (i + 1) * kQuantizeRows)), in, *r);
  });
  // Row blocks (their rounded activations stay in L2 while a column range passes) x
  // column ranges of whole kIntCols-column tiles.
  constexpr int64_t kRowBlock = 64;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t parts = std::max<int64_t>(
      1, std::min<int64_t>(out_dim / narrow::kIntCols, 4 * (pool.num_threads() + 1)));
  auto edge = [=](int64_t k) {
    return k == parts ? out_dim : out_dim * k / parts / narrow::kIntCols * narrow::kIntCols;
  };
  xlaserve::ParallelFor(pool, row_blocks * parts, [=](int64_t i) {
    const int64_t rb = i / parts, cp = i % parts;
    const int b0 = static_cast<int>(rb * kRowBlock);
    const int b1 = static_cast<int>(std::min(rows, b0 + kRowBlock));
    narrow::IntColumns<kFmt>(*r, kLo, b0, b1, in, q, s, m, y, out_dim, edge(cp), edge(cp + 1));
  });
  return ffi::Error::Success();
}

#if defined(__x86_64__)
template <Format kFmt>
void BlockedMatvec(xla::ffi::ThreadPool& pool, const float* xs, int64_t rows, int64_t in,
                   const uint8_t* q, const uint16_t* s, const uint16_t* m, float* y,
                   int64_t out_dim) {
  const int64_t groups = in / kGroup;
  auto sums = std::make_shared<std::vector<float>>(rows * groups);
  GroupSums(xs, static_cast<int>(rows), in, sums->data());
  // Row blocks x column ranges over the caller and XLA's intra-op threads
  // (quant_gemm.h, parallel.h).
  const Plan plan = PlanBlocks(rows, out_dim, in * sizeof(float), ThreadLimit(pool));
  xlaserve::ParallelFor(pool, plan.items(), [=](int64_t i) {
    const int64_t rb = i / plan.col_parts, cp = i % plan.col_parts;
    const int r0 = static_cast<int>(rb * plan.row_block);
    const int r1 = static_cast<int>(std::min(rows, r0 + plan.row_block));
    BlockColumns<kFmt>(xs, sums->data(), r0, r1, in, q, s, m, y, out_dim,
                       out_dim * cp / plan.col_parts, out_dim * (cp + 1) / plan.col_parts);
  });
}

template <Format kFmt, bool kLo>
void BlockedIntMatvec(xla::ffi::ThreadPool& pool, const float* xs, int64_t rows,
                      const IntWeight& w, float* y, int64_t out_dim) {
  const int64_t in = w.in, groups = in / kGroup;
  auto r = std::make_shared<IntRows>();
  // Only the layouts this format's tiles read: the nibble tiles' order (VNNI), the
  // input order (Q8_0's VNNI tiles, the column-tiled layout's) and the AMX A tiles
  // (`AmxFormat`; quant_int.h).
  r->nibble_order = kFmt != kS8 && !w.tiled;
  r->plain_order = kFmt == kS8 || w.tiled;
  r->amx_order = AmxFormat(kFmt, w.tiled);
  PrepareRows(static_cast<int>(rows), in, kLo, *r);
  // Rounding the rows: in blocks over the threads where there are many.
  constexpr int64_t kQuantizeRows = 64;
  xlaserve::ParallelFor(pool, (rows + kQuantizeRows - 1) / kQuantizeRows, [=](int64_t i) {
    QuantizeRowRange(xs, static_cast<int>(i * kQuantizeRows),
                     static_cast<int>(std::min(rows, (i + 1) * kQuantizeRows)), in, *r);
  });
  // A row's int8 bytes, 16-float lane scales per pair and sums (quant_dot.h).
  const int64_t row_bytes = in * (kLo ? 2 : 1) + (groups / 2) * 64 + groups * 4;
  // Row blocks of whole 16-row tiles (the AMX tiles', quant_int.h), up to 256 rows and
  // ~2 MiB of activations (L2), each column tile's packed codes meeting all of them
  // (1 MiB measured 1.2-1.3x slower at 8192 inputs).
  const Plan plan = PlanBlocks(rows, out_dim, row_bytes, ThreadLimit(pool), 2 << 20, kAmxRows,
                               256);
  xlaserve::ParallelFor(pool, plan.items(), [=](int64_t i) {
    const int64_t rb = i / plan.col_parts, cp = i % plan.col_parts;
    const int r0 = static_cast<int>(rb * plan.row_block);
    const int r1 = static_cast<int>(std::min(rows, r0 + plan.row_block));
    // Column ranges of whole 16-column tiles (the integer tiles' width).
    auto edge = [&](int64_t k) {
      return k == plan.col_parts ? out_dim : out_dim * k / plan.col_parts / 16 * 16;
    };
    ExactIntColumns<kFmt, kLo>(*r, r0, r1, w, y, out_dim, edge(cp), edge(cp + 1));
  });
}

// K-quants (kquant_dot.h): the operands of `kFmt` checked against x [B, I] (I a
// multiple of 256), their pointers in `w`.
template <Format kFmt>
ffi::Error CheckKOperands(ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& q, ffi::AnyBuffer& scale,
                          ffi::AnyBuffer& offset, ffi::AnyBuffer& q_high,
                          ffi::Buffer<ffi::F16>& super_scale,
                          ffi::Buffer<ffi::F16>& super_offset, int64_t& rows, int64_t& in,
                          int64_t& out_dim, KWeight& w) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2) {
    return ffi::Error::InvalidArgument("K-quant matvec: x and codes must be 2-D");
  }
  rows = xd[0];
  in = xd[1];
  out_dim = qd[0];
  auto is_2d = [&](ffi::AnyBuffer& a, int64_t cols) {
    auto d = a.dimensions();
    return d.size() == 2 && d[0] == out_dim && d[1] == cols;
  };
  auto f16_2d = [&](ffi::Buffer<ffi::F16>& a, int64_t cols) {
    auto d = a.dimensions();
    return d.size() == 2 && d[0] == out_dim && d[1] == cols;
  };
  const ffi::DataType scale_type = kFmt == kQ6_K ? ffi::S8 : ffi::U8;
  bool ok = rows >= 1 && rows <= kMaxCallRows && in % kSuper == 0 && in > 0 &&
            q.element_type() == ffi::U8 && qd[1] == in / 2 &&
            scale.element_type() == scale_type && is_2d(scale, KScaleCount(kFmt, in)) &&
            f16_2d(super_scale, in / kSuper);
  if (kFmt != kQ6_K) {
    ok = ok && offset.element_type() == ffi::U8 && is_2d(offset, in / kGroup) &&
         f16_2d(super_offset, in / kSuper);
  }
  if (kFmt != kQ4_K) {
    ok = ok && q_high.element_type() == ffi::U8 && is_2d(q_high, KHighBytes(kFmt, in));
  }
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "K-quant matvec: operands do not match [B<=8192, I % 256 == 0] x codes [O, I/2], "
        "scale codes, q_high and float16 super-block scales");
  }
  w.q = reinterpret_cast<const uint8_t*>(q.untyped_data());
  w.scale = reinterpret_cast<const uint8_t*>(scale.untyped_data());
  w.super_scale = reinterpret_cast<const uint16_t*>(super_scale.typed_data());
  if (kFmt != kQ6_K) {
    w.offset = reinterpret_cast<const uint8_t*>(offset.untyped_data());
    w.super_offset = reinterpret_cast<const uint16_t*>(super_offset.typed_data());
  }
  if (kFmt != kQ4_K) w.q_high = reinterpret_cast<const uint8_t*>(q_high.untyped_data());
  return ffi::Error::Success();
}

// K-quants x float activations (kBits 32) or activations rounded per group of 32 to
// kBits 8 or 16 (VNNI); kTiled: the weight in the column-tiled layout (Q4_K, Q6_K).
template <Format kFmt, int kBits, bool kTiled = false>
ffi::Error KMatvecImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                       ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer q_high,
                       ffi::Buffer<ffi::F16> super_scale, ffi::Buffer<ffi::F16> super_offset,
                       ffi::ResultBuffer<ffi::F32> out) {
  static_assert(IsKQuant(kFmt) && (kBits == 8 || kBits == 16 || kBits == 32));
  static_assert(!kTiled || (TiledFormat(kFmt) && kBits != 32));
  int64_t rows = 0, in = 0, out_dim = 0;
  KWeight w;
  if (ffi::Error err = CheckKOperands<kFmt>(x, q, scale, offset, q_high, super_scale,
                                            super_offset, rows, in, out_dim, w);
      err.failure()) {
    return err;
  }
  if (kTiled && out_dim % kTileCols) {
    return ffi::Error::InvalidArgument("K-quant matvec (column tiles): O not a multiple of 16");
  }
  const float* xs = x.typed_data();
  float* y = out->typed_data();
  if constexpr (kBits != 32) {  // the integer tiles (quant_int.h), as the other formats'
    IntWeight iw;
    iw.in = in;
    iw.k = w;
    iw.tiled = kTiled;
    BlockedIntMatvec<kFmt, kBits == 16>(pool, xs, rows, iw, y, out_dim);
    return ffi::Error::Success();
  }
  const int64_t parts = std::min<int64_t>(out_dim, 4 * (pool.num_threads() + 1));
  // Row blocks of kMaxRows (their activations stay in L2 while every column passes);
  // each row is computed by the same operations whatever the block (batch invariance).
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
    const int nrows = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
    const float* xb = xs + r0 * in;
    float* yb = y + r0 * out_dim;
    xlaserve::ParallelFor(pool, parts, [=](int64_t i) {
      KColumns<kFmt>(xb, nrows, in, w, yb, out_dim, out_dim * i / parts,
                     out_dim * (i + 1) / parts);
    });
  }
  return ffi::Error::Success();
}
#endif  // defined(__x86_64__)

}  // namespace

// The rows one matvec call takes (matvec.py's MAX_ROWS). library.py requires this
// symbol, so a library built before calls took more than 32 rows is not used (the
// XLA path) rather than failing calls of more rows.
extern "C" int64_t xlaserve_matvec_max_rows() { return kMaxCallRows; }

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

#if defined(__aarch64__)
// Whether this CPU runs the NEON handlers (the `...Neon` symbols): Advanced SIMD, the
// aarch64 baseline (HWCAP_ASIMD), with float16 conversions (HWCAP_FP).
extern "C" int xlaserve_native_neon() {
  constexpr uint64_t kHwcapFp = 1u << 0, kHwcapAsimd = 1u << 1;
  const uint64_t hw = getauxval(AT_HWCAP);
  return (hw & kHwcapFp) && (hw & kHwcapAsimd) ? 1 : 0;
}

// Whether the NEON integer tiles use SDOT here (HWCAP_ASIMDDP; XLASERVE_NATIVE_SDOT=0
// turns it off). Same results either way.
extern "C" int xlaserve_native_sdot() { return neon::SdotEnabled() ? 1 : 0; }

// The NEON set (quant_dot_neon.h): the same operands and numerics as the x86 sets'
// handlers below; kernels_cpu/library.py registers them under `..._neon` targets.
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecU8Neon, (MatvecImpl<Isa::kNeon, kU8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Neon, (MatvecImpl<Isa::kNeon, kS8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Neon, (MatvecImpl<Isa::kNeon, kQ4_1>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Neon, (MatvecImpl<Isa::kNeon, kQ4_0>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q8Neon, (MatvecIntImpl<Isa::kNeon, kQ4_1, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q8Neon, (MatvecIntImpl<Isa::kNeon, kQ4_0, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q8Neon, (MatvecIntImpl<Isa::kNeon, kS8, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q16Neon, (MatvecIntImpl<Isa::kNeon, kQ4_1, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q16Neon, (MatvecIntImpl<Isa::kNeon, kQ4_0, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q16Neon, (MatvecIntImpl<Isa::kNeon, kS8, 16>),
                              Binding());
#endif  // defined(__aarch64__)

#if defined(__x86_64__)
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

// Whether the integer tiles use AMX-INT8 here (quant_int.h: the CPU has it and Linux
// grants the tile state; XLASERVE_NATIVE_AMX=0 turns it off). Same results either way.
extern "C" int xlaserve_native_amx() { return AmxEnabled() ? 1 : 0; }

// Whether this CPU runs the AVX2 handlers (the `...Avx2` symbols): AVX2, FMA, F16C.
extern "C" int xlaserve_native_avx2() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("f16c");
  return ok ? 1 : 0;
}

// Formats with a min (U8: xlaserve's int8 groups; Q4_1) take the mins as the offset
// operand; the others (S8: GGUF Q8_0; Q4_0) ignore it (pass the scales again).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecU8, (MatvecImpl<Isa::kAvx512, kU8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8, (MatvecImpl<Isa::kAvx512, kS8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1, (MatvecImpl<Isa::kAvx512, kQ4_1>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0, (MatvecImpl<Isa::kAvx512, kQ4_0>), Binding());
// The float-activation handlers for CPUs with AVX2 + FMA + F16C but no AVX-512
// (quant_dot_avx2.h; kernels_cpu/library.py registers one set or the other).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecU8Avx2, (MatvecImpl<Isa::kAvx2, kU8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Avx2, (MatvecImpl<Isa::kAvx2, kS8>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Avx2, (MatvecImpl<Isa::kAvx2, kQ4_1>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Avx2, (MatvecImpl<Isa::kAvx2, kQ4_0>), Binding());
// The same operands, activations rounded per group to int8 or to 16 bits (VNNI;
// needs xlaserve_native_vnni()): nibbles and Q8_0.
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q8, (MatvecIntImpl<Isa::kAvx512, kQ4_1, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q8, (MatvecIntImpl<Isa::kAvx512, kQ4_0, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q8, (MatvecIntImpl<Isa::kAvx512, kS8, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q16, (MatvecIntImpl<Isa::kAvx512, kQ4_1, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q16, (MatvecIntImpl<Isa::kAvx512, kQ4_0, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q16, (MatvecIntImpl<Isa::kAvx512, kS8, 16>),
                              Binding());
// The same with the weight in the column-tiled layout (quant_format.h `IntWeight::tiled`;
// AVX-512 only: the AVX2 and NEON sets have no such handlers).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q8Tiled,
                              (MatvecIntImpl<Isa::kAvx512, kQ4_1, 8, true>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q8Tiled,
                              (MatvecIntImpl<Isa::kAvx512, kQ4_0, 8, true>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q8Tiled, (MatvecIntImpl<Isa::kAvx512, kS8, 8, true>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q16Tiled,
                              (MatvecIntImpl<Isa::kAvx512, kQ4_1, 16, true>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q16Tiled,
                              (MatvecIntImpl<Isa::kAvx512, kQ4_0, 16, true>), Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q16Tiled,
                              (MatvecIntImpl<Isa::kAvx512, kS8, 16, true>), Binding());
// The same on AVX2 (quant_dot_avx2.h: int16 products instead of VNNI).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q8Avx2, (MatvecIntImpl<Isa::kAvx2, kQ4_1, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q8Avx2, (MatvecIntImpl<Isa::kAvx2, kQ4_0, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q8Avx2, (MatvecIntImpl<Isa::kAvx2, kS8, 8>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_1Q16Avx2, (MatvecIntImpl<Isa::kAvx2, kQ4_1, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4_0Q16Avx2, (MatvecIntImpl<Isa::kAvx2, kQ4_0, 16>),
                              Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecS8Q16Avx2, (MatvecIntImpl<Isa::kAvx2, kS8, 16>),
                              Binding());

// K-quants: x, codes, scale codes, min codes, q_high, super scales, super mins (an
// operand a format lacks: any array of the right rank, e.g. the scale codes again).
inline auto KBinding() {
  return ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Arg<ffi::Buffer<ffi::F16>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4K, (KMatvecImpl<kQ4_K, 32>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ5K, (KMatvecImpl<kQ5_K, 32>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ6K, (KMatvecImpl<kQ6_K, 32>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4KQ8, (KMatvecImpl<kQ4_K, 8>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ5KQ8, (KMatvecImpl<kQ5_K, 8>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ6KQ8, (KMatvecImpl<kQ6_K, 8>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4KQ16, (KMatvecImpl<kQ4_K, 16>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ5KQ16, (KMatvecImpl<kQ5_K, 16>), KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ6KQ16, (KMatvecImpl<kQ6_K, 16>), KBinding());
// Q4_K and Q6_K in the column-tiled layout (quant_format.h `IntWeight::tiled`).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4KQ8Tiled, (KMatvecImpl<kQ4_K, 8, true>),
                              KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ4KQ16Tiled, (KMatvecImpl<kQ4_K, 16, true>),
                              KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ6KQ8Tiled, (KMatvecImpl<kQ6_K, 8, true>),
                              KBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveMatvecQ6KQ16Tiled, (KMatvecImpl<kQ6_K, 16, true>),
                              KBinding());
#endif  // defined(__x86_64__)
