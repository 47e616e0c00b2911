// attention.h's paged attention of one query for aarch64 (Advanced SIMD): the
// same pool kinds, operands and numerics (float32 scores, a running softmax, up to
// summation order and exp rounding), in 4-float vectors, keys in blocks of 16 as
// attention.h's (`AttendBlock`: scores, one max, one vector exp and one rescale per
// block), the rows found by attention_pages.h `BlockRows`.

#ifndef XLASERVE_KERNELS_CPU_ATTENTION_NEON_H_
#define XLASERVE_KERNELS_CPU_ATTENTION_NEON_H_

#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_pages.h"

namespace xlaserve {
namespace neon {

constexpr int kLanes4 = 4;

// 4 stored values of a key/value row as float32 (scale applied for int8 rows).
template <int kKind>
inline float32x4_t Load4(const uint8_t* row, int64_t i, float row_scale) {
  if constexpr (kKind == 0) {
    return vld1q_f32(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (kKind == 1) {
    const uint16x4_t h = vld1_u16(reinterpret_cast<const uint16_t*>(row) + i);
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
  } else {
    uint32_t bytes;
    std::memcpy(&bytes, row + i, sizeof(bytes));
    const int16x8_t w = vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(bytes)));
    return vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), row_scale);
  }
}

// exp of 4 floats (attention.h Exp16's polynomial; 2^n built in the exponent bits, as
// attention_avx2.h Exp8): ~1 ulp on [-87, 87]; arguments are clamped to it (below:
// ~1e-38, the caller masks empty lanes).
inline float32x4_t Exp4(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.0f)), vdupq_n_f32(87.0f));
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500E-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507E-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073E-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894E-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459E-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201E-1f), p, r);
  const float32x4_t y = vaddq_f32(vfmaq_f32(r, vmulq_f32(p, r), r), vdupq_n_f32(1.0f));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(y, vreinterpretq_f32_s32(e));
}

// attention.h `AttendBlock` (the same operands): n <= kLanes keys for one query head.
template <int kKind>
inline void AttendBlock(const float* qg, int64_t h_dim, int n, const uint8_t* const* krows,
                        const float* kscale, const uint8_t* const* vrows, const float* vscale,
                        float soft_cap, float* scores, float& m, float& l, float* a) {
  float block_max = -INFINITY;
  for (int j = 0; j < n; ++j) {
    float32x4_t dot = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < h_dim; i += kLanes4) {
      dot = vfmaq_f32(dot, vld1q_f32(qg + i), Load4<kKind>(krows[j], i, kscale[j]));
    }
    float score = vaddvq_f32(dot);
    if (soft_cap > 0.0f) score = soft_cap * std::tanh(score / soft_cap);
    scores[j] = score;
    block_max = std::max(block_max, score);
  }
  const float m_new = std::max(m, block_max);
  const float corr = m == -INFINITY ? 0.0f : std::exp(m - m_new);
  float32x4_t sum = vdupq_n_f32(0.0f);
  for (int j = 0; j < n; j += kLanes4) {  // lanes past n: exp(-inf) would be 0; zeroed
    const uint32x4_t valid = vcltq_s32(vaddq_s32(vdupq_n_s32(j), int32x4_t{0, 1, 2, 3}),
                                       vdupq_n_s32(n));
    const float32x4_t p = vreinterpretq_f32_u32(vandq_u32(
        valid, vreinterpretq_u32_f32(Exp4(vsubq_f32(vld1q_f32(scores + j), vdupq_n_f32(m_new))))));
    vst1q_f32(scores + j, p);
    sum = vaddq_f32(sum, p);
  }
  l = l * corr + vaddvq_f32(sum);
  m = m_new;
  for (int64_t i = 0; i < h_dim; i += kLanes4) {
    float32x4_t ai = vmulq_n_f32(vld1q_f32(a + i), corr);
    for (int j = 0; j < n; ++j) {
      ai = vfmaq_n_f32(ai, Load4<kKind>(vrows[j], i, vscale[j]), scores[j]);
    }
    vst1q_f32(a + i, ai);
  }
}

// attention.h `AttendQuery` (same operands and scratch): attention_pages.h
// `AttendQueryBlocks` with this AttendBlock.
template <int kKind>
void AttendQuery(const Dims& d, const float* q, const uint8_t* k_pages, const uint8_t* v_pages,
                 const int32_t* table, int64_t q_len, float scale, int64_t window, float soft_cap,
                 const float* sinks, float* out, float* acc, float* m, float* l, float* qs,
                 int64_t kh0, int64_t kh1) {
  AttendQueryBlocks<kKind>(
      d, q, k_pages, v_pages, table, q_len, scale, window, sinks, out, acc, m, l, qs, kh0, kh1,
      [&](const float* qg, int n, const uint8_t* const* krows, const float* kscale,
          const uint8_t* const* vrows, const float* vscale, float* scores, float& mg, float& lg,
          float* a) {
        AttendBlock<kKind>(qg, d.head_dim, n, krows, kscale, vrows, vscale, soft_cap, scores, mg,
                           lg, a);
      });
}

// AttendQuery with this thread's scratch: one query row, KV heads [kh0, kh1).
template <int kKind>
void AttendWithScratch(const Dims& d, const float* q, const uint8_t* k_pages,
                       const uint8_t* v_pages, const int32_t* table, int64_t q_len, float scale,
                       int64_t window, float soft_cap, const float* sinks, float* out,
                       int64_t kh0, int64_t kh1) {
  HeadScratch& s = ThreadScratch(d.heads / d.kv_heads, d.head_dim);
  neon::AttendQuery<kKind>(d, q, k_pages, v_pages, table, q_len, scale, window, soft_cap, sinks,
                           out, s.acc.data(), s.m.data(), s.l.data(), s.qs.data(), kh0, kh1);
}

}  // namespace neon
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_NEON_H_
