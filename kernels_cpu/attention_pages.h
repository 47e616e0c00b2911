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

#include <cstdint>
#include <cstring>

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

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_ATTENTION_PAGES_H_
