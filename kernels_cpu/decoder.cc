// The whole decoder stack of a Llama-family model for a decode step, in one
// XLA FFI custom call (CPU).
//
// h[B, D] -> h after L layers, each: RMSNorm, Q/K/V projections, RoPE, the
// new K/V written into the page pool, paged attention over the row's keys,
// the output projection, RMSNorm, SwiGLU MLP, with the residual adds. The
// linear weights are quantized groups as stored (quant_dot.h: U8, S8 / Q8_0,
// Q4_1, Q4_0; kquant_dot.h: Q4_K, Q5_K, Q6_K; all but U8 optionally times
// activations rounded per group to 8 or 16 bits), the pools
// are float32 or bfloat16 (attention.h kinds 0 and 1), updated in place (the
// jax side aliases them to the outputs).
//
// Why one call: per layer, the same work as separate custom calls took seven
// matvec calls, an attention call and the XLA glue between them, ~240 calls a
// step for SmolLM2, each waking XLA's pool threads for ~50-100 us of work.
// Here the helpers (parallel.h `Team`) stay for the whole stack and each
// matvec phase is a parallel loop over column blocks; the small serial parts
// (norms, RoPE, the K/V write, SiLU) run on the caller in between.
//
// Numerics: float32 throughout, the same operations as the XLA path
// (serving/models/llama.py, serving/models/layers.py) up to summation order and transcendental
// rounding; with integer activations, the same rounding points as the per-op
// native path (each projection's input rounded once per group of 32).
//
// Rows are independent decode positions, each with its own position, K/V index,
// block table and seq_len. Within a layer every row's K/V is written before any
// row attends, so a verify step (speculative decoding) is S rows per sequence at
// consecutive positions with seq_len = position + 1: position j sees the drafts
// before it.
//
// Operands (after the thread pool):
//   x [B, D] f32, positions [B] s32, kv_index [B] s32 (page * page_size +
//   offset, per-layer page ids), tables [B, W] s32 (per-layer page ids),
//   seq_lens [B] s32 (keys each row attends to, 0: padding), inv_freq [H/2]
//   f32, norms [L, 2, D] f32 (attention, MLP), k_pool, v_pool [L*P, ps, K, H],
//   then per layer and per weight (wq, wk, wv, wo, w_gate, w_up, w_down) six
//   operands: codes, scales, offsets, q_high, super scales, super offsets
//   (float16 scales and offsets [O, I/32] for the formats of groups of 32, the
//   scales again where a format has no offsets, its codes again for the three
//   K-quant operands; K-quants: kquant_dot.h `KWeight`, an operand a format
//   lacks: any array, e.g. the scale codes again).
// Attributes: formats [L*7] (quant_dot.h Format; +16: 8-bit, +32: 16-bit
//   integer activations),
//   num_heads, num_pages (P), window (0: none), kind (0 f32, 1 bf16 pages),
//   eps, scale.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <thread>
#include <vector>

#include "attention_pages.h"
#include "parallel.h"
#include "quant_format.h"
#if defined(__x86_64__)
#include <immintrin.h>

#include "attention.h"
#include "attention_avx2.h"
#include "kquant_dot.h"
#include "quant_dot.h"
#include "quant_dot_avx2.h"
#include "quant_int.h"
#elif defined(__aarch64__)
#include <arm_neon.h>

#include "attention_neon.h"
#include "quant_dot_neon.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve;  // NOLINT: the building blocks (quant_dot.h, attention.h)

// The column loops beside the AVX-512 set: AVX2 on x86-64, NEON on aarch64 (the same
// entry points; matvec.cc).
#if defined(__x86_64__)
namespace narrow = xlaserve::avx2;
#elif defined(__aarch64__)
namespace narrow = xlaserve::neon;
#endif

constexpr int kWeights = 7;  // wq, wk, wv, wo, w_gate, w_up, w_down
constexpr int kOperands = 6;   // per weight: codes, scale, offset, q_high, super scale, offset
constexpr int kFormatMask = 15;  // formats[i] & kFormatMask: the Format
constexpr int kInt8Flag = 16;  // formats[i] & kInt8Flag: activations rounded to 8 bits
constexpr int kInt16Flag = 32;  // formats[i] & kInt16Flag: activations rounded to 16 bits
// formats[i] & kTiledFlag: a Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weight with integer
// activations in the column-tiled layout (quant_format.h `IntWeight::tiled`; the AVX-512
// set only).
constexpr int kTiledFlag = 64;
constexpr int64_t kColumnBlock = 64;  // output columns per work item
// Rows a call takes: a decode step's, or a verify step's (sequences x (k + 1) positions);
// the buffers are sized per call, the weights' tiles take 8 rows at a time.
constexpr int64_t kMaxDecoderRows = 1024;

struct Weight {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* offset;  // nullptr without a min
  KWeight k;  // the K-quants' operands
  int64_t in, out;
  Format format;
  int activation_bits;  // 32: float tiles; 8 or 16: integer tiles (not U8)
  bool tiled;           // the column-tiled layout (kTiledFlag)
};

// cos / sin of each row's RoPE angles, [rows, H/2] each: the same for every layer.
void RopeTables(const int32_t* positions, int64_t b0, int64_t b1, int64_t half,
                const float* inv_freq, float* cos_t, float* sin_t) {
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t i = 0; i < half; ++i) {
      const float f = static_cast<float>(positions[b]) * inv_freq[i];
      cos_t[b * half + i] = std::cos(f);
      sin_t[b * half + i] = std::sin(f);
    }
  }
}

// Rotate-half RoPE of `heads` heads of H at one position (its RopeTables row), in place.
void Rope(float* x, int64_t heads, int64_t head_dim, const float* cos_row, const float* sin_row) {
  const int64_t half = head_dim / 2;
  for (int64_t n = 0; n < heads; ++n) {
    float* xh = x + n * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = xh[i], b = xh[i + half], c = cos_row[i], s = sin_row[i];
      xh[i] = a * c - b * s;
      xh[i + half] = b * c + a * s;
    }
  }
}

// float32 -> bfloat16 bits, rounding to nearest even (as XLA's convert).
inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// K/V rows [K, H] of one token into pool entry `index` of layer `layer`'s pages.
void WriteKV(uint8_t* pool, int kind, int64_t entry_rows, const float* x, int64_t n) {
  if (kind == 0) {
    std::memcpy(pool + entry_rows * 4, x, n * sizeof(float));
  } else {
    auto* dst = reinterpret_cast<uint16_t*>(pool) + entry_rows;
    for (int64_t i = 0; i < n; ++i) dst[i] = ToBf16(x[i]);
  }
}

// RmsNorm's end for one row of D: the squares of x from `i` on added to `ss` (the
// vector loop's sum), then out = w * (x * rsqrt(ss / D + eps)).
inline void FinishRmsRow(const float* xb, const float* w, int64_t dim, int64_t i, float ss,
                         float eps, float* out) {
  for (; i < dim; ++i) ss += xb[i] * xb[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t j = 0; j < dim; ++j) out[j] = w[j] * (xb[j] * inv);
}

// SwiGLU's scalar end: out[i] = silu(g[i]) * u[i] for i in [i0, n).
inline void SwiGLUTail(const float* g, const float* u, float* out, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

#if defined(__x86_64__)
// out[b] = x[b] * rsqrt(mean(x[b]^2) + eps) * w, for B rows of D.
__attribute__((target("avx512f,fma"))) void RmsNorm(const float* x, const float* w, int rows,
                                                    int64_t dim, float eps, float* out) {
  for (int b = 0; b < rows; ++b) {
    const float* xb = x + b * dim;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= dim; i += 16) {
      const __m512 v = _mm512_loadu_ps(xb + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    FinishRmsRow(xb, w, dim, i, _mm512_reduce_add_ps(acc), eps, out + b * dim);
  }
}

__attribute__((target("avx512f"))) void AddInPlace(float* h, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += d[i];
}

// out = silu(g) * u = g / (1 + exp(-g)) * u, 16 lanes at a time (attention.h Exp16).
XLASERVE_TARGET void SwiGLU(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
  }
  SwiGLUTail(g, u, out, i, n);
}

// RmsNorm, AddInPlace and SwiGLU for AVX2 + FMA (the same operations, 8 lanes).

XLASERVE_AVX2_TARGET void RmsNormAvx2(const float* x, const float* w, int rows, int64_t dim,
                                      float eps, float* out) {
  for (int b = 0; b < rows; ++b) {
    const float* xb = x + b * dim;
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
      const __m256 v = _mm256_loadu_ps(xb + i);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    FinishRmsRow(xb, w, dim, i, avx2::Sum8(acc), eps, out + b * dim);
  }
}

XLASERVE_AVX2_TARGET void AddInPlaceAvx2(float* h, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += d[i];
}

XLASERVE_AVX2_TARGET void SwiGLUAvx2(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + avx2::kLanes8 <= n; i += avx2::kLanes8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = avx2::Exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  SwiGLUTail(g, u, out, i, n);
}
#elif defined(__aarch64__)
// RmsNorm, AddInPlace and SwiGLU for NEON (the same operations, 4 lanes; attention_neon.h
// Exp4).

void RmsNormNeon(const float* x, const float* w, int rows, int64_t dim, float eps, float* out) {
  for (int b = 0; b < rows; ++b) {
    const float* xb = x + b * dim;
    float32x4_t acc = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 4 <= dim; i += 4) {
      const float32x4_t v = vld1q_f32(xb + i);
      acc = vfmaq_f32(acc, v, v);
    }
    FinishRmsRow(xb, w, dim, i, vaddvq_f32(acc), eps, out + b * dim);
  }
}

void AddInPlaceNeon(float* h, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += d[i];
}

void SwiGLUNeon(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + neon::kLanes4 <= n; i += neon::kLanes4) {
    const float32x4_t gv = vld1q_f32(g + i);
    const float32x4_t e = neon::Exp4(vnegq_f32(gv));
    const float32x4_t silu = vdivq_f32(gv, vaddq_f32(vdupq_n_f32(1.0f), e));
    vst1q_f32(out + i, vmulq_f32(silu, vld1q_f32(u + i)));
  }
  SwiGLUTail(g, u, out, i, n);
}
#endif

// The instruction set's steps of a layer besides the weights' column loops: the
// elementwise functions, the group sums and row rounding of the activations, and the
// per-query attention loop (float32 and bfloat16 pages). kGroupsQueries: rows of one
// sequence attend together (attention.h AttendQueries, the AVX-512 set only).
template <Isa kIsa>
struct Steps;
#if defined(__x86_64__)
template <>
struct Steps<Isa::kAvx512> {
  static constexpr auto rms_norm = &RmsNorm;
  static constexpr auto add_in_place = &AddInPlace;
  static constexpr auto swiglu = &SwiGLU;
  static constexpr auto group_sums = &GroupSums;
  static constexpr auto prepare_rows = &PrepareRows;
  static constexpr auto quantize_row_range = &QuantizeRowRange;
  static constexpr auto attend_f32 = &AttendWithScratch<0>;
  static constexpr auto attend_bf16 = &AttendWithScratch<1>;
  static constexpr bool kGroupsQueries = true;
};
template <>
struct Steps<Isa::kAvx2> {
  static constexpr auto rms_norm = &RmsNormAvx2;
  static constexpr auto add_in_place = &AddInPlaceAvx2;
  static constexpr auto swiglu = &SwiGLUAvx2;
  static constexpr auto group_sums = &avx2::GroupSums;
  static constexpr auto prepare_rows = &avx2::PrepareRows;
  static constexpr auto quantize_row_range = &avx2::QuantizeRowRange;
  static constexpr auto attend_f32 = &avx2::AttendWithScratch<0>;
  static constexpr auto attend_bf16 = &avx2::AttendWithScratch<1>;
  static constexpr bool kGroupsQueries = false;
};
#elif defined(__aarch64__)
template <>
struct Steps<Isa::kNeon> {
  static constexpr auto rms_norm = &RmsNormNeon;
  static constexpr auto add_in_place = &AddInPlaceNeon;
  static constexpr auto swiglu = &SwiGLUNeon;
  static constexpr auto group_sums = &neon::GroupSums;
  static constexpr auto prepare_rows = &neon::PrepareRows;
  static constexpr auto quantize_row_range = &neon::QuantizeRowRange;
  static constexpr auto attend_f32 = &neon::AttendWithScratch<0>;
  static constexpr auto attend_bf16 = &neon::AttendWithScratch<1>;
  static constexpr bool kGroupsQueries = false;
};
#endif

#if defined(__x86_64__)
// The integer tiles' view of a weight (quant_int.h).
inline IntWeight IntOperands(const Weight& w) {
  IntWeight iw;
  iw.in = w.in;
  iw.codes = w.codes;
  iw.scale = w.scale;
  iw.offset = w.offset;
  iw.k = w.k;
  iw.tiled = w.tiled;
  return iw;
}

// A K-quant weight's column block (float tiles or integer ones).
template <Format kFmt>
void KDotBlock(const Weight& w, const float* x, const IntRows* xq, int rows, float* y,
               int64_t o0, int64_t o1) {
  if (w.activation_bits != 32) {
    IntColumns<kFmt>(*xq, w.activation_bits == 16, rows, IntOperands(w), y, w.out, o0, o1);
  } else {
    KColumns<kFmt>(x, rows, w.in, w.k, y, w.out, o0, o1);
  }
}
#endif

// DotBlock of the set beside AVX-512 (AVX2 on x86-64, NEON on aarch64; no K-quants).
inline void NarrowDotBlock(const Weight& w, const float* x, const float* xsum,
                           const IntRows* xq, int rows, float* y, int64_t o0, int64_t o1) {
  const bool lo = w.activation_bits == 16, ints = w.activation_bits != 32;
  switch (w.format) {
    case kU8:
      narrow::Columns<kU8>(x, xsum, rows, w.in, w.codes, w.scale, w.offset, y, w.out, o0, o1);
      return;
    case kS8:
      if (ints) {
        narrow::IntColumns<kS8>(*xq, lo, 0, rows, w.in, w.codes, w.scale, nullptr, y, w.out,
                                o0, o1);
      } else {
        narrow::Columns<kS8>(x, xsum, rows, w.in, w.codes, w.scale, nullptr, y, w.out, o0, o1);
      }
      return;
    case kQ4_1:
      if (ints) {
        narrow::IntColumns<kQ4_1>(*xq, lo, 0, rows, w.in, w.codes, w.scale, w.offset, y, w.out,
                                  o0, o1);
      } else {
        narrow::Columns<kQ4_1>(x, xsum, rows, w.in, w.codes, w.scale, w.offset, y, w.out, o0,
                               o1);
      }
      return;
    case kQ4_0:
      if (ints) {
        narrow::IntColumns<kQ4_0>(*xq, lo, 0, rows, w.in, w.codes, w.scale, nullptr, y, w.out,
                                  o0, o1);
      } else {
        narrow::Columns<kQ4_0>(x, xsum, rows, w.in, w.codes, w.scale, nullptr, y, w.out, o0,
                               o1);
      }
      return;
    default:  // K-quants: DecodeLayersImpl refuses them on this set
      return;
  }
}

// y[B, out) = x[B, in] @ W^T, one column block: float rows (with their GroupSums
// `xsum`) or their integer rounding `xq` (QuantizeRows of the same instruction set).
template <Isa kIsa>
void DotBlock(const Weight& w, const float* x, const float* xsum, const IntRows* xq, int rows,
              float* y, int64_t o0, int64_t o1) {
  if constexpr (kIsa != Isa::kAvx512) {
    NarrowDotBlock(w, x, xsum, xq, rows, y, o0, o1);
    return;
  }
#if defined(__x86_64__)
  const bool lo = w.activation_bits == 16;
  switch (w.format) {
    case kU8:
      Columns<kU8>(x, xsum, rows, w.in, w.codes, w.scale, w.offset, y, w.out, o0, o1);
      return;
    case kS8:
      if (w.activation_bits != 32) {
        IntColumns<kS8>(*xq, lo, rows, IntOperands(w), y, w.out, o0, o1);
      } else {
        Columns<kS8>(x, xsum, rows, w.in, w.codes, w.scale, nullptr, y, w.out, o0, o1);
      }
      return;
    case kQ4_1:
      if (w.activation_bits != 32) {
        IntColumns<kQ4_1>(*xq, lo, rows, IntOperands(w), y, w.out, o0, o1);
      } else {
        Columns<kQ4_1>(x, xsum, rows, w.in, w.codes, w.scale, w.offset, y, w.out, o0, o1);
      }
      return;
    case kQ4_0:
      if (w.activation_bits != 32) {
        IntColumns<kQ4_0>(*xq, lo, rows, IntOperands(w), y, w.out, o0, o1);
      } else {
        Columns<kQ4_0>(x, xsum, rows, w.in, w.codes, w.scale, nullptr, y, w.out, o0, o1);
      }
      return;
    case kQ4_K:
      KDotBlock<kQ4_K>(w, x, xq, rows, y, o0, o1);
      return;
    case kQ5_K:
      KDotBlock<kQ5_K>(w, x, xq, rows, y, o0, o1);
      return;
    case kQ6_K:
      KDotBlock<kQ6_K>(w, x, xq, rows, y, o0, o1);
      return;
  }
#endif
}

// Several projections of the same rows (Q/K/V; gate/up) as one parallel loop.
struct Projection {
  const Weight* w;
  float* y;  // [rows, w->out]
};

template <Isa kIsa>
void Project(Team& team, const std::vector<Projection>& ps, const float* x, const IntRows* xq,
             int rows) {
  // The group sums of x, for the float tiles (the integer ones carry their own).
  std::vector<float> xsum;
  if (std::any_of(ps.begin(), ps.end(),
                  [](const Projection& p) { return p.w->activation_bits == 32; })) {
    xsum.resize(rows * (ps[0].w->in / kGroup));
    Steps<kIsa>::group_sums(x, rows, ps[0].w->in, xsum.data());
  }
  std::vector<int64_t> first(ps.size() + 1, 0);  // first work item of each projection
  for (size_t i = 0; i < ps.size(); ++i) {
    first[i + 1] = first[i] + (ps[i].w->out + kColumnBlock - 1) / kColumnBlock;
  }
  team.For(first.back(), [&](int64_t item) {
    size_t p = 0;
    while (item >= first[p + 1]) ++p;
    const int64_t o0 = (item - first[p]) * kColumnBlock;
    DotBlock<kIsa>(*ps[p].w, x, xsum.data(), xq, rows, ps[p].y, o0,
             std::min(o0 + kColumnBlock, ps[p].w->out));
  });
}

struct Shapes {
  int64_t rows, dim, layers, heads, kv_heads, head_dim, mlp, width, page_size, num_pages;
};

// Weight i's operands (weights[6i .. 6i + 5]) and format code into `w`, checked.
ffi::Error ParseWeight(ffi::RemainingArgs& weights, int64_t i, int64_t code, Weight& w) {
  ffi::ErrorOr<ffi::AnyBuffer> ops[kOperands] = {
      weights.get<ffi::AnyBuffer>(kOperands * i), weights.get<ffi::AnyBuffer>(kOperands * i + 1),
      weights.get<ffi::AnyBuffer>(kOperands * i + 2), weights.get<ffi::AnyBuffer>(kOperands * i + 3),
      weights.get<ffi::AnyBuffer>(kOperands * i + 4), weights.get<ffi::AnyBuffer>(kOperands * i + 5)};
  for (auto& op : ops) {
    if (op.has_error()) return ffi::Error::InvalidArgument("decoder layers: a weight operand is missing");
  }
  const int64_t fmt = code & kFormatMask;
  if (fmt > kQ6_K) return ffi::Error::InvalidArgument("decoder layers: unknown weight format");
  w.format = static_cast<Format>(fmt);
  w.activation_bits = w.format == kU8                  ? 32
                      : (code & kInt16Flag) != 0 ? 16
                      : (code & kInt8Flag) != 0  ? 8
                                                       : 32;
  w.tiled = (code & kTiledFlag) != 0;
  if (w.tiled && (w.activation_bits == 32 || !TiledFormat(w.format))) {
    return ffi::Error::InvalidArgument(
        "decoder layers: column tiles need Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K with integer "
        "activations");
  }
  auto codes = *ops[0], sc = *ops[1], off = *ops[2];
  auto cd = codes.dimensions();
  auto sd = sc.dimensions();
  if (cd.size() != 2 || sd.size() != 2) {
    return ffi::Error::InvalidArgument("decoder layers: weight codes and scales must be 2-D");
  }
  w.out = cd[0];
  if (IsKQuant(w.format)) {
    // Codes [O, I/2] nibbles; the rest as kquant_dot.h `KWeight`.
    const Format f = w.format;
    w.in = cd[1] * 2;
    auto shaped = [&](ffi::AnyBuffer& a, ffi::DataType type, int64_t cols) {
      auto d = a.dimensions();
      return a.element_type() == type && d.size() == 2 && d[0] == w.out && d[1] == cols;
    };
    auto qh = *ops[3], ss = *ops[4], so = *ops[5];
    bool ok = w.in % kSuper == 0 && codes.element_type() == ffi::U8 &&
              shaped(sc, f == kQ6_K ? ffi::S8 : ffi::U8, KScaleCount(f, w.in)) &&
              shaped(ss, ffi::F16, w.in / kSuper);
    if (f != kQ6_K) {
      ok = ok && shaped(off, ffi::U8, w.in / kGroup) && shaped(so, ffi::F16, w.in / kSuper);
    }
    if (f != kQ4_K) ok = ok && shaped(qh, ffi::U8, KHighBytes(f, w.in));
    ok = ok && (!w.tiled || w.out % kTileCols == 0);
    if (!ok) return ffi::Error::InvalidArgument("decoder layers: K-quant operands do not match");
    w.k.q = reinterpret_cast<const uint8_t*>(codes.untyped_data());
    w.k.scale = reinterpret_cast<const uint8_t*>(sc.untyped_data());
    w.k.super_scale = reinterpret_cast<const uint16_t*>(ss.untyped_data());
    if (f != kQ6_K) {
      w.k.offset = reinterpret_cast<const uint8_t*>(off.untyped_data());
      w.k.super_offset = reinterpret_cast<const uint16_t*>(so.untyped_data());
    }
    if (f != kQ4_K) w.k.q_high = reinterpret_cast<const uint8_t*>(qh.untyped_data());
    return ffi::Error::Success();
  }
  // Groups of 32: codes [O, I * bytes per input], float16 scales and offsets [O, I/32].
  if (sc.element_type() != ffi::F16 || off.element_type() != ffi::F16 ||
      off.element_count() != sc.element_count()) {
    return ffi::Error::InvalidArgument("decoder layers: weight operands must be 2-D codes "
                                       "and float16 scales / offsets");
  }
  w.in = sd[1] * kGroup;
  if (sd[0] != w.out || cd[1] != sd[1] * GroupBytes(w.format) ||
      (w.activation_bits != 32 && sd[1] % 2) || (w.tiled && w.out % kTileCols)) {
    return ffi::Error::InvalidArgument("decoder layers: codes and scales do not match");
  }
  w.codes = reinterpret_cast<const uint8_t*>(codes.untyped_data());
  w.scale = reinterpret_cast<const uint16_t*>(sc.untyped_data());
  w.offset = HasMin(w.format) ? reinterpret_cast<const uint16_t*>(off.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

template <Isa kIsa>
ffi::Error DecodeLayersImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> kv_index,
                            ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Buffer<ffi::F32> inv_freq, ffi::Buffer<ffi::F32> norms,
                            ffi::AnyBuffer k_in, ffi::AnyBuffer v_in, ffi::RemainingArgs weights,
                            ffi::ResultBuffer<ffi::F32> h_out, ffi::Result<ffi::AnyBuffer> k_out,
                            ffi::Result<ffi::AnyBuffer> v_out, ffi::Span<const int64_t> formats,
                            int64_t num_heads, int64_t num_pages, int64_t window, int64_t kind,
                            float eps, float scale) {
  auto xd = x.dimensions();
  auto kd = k_in.dimensions();
  auto td = tables.dimensions();
  auto nd = norms.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || td.size() != 2 || nd.size() != 3) {
    return ffi::Error::InvalidArgument("decoder layers: x [B,D], pools [L*P,ps,K,H], "
                                       "tables [B,W], norms [L,2,D]");
  }
  Shapes s{xd[0], xd[1], nd[0], num_heads, kd[2], kd[3], 0, td[1], kd[1], num_pages};
  const int rows = static_cast<int>(s.rows);
  if (kind != 0 && kind != 1) return ffi::Error::InvalidArgument("decoder layers: page kind");
  if (rows < 1 || rows > kMaxDecoderRows || nd[1] != 2 || nd[2] != s.dim || td[0] != s.rows ||
      kd[0] != s.layers * s.num_pages || s.heads % s.kv_heads || s.head_dim % kLanes ||
      positions.element_count() != s.rows || kv_index.element_count() != s.rows ||
      seq_lens.element_count() != s.rows || inv_freq.element_count() != s.head_dim / 2 ||
      static_cast<int64_t>(formats.size()) != s.layers * kWeights ||
      static_cast<int64_t>(weights.size()) != s.layers * kWeights * kOperands ||
      k_in.element_count() != v_in.element_count()) {
    return ffi::Error::InvalidArgument("decoder layers: operand shapes do not match");
  }
  // The weights: six operands each (ParseWeight).
  std::vector<Weight> ws(s.layers * kWeights);
  for (int64_t i = 0; i < s.layers * kWeights; ++i) {
    if (ffi::Error err = ParseWeight(weights, i, formats[i], ws[i]); err.failure()) return err;
    if (kIsa != Isa::kAvx512 && IsKQuant(ws[i].format)) {  // no AVX2 / NEON K-quant tiles
      return ffi::Error::InvalidArgument("decoder layers: K-quants need the AVX-512 set");
    }
    if (kIsa != Isa::kAvx512 && ws[i].tiled) {
      return ffi::Error::InvalidArgument("decoder layers: column tiles need the AVX-512 set");
    }
  }
  const int64_t qdim = s.heads * s.head_dim, kvdim = s.kv_heads * s.head_dim;
  s.mlp = ws[4].out;
  for (int64_t l = 0; l < s.layers; ++l) {
    const Weight* w = &ws[l * kWeights];
    const bool ok = w[0].in == s.dim && w[0].out == qdim && w[1].in == s.dim &&
                    w[1].out == kvdim && w[2].in == s.dim && w[2].out == kvdim &&
                    w[3].in == qdim && w[3].out == s.dim && w[4].in == s.dim &&
                    w[4].out == s.mlp && w[5].in == s.dim && w[5].out == s.mlp &&
                    w[6].in == s.mlp && w[6].out == s.dim;
    if (!ok) return ffi::Error::InvalidArgument("decoder layers: weight shapes do not match");
  }
  // Page ids and KV indices past the pool would touch memory outside it: refuse.
  const int32_t* table = tables.typed_data();
  const int32_t* kv_idx = kv_index.typed_data();
  for (int64_t i = 0; i < s.rows * s.width; ++i) {
    if (table[i] < 0 || table[i] >= s.num_pages) {
      return ffi::Error::InvalidArgument("decoder layers: page id outside the pool");
    }
  }
  for (int64_t b = 0; b < s.rows; ++b) {
    if (kv_idx[b] < 0 || kv_idx[b] >= s.num_pages * s.page_size) {
      return ffi::Error::InvalidArgument("decoder layers: KV index outside the pool");
    }
  }

  float* h = h_out->typed_data();
  std::memcpy(h, x.typed_data(), s.rows * s.dim * sizeof(float));
  // The pools are aliased to the outputs: write and read them through the outputs.
  auto* k_pool = reinterpret_cast<uint8_t*>(k_out->untyped_data());
  auto* v_pool = reinterpret_cast<uint8_t*>(v_out->untyped_data());
  if (k_pool != k_in.untyped_data()) {  // not aliased (never in the engine): copy first
    std::memcpy(k_pool, k_in.untyped_data(), k_in.size_bytes());
    std::memcpy(v_pool, v_in.untyped_data(), v_in.size_bytes());
  }
  const int64_t value_bytes = kind == 0 ? 4 : 2;
  Dims d{s.rows, 1, s.heads, s.head_dim, s.page_size, s.kv_heads, s.head_dim * value_bytes,
         s.width};
  const int32_t* pos = positions.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int64_t max_keys = s.width * s.page_size;
  std::vector<int64_t> q_lens(s.rows);
  for (int64_t b = 0; b < s.rows; ++b) q_lens[b] = std::clamp<int64_t>(lens[b], 0, max_keys);
  const std::vector<QuerySpan> spans = AttentionSpans(
      table, s.rows, s.width, Steps<kIsa>::kGroupsQueries && window <= 0,
      std::max<int64_t>(1, std::thread::hardware_concurrency()), s.kv_heads, kSpanRows);

  std::vector<float> xn(s.rows * std::max(s.dim, s.mlp)), q(s.rows * qdim), k(s.rows * kvdim),
      v(s.rows * kvdim), attn(s.rows * qdim), proj(s.rows * s.dim), gate(s.rows * s.mlp),
      up(s.rows * s.mlp);
  IntRows xq;
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  Team team(pool, cpus);
  // The row-wise steps between the column loops (norms, rounding, RoPE and the K/V
  // write, SwiGLU, the residual adds): fn(b0, b1) over blocks of rows on the team
  // where a call has many rows (a prefill chunk's), on the caller otherwise. Each row
  // is computed alone, so the split does not change a bit.
  constexpr int64_t kRowBlock = 32;
  auto for_rows = [&](auto&& fn) {
    if (s.rows < 2 * kRowBlock) {
      fn(int64_t{0}, s.rows);
      return;
    }
    team.For((s.rows + kRowBlock - 1) / kRowBlock, [&](int64_t i) {
      fn(i * kRowBlock, std::min(s.rows, (i + 1) * kRowBlock));
    });
  };
  // Rounds a phase's input once for its integer tiles: to 16 bits if any of them
  // takes 16 (the 8-bit rounding is its high byte, so 8-bit tiles read the same).
  auto quantize = [&](const float* src, int64_t in, std::initializer_list<const Weight*> ws) {
    int bits = 32;
    for (const Weight* w : ws) {
      if (w->activation_bits != 32) bits = bits == 32 ? w->activation_bits
                                                      : std::max(bits, w->activation_bits);
    }
    if (bits == 32) return;
    // AMX A tiles only where the tiles read them (`AmxFormat`).
    xq.amx_order = std::any_of(ws.begin(), ws.end(), [](const Weight* w) {
      return w->activation_bits != 32 && AmxFormat(w->format, w->tiled);
    });
    Steps<kIsa>::prepare_rows(rows, in, bits == 16, xq);
    for_rows([&](int64_t b0, int64_t b1) {
      Steps<kIsa>::quantize_row_range(src, static_cast<int>(b0), static_cast<int>(b1), in, xq);
    });
  };
  auto norm_rows = [&](const float* w, float* out) {
    for_rows([&](int64_t b0, int64_t b1) {
      Steps<kIsa>::rms_norm(h + b0 * s.dim, w, static_cast<int>(b1 - b0), s.dim, eps,
                            out + b0 * s.dim);
    });
  };
  auto add_rows = [&](const float* d) {
    for_rows([&](int64_t b0, int64_t b1) {
      Steps<kIsa>::add_in_place(h + b0 * s.dim, d + b0 * s.dim, (b1 - b0) * s.dim);
    });
  };
  const int64_t half = s.head_dim / 2;
  std::vector<float> rope_cos(s.rows * half), rope_sin(s.rows * half);
  for_rows([&](int64_t b0, int64_t b1) {
    RopeTables(pos, b0, b1, half, inv_freq.typed_data(), rope_cos.data(), rope_sin.data());
  });

  for (int64_t l = 0; l < s.layers; ++l) {
    const Weight* w = &ws[l * kWeights];
    const float* norm = norms.typed_data() + l * 2 * s.dim;
    // Attention.
    norm_rows(norm, xn.data());
    quantize(xn.data(), s.dim, {&w[0], &w[1], &w[2]});
    Project<kIsa>(team, {{&w[0], q.data()}, {&w[1], k.data()}, {&w[2], v.data()}}, xn.data(), &xq,
            rows);
    const int64_t layer_entry = l * s.num_pages * s.page_size;
    for_rows([&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float *c = rope_cos.data() + b * half, *sn = rope_sin.data() + b * half;
        Rope(q.data() + b * qdim, s.heads, s.head_dim, c, sn);
        Rope(k.data() + b * kvdim, s.kv_heads, s.head_dim, c, sn);
        const int64_t row0 = (layer_entry + kv_idx[b]) * kvdim;  // values before the token's K
        WriteKV(k_pool, static_cast<int>(kind), row0, k.data() + b * kvdim, kvdim);
        WriteKV(v_pool, static_cast<int>(kind), row0, v.data() + b * kvdim, kvdim);
      }
    });
    // Layer l's pages: the pool from entry layer_entry on (tables are per layer).
    const uint8_t* kp = k_pool + layer_entry * d.kv_heads * d.row_bytes;
    const uint8_t* vp = v_pool + layer_entry * d.kv_heads * d.row_bytes;
    team.For(static_cast<int64_t>(spans.size()) * s.kv_heads, [&](int64_t item) {
      const QuerySpan& span = spans[item / s.kv_heads];
      const int64_t b = span.first, kh = item % s.kv_heads;
#if defined(__x86_64__)
      if (span.count > 1) {  // rows of one sequence: its keys read once for all of them
        auto* attend = kind == 0 ? &AttendQueriesWithScratch<0> : &AttendQueriesWithScratch<1>;
        attend(d, q.data() + b * qdim, qdim, span.count, q_lens.data() + b, kp, vp,
               table + b * s.width, scale, attn.data() + b * qdim, qdim, kh, kh + 1);
        return;
      }
#endif
      auto* attend = kind == 0 ? Steps<kIsa>::attend_f32 : Steps<kIsa>::attend_bf16;
      attend(d, q.data() + b * qdim, kp, vp, table + b * s.width, q_lens[b], scale, window, 0.0f,
             nullptr, attn.data() + b * qdim, kh, kh + 1);
    });
    quantize(attn.data(), qdim, {&w[3]});
    Project<kIsa>(team, {{&w[3], proj.data()}}, attn.data(), &xq, rows);
    add_rows(proj.data());
    // MLP.
    norm_rows(norm + s.dim, xn.data());
    quantize(xn.data(), s.dim, {&w[4], &w[5]});
    Project<kIsa>(team, {{&w[4], gate.data()}, {&w[5], up.data()}}, xn.data(), &xq, rows);
    for_rows([&](int64_t b0, int64_t b1) {
      Steps<kIsa>::swiglu(gate.data() + b0 * s.mlp, up.data() + b0 * s.mlp,
                          xn.data() + b0 * s.mlp, (b1 - b0) * s.mlp);
    });
    quantize(xn.data(), s.mlp, {&w[6]});
    Project<kIsa>(team, {{&w[6], proj.data()}}, xn.data(), &xq, rows);
    add_rows(proj.data());
  }
  return ffi::Error::Success();
}

}  // namespace

static auto DecoderBinding() {
  return ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // x
      .Arg<ffi::Buffer<ffi::S32>>()   // positions
      .Arg<ffi::Buffer<ffi::S32>>()   // kv_index
      .Arg<ffi::Buffer<ffi::S32>>()   // tables
      .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
      .Arg<ffi::Buffer<ffi::F32>>()   // inv_freq
      .Arg<ffi::Buffer<ffi::F32>>()   // norms
      .Arg<ffi::AnyBuffer>()          // k pool
      .Arg<ffi::AnyBuffer>()          // v pool
      .RemainingArgs()                // the weights
      .Ret<ffi::Buffer<ffi::F32>>()   // h
      .Ret<ffi::AnyBuffer>()          // k pool (aliased)
      .Ret<ffi::AnyBuffer>()          // v pool (aliased)
      .Attr<ffi::Span<const int64_t>>("formats")
      .Attr<int64_t>("num_heads")
      .Attr<int64_t>("num_pages")
      .Attr<int64_t>("window")
      .Attr<int64_t>("kind")
      .Attr<float>("eps")
      .Attr<float>("scale");
}

#if defined(__x86_64__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeLayersK, DecodeLayersImpl<Isa::kAvx512>,
                              DecoderBinding());
// The same stack for CPUs with AVX2 + FMA + F16C (float and integer activations; no K-quants).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeLayersKAvx2, DecodeLayersImpl<Isa::kAvx2>,
                              DecoderBinding());
#elif defined(__aarch64__)
// The same stack on aarch64 (NEON: float and integer activations; no K-quants).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaserveDecodeLayersKNeon, DecodeLayersImpl<Isa::kNeon>,
                              DecoderBinding());
#endif
