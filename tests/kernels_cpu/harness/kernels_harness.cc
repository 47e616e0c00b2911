// Checks the native kernels' inner functions (no jaxlib, no FFI) against scalar
// references, on the instruction set this file is compiled for: NEON on aarch64
// (SDOT and the plain fallback), AVX2 and, where the CPU has it, AVX-512 VNNI on
// x86-64. tests/kernels_cpu/test_native_harness.py builds and runs it (natively, and
// cross-compiled for aarch64 under qemu-user).
//
// - Integer activations (Q8_0, Q4_0, Q4_1 x 8 / 16 bits): the rounded rows and every
//   output bitwise equal to a scalar model of quant_int.h's numerics (the rounding of
//   quant_dot.h QuantizeRowRange, exact int32 sums, the float32 epilogue in group
//   order with fused multiply-adds), so every set gives the same bits.
// - Float activations (U8, Q8_0, Q4_1, Q4_0): within 1e-5 of the float64 product.
// - Paged attention (float32, bfloat16, int8 pages; window, soft cap, sinks): within
//   2e-5 of a float64 softmax; the vector exp behind it (and the decoder's SwiGLU)
//   within 4e-7 of exp.
// Prints one line per check and "ok" at the end; exits 1 on the first mismatch.
// Compile with -ffp-contract=off (the references' roundings are written out).

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__aarch64__)
#include "attention_neon.h"
#include "quant_dot_neon.h"
#else
#include "attention.h"
#include "attention_avx2.h"
#include "quant_dot_avx2.h"
#include "quant_int.h"
#endif

namespace xs = xlaserve;

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint32_t Next() {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(state >> 33);
}
float Uniform(float lo, float hi) { return lo + (hi - lo) * (Next() & 0xFFFFFF) / 16777216.0f; }

// float16 bits -> float (exact), and a random normal half in [2^-6, 2^-1) of either sign.
float HalfValue(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                         : std::ldexp(1.0f + m / 1024.0f, e - 15);
  return (h >> 15) ? -v : v;
}
uint16_t RandomHalf(bool allow_negative) {
  const uint16_t sign = allow_negative && (Next() & 1) ? 0x8000 : 0;
  return static_cast<uint16_t>(sign | ((9 + Next() % 5) << 10) | (Next() & 1023));
}

float Bf16Value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

void Fail(const std::string& what) {
  std::printf("FAIL %s\n", what.c_str());
  std::exit(1);
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// A quantized weight [O, I] in groups of 32 (quant_format.h Format).
struct Weight {
  xs::Format fmt;
  int64_t out, in;
  std::vector<uint8_t> codes;
  std::vector<uint16_t> scale, offset;

  int64_t Groups() const { return in / xs::kGroup; }
  // The integer code of input i of column o (Q4_0: nibble - 8 is applied by the caller).
  int Code(int64_t o, int64_t i) const {
    const int64_t g = i / xs::kGroup, j = i % xs::kGroup;
    const uint8_t* q = codes.data() + (o * Groups() + g) * xs::GroupBytes(fmt);
    if (fmt == xs::kS8) return static_cast<int8_t>(q[j]);
    if (fmt == xs::kU8) return q[j];
    return j < 16 ? (q[j] & 15) : (q[j - 16] >> 4);
  }
  float Min(int64_t o, int64_t g) const {
    const float s = HalfValue(scale[o * Groups() + g]);
    return xs::HasMin(fmt) ? HalfValue(offset[o * Groups() + g]) : fmt == xs::kQ4_0 ? -8 * s : 0;
  }
};

Weight MakeWeight(xs::Format fmt, int64_t out, int64_t in) {
  Weight w{fmt, out, in, {}, {}, {}};
  w.codes.resize(out * w.Groups() * xs::GroupBytes(fmt));
  for (auto& c : w.codes) c = static_cast<uint8_t>(Next());
  w.scale.resize(out * w.Groups());
  for (auto& s : w.scale) s = RandomHalf(false);
  if (xs::HasMin(fmt)) {
    w.offset.resize(out * w.Groups());
    for (auto& m : w.offset) m = RandomHalf(true);
  }
  return w;
}

std::vector<float> Activations(int rows, int64_t in) {
  std::vector<float> x(rows * in);
  for (auto& v : x) v = Uniform(-2.0f, 2.0f);
  for (int64_t g = 0; g < rows * in / xs::kGroup; g += 5) {  // an all-zero group now and then
    std::fill(x.begin() + g * xs::kGroup, x.begin() + (g + 1) * xs::kGroup, 0.0f);
  }
  return x;
}

// ---- Scalar references ----

// One row's group rounded as quant_dot.h QuantizeRowRange does it.
struct RoundedGroup {
  float d = 0, xsum8 = 0, xsum16 = 0;
  int32_t xint8 = 0, xint16 = 0;
  int8_t hi[32], lo[32];
};

RoundedGroup RoundGroup(const float* x) {
  RoundedGroup r;
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  r.d = amax / 127.0f;
  const float inv = r.d > 0.0f ? 1.0f / r.d : 0.0f;
  int32_t sum_lo = 0;
  for (int i = 0; i < 32; ++i) {
    const float s = x[i] * inv;
    const float q = std::nearbyint(s);
    const float rest = (s - q) * 256.0f;
    r.hi[i] = static_cast<int8_t>(q);
    r.lo[i] = static_cast<int8_t>(std::clamp(std::nearbyint(rest), -127.0f, 127.0f));
    r.xint8 += r.hi[i];
    sum_lo += r.lo[i];
  }
  r.xsum8 = r.d * static_cast<float>(r.xint8);
  r.xint16 = 256 * r.xint8 + sum_lo;
  r.xsum16 = r.d * (static_cast<float>(r.xint8) + static_cast<float>(sum_lo) * (1.0f / 256.0f));
  return r;
}

// quant_int.h's numerics for row b, column o.
float ExactReference(const Weight& w, const std::vector<RoundedGroup>& rows, int b, int64_t o,
                     bool lo) {
  const int64_t groups = w.Groups();
  float acc = 0, mins = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const RoundedGroup& r = rows[b * groups + g];
    int64_t isum = 0;
    for (int i = 0; i < 32; ++i) {
      const int code = w.Code(o, g * 32 + i) - (w.fmt == xs::kQ4_0 ? 8 : 0);
      isum += code * (lo ? 256 * r.hi[i] + r.lo[i] : r.hi[i]);
    }
    const float d = HalfValue(w.scale[o * groups + g]);
    acc = std::fma(static_cast<float>(isum), d * r.d, acc);
    if (xs::HasMin(w.fmt)) {
      mins = std::fma(HalfValue(w.offset[o * groups + g]), lo ? r.xsum16 : r.xsum8, mins);
    }
  }
  const float unit = lo ? 1.0f / 256.0f : 1.0f;
  if (xs::HasMin(w.fmt)) return std::fma(acc, unit, mins);
  return lo ? acc * unit : acc;
}

// sum_i w_i x_i in float64, and sum_i |w_i x_i| (the tolerance's scale).
void FloatReference(const Weight& w, const float* x, int64_t o, double* y, double* mag) {
  *y = *mag = 0;
  for (int64_t i = 0; i < w.in; ++i) {
    const int64_t g = i / 32;
    const double wq = w.Code(o, i) * static_cast<double>(HalfValue(w.scale[o * w.Groups() + g])) +
                      w.Min(o, g);  // Q4_0: the min is -8 * scale
    *y += wq * x[i];
    *mag += std::fabs(wq * x[i]);
  }
}

// ---- The set under test ----

#if defined(__aarch64__)
const char* SetName(bool alt) { return alt ? "neon+sdot" : "neon"; }
bool AltAvailable() { return xs::neon::SdotHardware(); }
constexpr bool kNativeBytes = true;  // hi_plain / lo_plain hold the rounded bytes

void IntMatvec(const Weight& w, const float* x, int rows, bool lo, bool alt, float* y,
               xs::IntRows& r) {
  xs::neon::QuantizeRows(x, rows, w.in, lo, r);
  r.sdot = alt;
  const uint16_t* m = xs::HasMin(w.fmt) ? w.offset.data() : nullptr;
  switch (w.fmt) {
    case xs::kS8:
      xs::neon::IntColumns<xs::kS8>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m, y,
                                    w.out, 0, w.out);
      break;
    case xs::kQ4_1:
      xs::neon::IntColumns<xs::kQ4_1>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m,
                                      y, w.out, 0, w.out);
      break;
    default:
      xs::neon::IntColumns<xs::kQ4_0>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m,
                                      y, w.out, 0, w.out);
  }
}

template <xs::Format kFmt>
void FloatMatvec(const Weight& w, const float* x, int rows, float* y) {
  std::vector<float> xsum(rows * w.Groups());
  xs::neon::GroupSums(x, rows, w.in, xsum.data());
  xs::neon::Columns<kFmt>(x, xsum.data(), rows, w.in, w.codes.data(), w.scale.data(),
                          xs::HasMin(kFmt) ? w.offset.data() : nullptr, y, w.out, 0, w.out);
}

// The set's vector exp (attention's softmax, the decoder's SwiGLU) of 4 values.
void VectorExp(const float* x, float* y) { vst1q_f32(y, xs::neon::Exp4(vld1q_f32(x))); }

template <int kKind>
void Attend(const xs::Dims& d, const float* q, const uint8_t* k, const uint8_t* v,
            const int32_t* table, int64_t q_len, float scale, int64_t window, float soft_cap,
            const float* sinks, float* out) {
  xs::neon::AttendWithScratch<kKind>(d, q, k, v, table, q_len, scale, window, soft_cap, sinks,
                                     out, 0, d.kv_heads);
}
#else
// x86-64: the AVX2 set, and (alt) the AVX-512 VNNI integer tiles where the CPU has them.
const char* SetName(bool alt) { return alt ? "avx512-vnni" : "avx2"; }
bool AltAvailable() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
constexpr bool kNativeBytes = false;  // the AVX2 set keeps int16 words (x8 / x16)

void IntMatvec(const Weight& w, const float* x, int rows, bool lo, bool alt, float* y,
               xs::IntRows& r) {
  const uint16_t* m = xs::HasMin(w.fmt) ? w.offset.data() : nullptr;
  if (alt) {
    xs::QuantizeRows(x, rows, w.in, lo, r);
    xs::IntWeight iw;
    iw.in = w.in;
    iw.codes = w.codes.data();
    iw.scale = w.scale.data();
    iw.offset = m;
    switch (w.fmt) {
      case xs::kS8:
        xs::IntColumns<xs::kS8>(r, lo, rows, iw, y, w.out, 0, w.out);
        break;
      case xs::kQ4_1:
        xs::IntColumns<xs::kQ4_1>(r, lo, rows, iw, y, w.out, 0, w.out);
        break;
      default:
        xs::IntColumns<xs::kQ4_0>(r, lo, rows, iw, y, w.out, 0, w.out);
    }
    return;
  }
  xs::avx2::QuantizeRows(x, rows, w.in, lo, r);
  switch (w.fmt) {
    case xs::kS8:
      xs::avx2::IntColumns<xs::kS8>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m, y,
                                    w.out, 0, w.out);
      break;
    case xs::kQ4_1:
      xs::avx2::IntColumns<xs::kQ4_1>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m,
                                      y, w.out, 0, w.out);
      break;
    default:
      xs::avx2::IntColumns<xs::kQ4_0>(r, lo, 0, rows, w.in, w.codes.data(), w.scale.data(), m,
                                      y, w.out, 0, w.out);
  }
}

template <xs::Format kFmt>
void FloatMatvec(const Weight& w, const float* x, int rows, float* y) {
  std::vector<float> xsum(rows * w.Groups());
  xs::avx2::GroupSums(x, rows, w.in, xsum.data());
  xs::avx2::Columns<kFmt>(x, xsum.data(), rows, w.in, w.codes.data(), w.scale.data(),
                          xs::HasMin(kFmt) ? w.offset.data() : nullptr, y, w.out, 0, w.out);
}

// The set's vector exp (attention's softmax, the decoder's SwiGLU) of 4 values.
XLASERVE_AVX2_TARGET void VectorExp(const float* x, float* y) {
  float in[8] = {x[0], x[1], x[2], x[3]}, out[8];
  _mm256_storeu_ps(out, xs::avx2::Exp8(_mm256_loadu_ps(in)));
  std::memcpy(y, out, 4 * sizeof(float));
}

template <int kKind>
void Attend(const xs::Dims& d, const float* q, const uint8_t* k, const uint8_t* v,
            const int32_t* table, int64_t q_len, float scale, int64_t window, float soft_cap,
            const float* sinks, float* out) {
  xs::avx2::AttendWithScratch<kKind>(d, q, k, v, table, q_len, scale, window, soft_cap, sinks,
                                     out, 0, d.kv_heads);
}
#endif

// ---- Checks ----

void CheckIntegerTiles(bool alt) {
  const xs::Format formats[] = {xs::kS8, xs::kQ4_1, xs::kQ4_0};
  const char* names[] = {"q8_0", "q4_1", "q4_0"};
  int checked = 0;
  for (int f = 0; f < 3; ++f) {
    for (int64_t in : {64, 256}) {
      for (int rows : {1, 3, 4, 5, 9}) {
        for (bool lo : {false, true}) {
          const int64_t out = 13;  // 3 whole 4-column tiles (2 x 8 on AVX2) and a partial one
          const Weight w = MakeWeight(formats[f], out, in);
          const std::vector<float> x = Activations(rows, in);
          std::vector<RoundedGroup> ref(rows * w.Groups());
          for (int64_t i = 0; i < rows * w.Groups(); ++i) ref[i] = RoundGroup(x.data() + i * 32);
          xs::IntRows r;
          std::vector<float> y(rows * out, NAN);
          IntMatvec(w, x.data(), rows, lo, alt, y.data(), r);
          const std::string at = std::string(SetName(alt)) + " " + names[f] + " a" +
                                 (lo ? "16" : "8") + " in " + std::to_string(in) + " rows " +
                                 std::to_string(rows);
          for (int64_t i = 0; i < rows * w.Groups(); ++i) {
            if (Bits(r.dx_group[i]) != Bits(ref[i].d) || r.xint8[i] != ref[i].xint8 ||
                Bits(r.xsum8[i]) != Bits(ref[i].xsum8) ||
                (lo && (r.xint16[i] != ref[i].xint16 ||
                        Bits(r.xsum16[i]) != Bits(ref[i].xsum16)))) {
              Fail(at + ": rounded group " + std::to_string(i));
            }
            if (kNativeBytes && !alt) {
              if (std::memcmp(r.hi_plain.data() + i * 32, ref[i].hi, 32) != 0 ||
                  (lo && std::memcmp(r.lo_plain.data() + i * 32, ref[i].lo, 32) != 0)) {
                Fail(at + ": rounded bytes of group " + std::to_string(i));
              }
            }
          }
          for (int b = 0; b < rows; ++b) {
            for (int64_t o = 0; o < out; ++o) {
              const float want = ExactReference(w, ref, b, o, lo);
              if (Bits(y[b * out + o]) != Bits(want)) {
                char buf[128];
                std::snprintf(buf, sizeof(buf), ": row %d column %ld: %.9g != %.9g", b,
                              static_cast<long>(o), y[b * out + o], want);
                Fail(at + buf);
              }
            }
          }
          ++checked;
        }
      }
    }
  }
  std::printf("integer tiles %s: %d cases bitwise equal to the reference\n", SetName(alt),
              checked);
}

template <xs::Format kFmt>
void CheckFloatFormat(const char* name) {
  int checked = 0;
  for (int64_t in : {32, 96, 256}) {
    for (int rows : {1, 2, 4, 5, 8}) {
      const int64_t out = 7;
      const Weight w = MakeWeight(kFmt, out, in);
      const std::vector<float> x = Activations(rows, in);
      std::vector<float> y(rows * out, NAN);
      FloatMatvec<kFmt>(w, x.data(), rows, y.data());
      for (int b = 0; b < rows; ++b) {
        for (int64_t o = 0; o < out; ++o) {
          double want, mag;
          FloatReference(w, x.data() + b * in, o, &want, &mag);
          if (!(std::fabs(y[b * out + o] - want) <= 1e-5 * mag + 1e-30)) {
            char buf[160];
            std::snprintf(buf, sizeof(buf), "float tiles %s %s in %ld rows %d: %.9g vs %.9g",
                          SetName(false), name, static_cast<long>(in), rows, y[b * out + o],
                          want);
            Fail(buf);
          }
        }
      }
      ++checked;
    }
  }
  std::printf("float tiles %s %s: %d cases within 1e-5\n", SetName(false), name, checked);
}

// Pages [P, ps, K, row] of kind 0 (f32), 1 (bf16) or 2 (int8 + f32 scale) from random
// values; `values` gets each stored row's float value ([P * ps * K, H]).
std::vector<uint8_t> MakePages(int kind, int64_t entries, int64_t h, std::vector<float>& values) {
  const int64_t row_bytes = kind == 0 ? 4 * h : kind == 1 ? 2 * h : h + 4;
  std::vector<uint8_t> pages(entries * row_bytes);
  values.assign(entries * h, 0.0f);
  for (int64_t e = 0; e < entries; ++e) {
    uint8_t* row = pages.data() + e * row_bytes;
    const float scale = Uniform(0.005f, 0.02f);
    for (int64_t i = 0; i < h; ++i) {
      float v = Uniform(-1.0f, 1.0f);
      if (kind == 1) {
        uint32_t u = Bits(v) & 0xFFFF0000u;
        std::memcpy(&v, &u, sizeof(v));
        const uint16_t top = static_cast<uint16_t>(u >> 16);
        std::memcpy(row + 2 * i, &top, 2);
        v = Bf16Value(top);
      } else if (kind == 2) {
        const int8_t c = static_cast<int8_t>(static_cast<int>(Next() % 255) - 127);
        row[i] = static_cast<uint8_t>(c);
        v = c * scale;
      } else {
        std::memcpy(row + 4 * i, &v, 4);
      }
      values[e * h + i] = v;
    }
    if (kind == 2) std::memcpy(row + h, &scale, 4);
  }
  return pages;
}

template <int kKind>
void CheckAttention() {
  const int64_t ps = 16, kv = 2, heads = 6, h = 64, width = 5, num_pages = 12;
  std::vector<float> kval, vval;
  const std::vector<uint8_t> kp = MakePages(kKind, num_pages * ps * kv, h, kval);
  const std::vector<uint8_t> vp = MakePages(kKind, num_pages * ps * kv, h, vval);
  const int64_t row_bytes = kKind == 0 ? 4 * h : kKind == 1 ? 2 * h : h + 4;
  const xs::Dims d{1, 1, heads, h, ps, kv, row_bytes, width};
  const int32_t table[width] = {7, 2, 11, 0, 5};
  std::vector<float> sinks(heads);
  for (auto& s : sinks) s = Uniform(-1.0f, 1.0f);
  int checked = 0;
  for (int64_t q_len : {0, 1, 15, 16, 17, 33, 80}) {
    for (int64_t window : {0, 20}) {
      for (float soft_cap : {0.0f, 5.0f}) {
        for (bool with_sinks : {false, true}) {
          std::vector<float> q(heads * h), out(heads * h, NAN);
          for (auto& v : q) v = Uniform(-3.0f, 3.0f);
          const float scale = 0.125f;
          Attend<kKind>(d, q.data(), kp.data(), vp.data(), table, q_len, scale, window, soft_cap,
                        with_sinks ? sinks.data() : nullptr, out.data());
          const int64_t lo = window > 0 ? std::max<int64_t>(0, q_len - window) : 0;
          for (int64_t n = 0; n < heads; ++n) {
            const int64_t kh = n / (heads / kv);
            std::vector<double> logits;
            for (int64_t s = lo; s < q_len; ++s) {
              const int64_t e = (table[s / ps] * ps + s % ps) * kv + kh;
              double dot = 0;
              for (int64_t i = 0; i < h; ++i) {
                dot += static_cast<double>(q[n * h + i] * scale) * kval[e * h + i];
              }
              logits.push_back(soft_cap > 0 ? soft_cap * std::tanh(dot / soft_cap) : dot);
            }
            double mx = with_sinks ? sinks[n] : -INFINITY;
            for (double x : logits) mx = std::max(mx, x);
            double den = with_sinks ? std::exp(sinks[n] - mx) : 0.0;
            std::vector<double> want(h, 0.0);
            for (size_t j = 0; j < logits.size(); ++j) {
              const double p = std::exp(logits[j] - mx);
              den += p;
              const int64_t s = lo + static_cast<int64_t>(j);
              const int64_t e = (table[s / ps] * ps + s % ps) * kv + kh;
              for (int64_t i = 0; i < h; ++i) want[i] += p * vval[e * h + i];
            }
            for (int64_t i = 0; i < h; ++i) {
              const double w = den > 0 ? want[i] / den : 0.0;
              if (!(std::fabs(out[n * h + i] - w) <= 2e-5)) {
                char buf[200];
                std::snprintf(buf, sizeof(buf),
                              "attention %s kind %d q_len %ld window %ld cap %g sinks %d head "
                              "%ld: %.8g vs %.8g",
                              SetName(false), kKind, static_cast<long>(q_len),
                              static_cast<long>(window), soft_cap, with_sinks,
                              static_cast<long>(n), out[n * h + i], w);
                Fail(buf);
              }
            }
          }
          ++checked;
        }
      }
    }
  }
  std::printf("attention %s kind %d: %d cases within 2e-5\n", SetName(false), kKind, checked);
}

// The vector exp within 2 ulp-ish (4e-7 relative) of exp on [-87, 87], and ~0 below.
void CheckExp() {
  int checked = 0;
  for (float x0 = -87.0f; x0 < 86.6f; x0 += 0.37f) {  // every lane in [-87, 87]
    const float x[4] = {x0, x0 + 0.1f, x0 + 0.2f, x0 + 0.3f};
    float y[4];
    VectorExp(x, y);
    for (int j = 0; j < 4; ++j) {
      const double want = std::exp(static_cast<double>(x[j]));
      if (!(std::fabs(y[j] - want) <= 4e-7 * want)) {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "exp %s(%.7g) = %.9g, not %.9g", SetName(false), x[j],
                      y[j], want);
        Fail(buf);
      }
      ++checked;
    }
  }
  const float low[4] = {-100.0f, -1000.0f, -88.5f, -INFINITY};
  float y[4];
  VectorExp(low, y);
  for (int j = 0; j < 4; ++j) {
    if (!(y[j] >= 0.0f && y[j] < 1e-37f)) {
      Fail(std::string("exp below the range: ") + SetName(false));
    }
  }
  std::printf("exp %s: %d values within 4e-7\n", SetName(false), checked);
}

}  // namespace

int main() {
  CheckIntegerTiles(false);
  if (AltAvailable()) {
    CheckIntegerTiles(true);
  } else {
    std::printf("integer tiles %s: not on this CPU, skipped\n", SetName(true));
  }
  CheckFloatFormat<xs::kU8>("u8");
  CheckFloatFormat<xs::kS8>("q8_0");
  CheckFloatFormat<xs::kQ4_1>("q4_1");
  CheckFloatFormat<xs::kQ4_0>("q4_0");
  CheckAttention<0>();
  CheckAttention<1>();
  CheckAttention<2>();
  CheckExp();
  std::printf("ok\n");
  return 0;
}
