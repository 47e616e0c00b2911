// The KV page pool as every instruction set's attention loops read it (no
// intrinsics): the storage kinds, the call's dimensions and the walk from a
// sequence's positions to its rows through its page table. The loops are in
// attention.h (AVX-512), attention_avx2.h and attention_neon.h.
//
// Pool storage (the last dimension of the K / V pools):
//   kind 0: float32 [H];
//   kind 1: bfloat16 stored as uint16 [H];
//   kind 2: int8 rows: H one-byte codes, then the row's float32 scale.

#ifndef XLASERVE_KERNELS_CPU_ATTENTION_PAGES_H_
#define XLASERVE_KERNELS_CPU_ATTENTION_PAGES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace xlaserve {

// Head dims are a multiple of this (the AVX-512 loops' vector; paged_attention.py).
constexpr int kLanes = 16;

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

// The key and value rows (and their scales) of positions s0 .. s0 + n - 1 of KV head kh,
// through the sequence's page table.
template <int kKind>
inline void BlockRows(const Dims& d, const int32_t* table, int64_t kh, int64_t s0, int n,
                      const uint8_t* k_pages, const uint8_t* v_pages, const uint8_t** krows,
                      float* kscale, const uint8_t** vrows, float* vscale) {
  for (int j = 0; j < n; ++j) {
    const int64_t s = s0 + j;
    const int64_t page = table[s / d.page_size];
    const int64_t entry = (page * d.page_size + s % d.page_size) * d.kv_heads + kh;
    krows[j] = k_pages + entry * d.row_bytes;
    vrows[j] = v_pages + entry * d.row_bytes;
    kscale[j] = RowScale<kKind>(krows[j], d.head_dim);
    vscale[j] = RowScale<kKind>(vrows[j], d.head_dim);
  }
}

// A query head's start: its query times `scale` into qs, the running max m and sum l
// (a sink logit, sinks[n] when sinks is not nullptr, starts them at sink and 1), and a
// zero accumulator (H floats each).
inline void StartHead(const float* qh, int64_t h_dim, float scale, const float* sinks, int64_t n,
                      float* qs, float* acc, float& m, float& l) {
  for (int64_t i = 0; i < h_dim; ++i) qs[i] = qh[i] * scale;
  m = sinks ? sinks[n] : -INFINITY;
  l = sinks ? 1.0f : 0.0f;
  std::fill(acc, acc + h_dim, 0.0f);
}

// A query head's output: acc / l (zeros when no key and no sink was seen).
inline void FinishHead(const float* acc, int64_t h_dim, float l, float* out) {
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int64_t i = 0; i < h_dim; ++i) out[i] = acc[i] * inv;
}

// This thread's scratch for `rows` query heads of H (the attention loops' acc, qs, m, l).
struct HeadScratch {
  std::vector<float> acc, qs, m, l;
};

inline HeadScratch& ThreadScratch(int64_t rows, int64_t h_dim) {
  thread_local HeadScratch s;
  s.acc.resize(rows * h_dim);
  s.qs.resize(rows * h_dim);
  s.m.resize(rows);
  s.l.resize(rows);
  return s;
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_PAGES_H_
