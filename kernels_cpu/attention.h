// Paged attention of one query over a row's keys, read in place in the KV page
// pool with a running (online) softmax: the building block of the paged
// attention custom call (attention.cc) and the fused decoder layers
// (decoder.cc). Pool storage and page walks: attention_pages.h.

#ifndef XLASERVE_KERNELS_CPU_ATTENTION_H_
#define XLASERVE_KERNELS_CPU_ATTENTION_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_pages.h"

namespace xlaserve {

#define XLASERVE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))

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

// exp of 16 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, then
// 2^n by scalef): ~1 ulp; arguments below -88 give ~0 (the caller masks empty lanes).
XLASERVE_TARGET inline __m512 Exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)),
                    _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// The lane sums of 16 vectors as one vector (lane j: the sum of d[j]'s lanes), in a tree
// of 15 adds and 30 shuffles shared by all 16 instead of a horizontal reduction each
// (~2.8 instead of ~9 operations a key).
XLASERVE_TARGET inline __m512 SumEach16(const __m512* d) {
  __m512 s[8], w[4], y[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: (a0+a2) (b0+b2) (a1+a3) (b1+b3)
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                         _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per block: keys 4i .. 4i+3, summed within the block
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 2; ++i) {  // blocks: w[2i] (b0+b1), w[2i] (b2+b3), w[2i+1] (...)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // Block k: the whole sums of keys 4k .. 4k+3.
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One block of n <= 16 keys for one query head: the scores of `qg` (scaled query) against
// rows krows (scales kscale), soft-capped when soft_cap > 0, one max, one vector exp and
// one rescale of the running max `m`, sum `l` and accumulator `a` (H floats), then the
// value rows vrows (scales vscale) into `a`. `scores`: 16 floats of 64-byte-aligned scratch.
// AttendQuery and AttendQueries both step through this, so they agree bit for bit.
template <int kKind>
XLASERVE_TARGET inline void AttendBlock(const float* qg, int64_t n_vec, int n,
                                        const uint8_t* const* krows, const float* kscale,
                                        const uint8_t* const* vrows, const float* vscale,
                                        float soft_cap, float* scores, float& m, float& l,
                                        float* a) {
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  __m512 dots[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    dots[j] = _mm512_setzero_ps();
    if (j >= n) continue;
    const __m512 ks = _mm512_set1_ps(kscale[j]);
    for (int64_t i = 0; i < n_vec; ++i) {
      dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i * kLanes),
                                Load16<kKind>(krows[j], i * kLanes, ks), dots[j]);
    }
  }
  __m512 sv = SumEach16(dots);
  if (soft_cap > 0.0f) {
    _mm512_store_ps(scores, sv);
    for (int j = 0; j < n; ++j) scores[j] = soft_cap * std::tanh(scores[j] / soft_cap);
    sv = _mm512_load_ps(scores);
  }
  sv = _mm512_maskz_mov_ps(valid, sv);
  const float block_max = _mm512_mask_reduce_max_ps(valid, sv);
  const float m_new = std::max(m, block_max);
  const float corr = m == -INFINITY ? 0.0f : std::exp(m - m_new);
  const __m512 p = _mm512_maskz_mov_ps(valid, Exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
  l = l * corr + _mm512_reduce_add_ps(p);
  m = m_new;
  _mm512_store_ps(scores, p);
  // Four accumulators at a time, keys innermost: four independent chains of FMAs rather
  // than one at a time (each element still sums its keys in order j = 0, 1, ...). Twice
  // the speed of a prefill chunk's attention over a long context (docs/performance.md).
  const __m512 cv = _mm512_set1_ps(corr);
  for (int64_t i0 = 0; i0 < n_vec; i0 += 4) {
    const int u_n = static_cast<int>(std::min<int64_t>(4, n_vec - i0));
    __m512 acc[4];
    for (int u = 0; u < u_n; ++u) acc[u] = _mm512_mul_ps(cv, _mm512_loadu_ps(a + (i0 + u) * kLanes));
    for (int j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(scores[j]), vs = _mm512_set1_ps(vscale[j]);
      for (int u = 0; u < u_n; ++u) {
        acc[u] = _mm512_fmadd_ps(pj, Load16<kKind>(vrows[j], (i0 + u) * kLanes, vs), acc[u]);
      }
    }
    for (int u = 0; u < u_n; ++u) _mm512_storeu_ps(a + (i0 + u) * kLanes, acc[u]);
  }
}

// One (row b, query t): attention_pages.h `AttendQueryBlocks` with `AttendBlock`.
template <int kKind>
XLASERVE_TARGET void AttendQuery(const Dims& d, const float* q, const uint8_t* k_pages,
                                 const uint8_t* v_pages, const int32_t* table, int64_t q_len,
                                 float scale, int64_t window, float soft_cap, const float* sinks,
                                 float* out, float* acc, float* m, float* l, float* qs,
                                 int64_t kh0, int64_t kh1) {
  const int64_t n_vec = d.head_dim / kLanes;
  AttendQueryBlocks<kKind>(
      d, q, k_pages, v_pages, table, q_len, scale, window, sinks, out, acc, m, l, qs, kh0, kh1,
      [&](const float* qg, int n, const uint8_t* const* krows, const float* kscale,
          const uint8_t* const* vrows, const float* vscale, float* scores, float& mg, float& lg,
          float* a) XLASERVE_TARGET {
        AttendBlock<kKind>(qg, n_vec, n, krows, kscale, vrows, vscale, soft_cap, scores, mg, lg,
                           a);
      });
}

// Queries [0, nq) of one sequence (one page table), KV heads [kh0, kh1), no window, soft
// cap or sinks: query t at q + t * q_stride attends to its own first q_lens[t] keys and
// writes out + t * out_stride. Each block of 16 keys is read (addresses, rows) once for
// all queries that reach it; per query the arithmetic is AttendQuery's, block by block in
// the same order, so every query's output is bitwise AttendQuery's. A verify step's
// positions (speculative decoding) read the sequence's keys once instead of once each.
// `acc`, `qs`: nq * G * H floats of scratch; `m`, `l`: nq * G.
template <int kKind>
XLASERVE_TARGET void AttendQueries(const Dims& d, const float* q, int64_t q_stride, int64_t nq,
                                   const int64_t* q_lens, const uint8_t* k_pages,
                                   const uint8_t* v_pages, const int32_t* table, float scale,
                                   float* out, int64_t out_stride, float* acc, float* m, float* l,
                                   float* qs, int64_t kh0, int64_t kh1) {
  const int64_t h_dim = d.head_dim, group = d.heads / d.kv_heads, n_vec = h_dim / kLanes;
  const int64_t rows = nq * group;  // (query, head of the group) pairs
  const int64_t max_len = nq > 0 ? *std::max_element(q_lens, q_lens + nq) : 0;
  alignas(64) float scores[kLanes];
  const uint8_t* krows[kLanes];
  const uint8_t* vrows[kLanes];
  float kscale[kLanes], vscale[kLanes];
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / group, g = r % group;
      StartHead(q + t * q_stride + (kh * group + g) * h_dim, h_dim, scale, nullptr, 0,
                qs + r * h_dim, acc + r * h_dim, m[r], l[r]);
    }
    for (int64_t s0 = 0; s0 < max_len; s0 += kLanes) {
      const int n_all = static_cast<int>(std::min<int64_t>(kLanes, max_len - s0));
      BlockRows<kKind>(d, table, kh, s0, n_all, k_pages, v_pages, krows, kscale, vrows, vscale);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t q_len = q_lens[r / group];
        if (s0 >= q_len) continue;  // past this query's keys: AttendQuery never gets here
        const int n = static_cast<int>(std::min<int64_t>(kLanes, q_len - s0));
        AttendBlock<kKind>(qs + r * h_dim, n_vec, n, krows, kscale, vrows, vscale, 0.0f, scores,
                           m[r], l[r], acc + r * h_dim);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r / group, g = r % group;
      FinishHead(acc + r * h_dim, h_dim, l[r], out + t * out_stride + (kh * group + g) * h_dim);
    }
  }
}

// AttendQueries with this thread's scratch.
template <int kKind>
void AttendQueriesWithScratch(const Dims& d, const float* q, int64_t q_stride, int64_t nq,
                              const int64_t* q_lens, const uint8_t* k_pages,
                              const uint8_t* v_pages, const int32_t* table, float scale,
                              float* out, int64_t out_stride, int64_t kh0, int64_t kh1) {
  HeadScratch& s = ThreadScratch(nq * (d.heads / d.kv_heads), d.head_dim);
  AttendQueries<kKind>(d, q, q_stride, nq, q_lens, k_pages, v_pages, table, scale, out,
                       out_stride, s.acc.data(), s.m.data(), s.l.data(), s.qs.data(), kh0, kh1);
}

// AttendQuery with this thread's scratch: one query row, KV heads [kh0, kh1).
template <int kKind>
void AttendWithScratch(const Dims& d, const float* q, const uint8_t* k_pages,
                       const uint8_t* v_pages, const int32_t* table, int64_t q_len, float scale,
                       int64_t window, float soft_cap, const float* sinks, float* out,
                       int64_t kh0, int64_t kh1) {
  HeadScratch& s = ThreadScratch(d.heads / d.kv_heads, d.head_dim);
  AttendQuery<kKind>(d, q, k_pages, v_pages, table, q_len, scale, window, soft_cap, sinks, out,
                     s.acc.data(), s.m.data(), s.l.data(), s.qs.data(), kh0, kh1);
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_H_
