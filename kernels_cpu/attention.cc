// Paged attention for a few queries per row, reading the KV page pool in place
// (XLA FFI custom call, CPU).
//
// out[b, t, n, :] = softmax(q[b, t, n, :] . K[b, :q_len]) . V[b, :q_len],
// where K/V of row b are the pool entries its block table points at and
// query t sees the row's first q_lens[b, t] keys (a sliding window keeps only
// the last `window` of them). Decode is T = 1; a speculative step's
// verification is T = drafts + 1. The XLA path (serving/runner/attention.py)
// gathers each block of keys into a copy laid out for its dots; here each
// key is read once, where it lies, and folded into a running (online)
// softmax per query head. Numerics: float32 scores, sums and outputs, as the
// XLA path with float32 pages. Query rows are split over XLA's intra-op threads
// (parallel.h).
//
// Pool storage (the last dimension of `k_pages` / `v_pages`):
//   kind 0: float32 [H];
//   kind 1: bfloat16 stored as uint16 [H];
//   kind 2: int8 rows: H one-byte codes, then the row's float32 scale.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// One (row b, query t): all N heads, grouped by their KV head.
template <int kKind>
XLASERVE_TARGET void AttendQuery(const Dims& d, const float* q, const uint8_t* k_pages,
                                 const uint8_t* v_pages, const int32_t* table, int64_t q_len,
                                 float scale, int64_t window, float soft_cap, float* out,
                                 float* acc, float* m, float* l, float* qs) {
  const int64_t h_dim = d.head_dim, group = d.heads / d.kv_heads;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_len - window) : 0;
  const int64_t n_vec = h_dim / kLanes;
  for (int64_t kh = 0; kh < d.kv_heads; ++kh) {
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

template <int kKind>
void Attend(xla::ffi::ThreadPool& pool, const Dims& d, const float* q, const uint8_t* k_pages,
            const uint8_t* v_pages, const int32_t* tables, const int32_t* q_lens, float scale,
            int64_t window, float soft_cap, float* out) {
  const int64_t group = d.heads / d.kv_heads;
  const int64_t max_keys = d.table_width * d.page_size;
  // One query row per work item, over the caller and XLA's intra-op threads.
  xlaserve::ParallelFor(pool, d.batch * d.queries, [=, &d](int64_t row) {
    thread_local std::vector<float> acc, qs, m, l;
    acc.resize(group * d.head_dim);
    qs.resize(group * d.head_dim);
    m.resize(group);
    l.resize(group);
    const int64_t b = row / d.queries;
    const int64_t q_len = std::clamp<int64_t>(q_lens[row], 0, max_keys);
    AttendQuery<kKind>(d, q + row * d.heads * d.head_dim, k_pages, v_pages,
                       tables + b * d.table_width, q_len, scale, window, soft_cap,
                       out + row * d.heads * d.head_dim, acc.data(), m.data(), l.data(),
                       qs.data());
  });
}

ffi::Error PagedAttentionImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> q_lens, ffi::ResultBuffer<ffi::F32> out,
                              float scale, int64_t window, float soft_cap, int64_t kind) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = tables.dimensions();
  auto ld = q_lens.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || ld.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q [B,T,N,H], pages [P,ps,K,R], "
                                       "tables [B,W], q_lens [B,T]");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], 0, td[1]};
  const int64_t row_len = kd[3];
  int64_t bytes = 0;
  if (kind == 0) {
    bytes = 4;
  } else if (kind == 1) {
    bytes = 2;
  } else if (kind == 2) {
    bytes = 1;
  } else {
    return ffi::Error::InvalidArgument("paged attention: unknown page kind");
  }
  const int64_t stored = kind == 2 ? d.head_dim + 4 : d.head_dim;
  if (k_pages.element_count() != v_pages.element_count() || row_len != stored ||
      d.head_dim % kLanes || d.heads % d.kv_heads || td[0] != d.batch || ld[0] != d.batch ||
      ld[1] != d.queries) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  d.row_bytes = row_len * bytes;
  const auto* k = reinterpret_cast<const uint8_t*>(k_pages.untyped_data());
  const auto* v = reinterpret_cast<const uint8_t*>(v_pages.untyped_data());
  // Page ids past the pool would read outside it: refuse the call instead.
  const int64_t num_pages = kd[0];
  const int32_t* t = tables.typed_data();
  for (int64_t i = 0; i < d.batch * d.table_width; ++i) {
    if (t[i] < 0 || t[i] >= num_pages) {
      return ffi::Error::InvalidArgument("paged attention: page id outside the pool");
    }
  }
  if (kind == 0) {
    Attend<0>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              out->typed_data());
  } else if (kind == 1) {
    Attend<1>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              out->typed_data());
  } else {
    Attend<2>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              out->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("kind"));
