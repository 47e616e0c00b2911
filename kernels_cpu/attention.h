// Paged attention of one query over a row's keys, read in place in the KV page
// pool with a running (online) softmax: the building block of the paged
// attention custom call (attention.cc) and the fused decoder layers
// (decoder.cc).
//
// Pool storage (the last dimension of the K / V pools):
//   kind 0: float32 [H];
//   kind 1: bfloat16 stored as uint16 [H];
//   kind 2: int8 rows: H one-byte codes, then the row's float32 scale.

#ifndef XLASERVE_KERNELS_CPU_ATTENTION_H_
#define XLASERVE_KERNELS_CPU_ATTENTION_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace xlaserve {

#define XLASERVE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))

constexpr int kLanes = 16;

// 16 stored values of a key/value row as float32 (scale applied for int8 rows).
template <int kKind>
XLASERVE_TARGET inline __m512 Load16(const uint8_t* row, int64_t i, __m512 row_scale) {
  if constexpr (kKind == 0) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (kKind == 1) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        reinterpret_cast<const uint16_t*>(row) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), row_scale);
  }
}

template <int kKind>
inline float RowScale(const uint8_t* row, int64_t head_dim) {
  if constexpr (kKind == 2) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(s));
    return s;
  }
  return 1.0f;
}

struct Dims {
  int64_t batch, queries, heads, head_dim;  // B, T, N, H
  int64_t page_size, kv_heads, row_bytes;   // ps, K, bytes of one stored [H] row
  int64_t table_width;                      // W
};

// One (row b, query t): the query heads of KV heads [kh0, kh1), grouped by KV head.
// `acc`, `qs`: G * H floats of scratch; `m`, `l`: G.
template <int kKind>
XLASERVE_TARGET void AttendQuery(const Dims& d, const float* q, const uint8_t* k_pages,
                                 const uint8_t* v_pages, const int32_t* table, int64_t q_len,
                                 float scale, int64_t window, float soft_cap, float* out,
                                 float* acc, float* m, float* l, float* qs, int64_t kh0,
                                 int64_t kh1) {
  const int64_t h_dim = d.head_dim, group = d.heads / d.kv_heads;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_len - window) : 0;
  const int64_t n_vec = h_dim / kLanes;
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = q + (kh * group + g) * h_dim;
      for (int64_t i = 0; i < h_dim; ++i) qs[g * h_dim + i] = qh[i] * scale;
      m[g] = -INFINITY;
      l[g] = 0.0f;
      std::fill(acc + g * h_dim, acc + (g + 1) * h_dim, 0.0f);
    }
    for (int64_t s = lo; s < q_len; ++s) {
      const int64_t page = table[s / d.page_size];
      const int64_t entry = (page * d.page_size + s % d.page_size) * d.kv_heads + kh;
      const uint8_t* krow = k_pages + entry * d.row_bytes;
      const uint8_t* vrow = v_pages + entry * d.row_bytes;
      const __m512 ks = _mm512_set1_ps(RowScale<kKind>(krow, h_dim));
      const __m512 vs = _mm512_set1_ps(RowScale<kKind>(vrow, h_dim));
      for (int64_t g = 0; g < group; ++g) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t j = 0; j < n_vec; ++j) {
          dot = _mm512_fmadd_ps(_mm512_loadu_ps(qs + g * h_dim + j * kLanes),
                                Load16<kKind>(krow, j * kLanes, ks), dot);
        }
        float score = _mm512_reduce_add_ps(dot);
        if (soft_cap > 0.0f) score = soft_cap * std::tanh(score / soft_cap);
        float p = 1.0f, corr = 1.0f;
        if (score > m[g]) {
          corr = std::exp(m[g] - score);  // 0 for the first key (m = -inf)
          m[g] = score;
        } else {
          p = std::exp(score - m[g]);
        }
        l[g] = l[g] * corr + p;
        float* a = acc + g * h_dim;
        const __m512 pv = _mm512_set1_ps(p), cv = _mm512_set1_ps(corr);
        for (int64_t j = 0; j < n_vec; ++j) {
          const __m512 v = Load16<kKind>(vrow, j * kLanes, vs);
          _mm512_storeu_ps(a + j * kLanes,
                           _mm512_fmadd_ps(pv, v, _mm512_mul_ps(cv, _mm512_loadu_ps(a + j * kLanes))));
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* o = out + (kh * group + g) * h_dim;
      const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
      for (int64_t i = 0; i < h_dim; ++i) o[i] = acc[g * h_dim + i] * inv;
    }
  }
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_H_
