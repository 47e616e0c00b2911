// attention.h's paged attention of one query for CPUs with AVX2, FMA and F16C
// but no AVX-512: the same pool kinds, operands and numerics (float32 scores, a
// running softmax, up to summation order and exp rounding), in 8-float vectors,
// keys in blocks of 8.

#ifndef XLASERVE_KERNELS_CPU_ATTENTION_AVX2_H_
#define XLASERVE_KERNELS_CPU_ATTENTION_AVX2_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "quant_dot_avx2.h"

namespace xlaserve {
namespace avx2 {

constexpr int kLanes8 = 8;

// 8 stored values of a key/value row as float32 (scale applied for int8 rows).
template <int kKind>
XLASERVE_AVX2_TARGET inline __m256 Load8(const uint8_t* row, int64_t i, __m256 row_scale) {
  if constexpr (kKind == 0) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (kKind == 1) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        reinterpret_cast<const uint16_t*>(row) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), row_scale);
  }
}

// exp of 8 floats (attention.h Exp16's polynomial; 2^n built in the exponent bits):
// ~1 ulp on [-87, 87]; arguments are clamped to it (below: ~1e-38, the caller masks
// empty lanes).
XLASERVE_AVX2_TARGET inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// attention.h `AttendQuery` (same operands and scratch), keys in blocks of 8.
template <int kKind>
XLASERVE_AVX2_TARGET void AttendQuery(const Dims& d, const float* q, const uint8_t* k_pages,
                                      const uint8_t* v_pages, const int32_t* table, int64_t q_len,
                                      float scale, int64_t window, float soft_cap,
                                      const float* sinks, float* out, float* acc, float* m,
                                      float* l, float* qs, int64_t kh0, int64_t kh1) {
  const int64_t h_dim = d.head_dim, group = d.heads / d.kv_heads;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_len - window) : 0;
  const int64_t n_vec = h_dim / kLanes8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float scores[kLanes8];
  const uint8_t* vrows[kLanes8];
  float vscale[kLanes8];
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    for (int64_t g = 0; g < group; ++g) {
      StartHead(q + (kh * group + g) * h_dim, h_dim, scale, sinks, kh * group + g,
                qs + g * h_dim, acc + g * h_dim, m[g], l[g]);
    }
    for (int64_t s0 = lo; s0 < q_len; s0 += kLanes8) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes8, q_len - s0));
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
      const uint8_t* krows[kLanes8];
      for (int j = 0; j < n; ++j) {
        const int64_t s = s0 + j;
        const int64_t page = table[s / d.page_size];
        const int64_t entry = (page * d.page_size + s % d.page_size) * d.kv_heads + kh;
        krows[j] = k_pages + entry * d.row_bytes;
        vrows[j] = v_pages + entry * d.row_bytes;
        vscale[j] = RowScale<kKind>(vrows[j], h_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qs + g * h_dim;
        float block_max = -INFINITY;
        for (int j = 0; j < kLanes8; ++j) {
          if (j >= n) {
            scores[j] = -INFINITY;
            continue;
          }
          const __m256 ks = _mm256_set1_ps(RowScale<kKind>(krows[j], h_dim));
          __m256 dot = _mm256_setzero_ps();
          for (int64_t i = 0; i < n_vec; ++i) {
            dot = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i * kLanes8),
                                  Load8<kKind>(krows[j], i * kLanes8, ks), dot);
          }
          float score = Sum8(dot);
          if (soft_cap > 0.0f) score = soft_cap * std::tanh(score / soft_cap);
          scores[j] = score;
          block_max = std::max(block_max, score);
        }
        const float m_new = std::max(m[g], block_max);
        const float corr = m[g] == -INFINITY ? 0.0f : std::exp(m[g] - m_new);
        const __m256 p = _mm256_and_ps(
            valid, Exp8(_mm256_sub_ps(_mm256_load_ps(scores), _mm256_set1_ps(m_new))));
        l[g] = l[g] * corr + Sum8(p);
        m[g] = m_new;
        _mm256_store_ps(scores, p);
        float* a = acc + g * h_dim;
        const __m256 cv = _mm256_set1_ps(corr);
        // Four accumulators at a time, keys innermost (attention.h AttendBlock).
        for (int64_t i0 = 0; i0 < n_vec; i0 += 4) {
          const int u_n = static_cast<int>(std::min<int64_t>(4, n_vec - i0));
          __m256 ai[4];
          for (int u = 0; u < u_n; ++u) {
            ai[u] = _mm256_mul_ps(cv, _mm256_loadu_ps(a + (i0 + u) * kLanes8));
          }
          for (int j = 0; j < n; ++j) {
            const __m256 pj = _mm256_set1_ps(scores[j]), vs = _mm256_set1_ps(vscale[j]);
            for (int u = 0; u < u_n; ++u) {
              ai[u] = _mm256_fmadd_ps(pj, Load8<kKind>(vrows[j], (i0 + u) * kLanes8, vs), ai[u]);
            }
          }
          for (int u = 0; u < u_n; ++u) _mm256_storeu_ps(a + (i0 + u) * kLanes8, ai[u]);
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      FinishHead(acc + g * h_dim, h_dim, l[g], out + (kh * group + g) * h_dim);
    }
  }
}

// AttendQuery with this thread's scratch: one query row, KV heads [kh0, kh1).
template <int kKind>
void AttendWithScratch(const Dims& d, const float* q, const uint8_t* k_pages,
                       const uint8_t* v_pages, const int32_t* table, int64_t q_len, float scale,
                       int64_t window, float soft_cap, const float* sinks, float* out,
                       int64_t kh0, int64_t kh1) {
  HeadScratch& s = ThreadScratch(d.heads / d.kv_heads, d.head_dim);
  avx2::AttendQuery<kKind>(d, q, k_pages, v_pages, table, q_len, scale, window, soft_cap, sinks,
                           out, s.acc.data(), s.m.data(), s.l.data(), s.qs.data(), kh0, kh1);
}

}  // namespace avx2
}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_AVX2_H_
