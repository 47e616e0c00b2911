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

// One (row b, query t): the query heads of KV heads [kh0, kh1), grouped by KV head, in
// blocks of kLanes keys through the instruction set's step `block(qg, n, krows, kscale,
// vrows, vscale, scores, m, l, a)` (attention.h `AttendBlock`: one block of n keys for
// one query head; `scores`: kLanes floats of 64-byte-aligned scratch). `acc`, `qs`: G * H
// floats of scratch; `m`, `l`: G. `window` <= 0: no window. `sinks` (nullptr: none): [N]
// per-head sink logits (GPT-OSS), which join each head's softmax denominator with no
// value: m starts at the sink and l at exp(sink - sink) = 1.
template <int kKind, typename Block>
inline void AttendQueryBlocks(const Dims& d, const float* q, const uint8_t* k_pages,
                              const uint8_t* v_pages, const int32_t* table, int64_t q_len,
                              float scale, int64_t window, const float* sinks, float* out,
                              float* acc, float* m, float* l, float* qs, int64_t kh0,
                              int64_t kh1, Block&& block) {
  const int64_t h_dim = d.head_dim, group = d.heads / d.kv_heads;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, q_len - window) : 0;
  alignas(64) float scores[kLanes];
  const uint8_t* krows[kLanes];
  const uint8_t* vrows[kLanes];
  float kscale[kLanes], vscale[kLanes];
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    for (int64_t g = 0; g < group; ++g) {
      StartHead(q + (kh * group + g) * h_dim, h_dim, scale, sinks, kh * group + g,
                qs + g * h_dim, acc + g * h_dim, m[g], l[g]);
    }
    for (int64_t s0 = lo; s0 < q_len; s0 += kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, q_len - s0));
      BlockRows<kKind>(d, table, kh, s0, n, k_pages, v_pages, krows, kscale, vrows, vscale);
      for (int64_t g = 0; g < group; ++g) {
        block(qs + g * h_dim, n, krows, kscale, vrows, vscale, scores, m[g], l[g],
              acc + g * h_dim);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      FinishHead(acc + g * h_dim, h_dim, l[g], out + (kh * group + g) * h_dim);
    }
  }
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

// A run of consecutive rows that attend together (attention.h AttendQueries).
struct QuerySpan {
  int64_t first, count;
};

// Rows of one page table that attend together at most (AttentionSpans' max_rows, for the
// paged attention and the fused decoder): 16 queries' scratch (accumulators, scaled
// queries) stays in L1 beside a block of keys.
constexpr int64_t kSpanRows = 16;

// The attention work of a call: consecutive rows with the same page table (row b's at
// table + b * width: a prefill chunk's rows, a verify step's positions of one sequence)
// in one span when `group`, so that their keys are read once, not once per row. A run is
// cut into pieces of at most `max_rows` rows (their scratch stays in cache) and into at
// least as many as keep `threads` busy (2 items per thread over the KV heads). Otherwise
// one span per row.
inline std::vector<QuerySpan> AttentionSpans(const int32_t* table, int64_t rows, int64_t width,
                                             bool group, int64_t threads, int64_t kv_heads,
                                             int64_t max_rows) {
  std::vector<QuerySpan> runs;
  for (int64_t b = 0; b < rows; ++b) {
    if (group && !runs.empty() &&
        std::memcmp(table + runs.back().first * width, table + b * width,
                    width * sizeof(int32_t)) == 0) {
      ++runs.back().count;
    } else {
      runs.push_back({b, 1});
    }
  }
  if (static_cast<int64_t>(runs.size()) == rows) return runs;
  const int64_t wanted = (2 * threads + kv_heads - 1) / kv_heads;  // spans for 2 per thread
  const int64_t pieces = std::max<int64_t>(1, (wanted + static_cast<int64_t>(runs.size()) - 1) /
                                                  static_cast<int64_t>(runs.size()));
  std::vector<QuerySpan> spans;
  for (const QuerySpan& run : runs) {
    const int64_t n =
        std::min(run.count, std::max(pieces, (run.count + max_rows - 1) / max_rows));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lo = run.first + run.count * i / n, hi = run.first + run.count * (i + 1) / n;
      spans.push_back({lo, hi - lo});
    }
  }
  return spans;
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_PAGES_H_
