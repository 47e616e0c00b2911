// Paged attention for a few queries per row, reading the KV page pool in place
// (XLA FFI custom call, CPU).
//
// out[b, t, n, :] = softmax(q[b, t, n, :] . K[b, :q_len]) . V[b, :q_len],
// where K/V of row b are the pool entries its block table points at and
// query t sees the row's first q_lens[b, t] keys (a sliding window keeps only
// the last `window` of them; window <= 0: none). With per-head sink logits
// (`sinks` [N], GPT-OSS; an empty operand: none) each head's softmax
// denominator gets exp(sink - max) and the sink contributes no value. The window
// and the sinks are operands, not attributes, so a layer stack scanned with
// lax.scan can pass its layer's values traced. Decode is T = 1; a speculative step's
// verification is T = drafts + 1. The XLA path (serving/runner/attention.py)
// gathers each block of keys into a copy laid out for its dots; here each
// key is read once, where it lies, and folded into a running (online)
// softmax per query head. Numerics: float32 scores, sums and outputs, as the
// XLA path with float32 pages. Query rows are split over XLA's intra-op threads
// (parallel.h).
//
// Pool storage: attention.h.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_pages.h"
#include "parallel.h"
#include "quant_format.h"
#if defined(__x86_64__)
#include "attention.h"
#include "attention_avx2.h"
#elif defined(__aarch64__)
#include "attention_neon.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace xlaserve;  // NOLINT: AttendQuery and the pool kinds (attention.h)

// The per-query loop of the instruction set: attention.h, attention_avx2.h or (the
// only one on aarch64) attention_neon.h.
template <Isa kIsa, int kKind>
constexpr auto QueryLoop() {
#if defined(__aarch64__)
  return &neon::AttendWithScratch<kKind>;
#else
  return kIsa == Isa::kAvx2 ? &avx2::AttendWithScratch<kKind> : &AttendWithScratch<kKind>;
#endif
}

template <Isa kIsa, int kKind>
void Attend(xla::ffi::ThreadPool& pool, const Dims& d, const float* q, const uint8_t* k_pages,
            const uint8_t* v_pages, const int32_t* tables, const int32_t* q_lens, float scale,
            int64_t window, float soft_cap, const float* sinks, float* out) {
  const int64_t max_keys = d.table_width * d.page_size;
#if !defined(__aarch64__)
  if constexpr (kIsa == Isa::kAvx512) {
    // One-query rows sharing a table (a prefill chunk's, packed) attend a span at a time:
    // each block of keys is read once for the span, not once per row, and every row's
    // output is bitwise the per-row loop's (AttendQueries).
    if (d.queries == 1 && window <= 0 && soft_cap == 0.0f && sinks == nullptr) {
      const std::vector<QuerySpan> spans = AttentionSpans(
          tables, d.batch, d.table_width, true, ThreadLimit(pool), d.kv_heads, kSpanRows);
      if (static_cast<int64_t>(spans.size()) < d.batch) {
        std::vector<int64_t> lens(d.batch);
        for (int64_t b = 0; b < d.batch; ++b) lens[b] = std::clamp<int64_t>(q_lens[b], 0, max_keys);
        const int64_t stride = d.heads * d.head_dim;
        xlaserve::ParallelFor(
            pool, static_cast<int64_t>(spans.size()) * d.kv_heads, [&](int64_t item) {
              const QuerySpan& span = spans[item / d.kv_heads];
              const int64_t kh = item % d.kv_heads;
              AttendQueriesWithScratch<kKind>(d, q + span.first * stride, stride, span.count,
                                              lens.data() + span.first, k_pages, v_pages,
                                              tables + span.first * d.table_width, scale,
                                              out + span.first * stride, stride, kh, kh + 1);
            });
        return;
      }
    }
  }
#endif
  // One query row per work item, over the caller and XLA's intra-op threads.
  xlaserve::ParallelFor(pool, d.batch * d.queries, [=, &d](int64_t row) {
    const int64_t b = row / d.queries;
    const int64_t q_len = std::clamp<int64_t>(q_lens[row], 0, max_keys);
    QueryLoop<kIsa, kKind>()(d, q + row * d.heads * d.head_dim, k_pages, v_pages,
                             tables + b * d.table_width, q_len, scale, window, soft_cap, sinks,
                             out + row * d.heads * d.head_dim, 0, d.kv_heads);
  });
}

template <Isa kIsa>
ffi::Error PagedAttentionImpl(xla::ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> tables,
                              ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::F32> sinks,
                              ffi::Buffer<ffi::S32> window_buf, ffi::ResultBuffer<ffi::F32> out,
                              float scale, float soft_cap, int64_t kind) {
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
      ld[1] != d.queries || (sinks.element_count() != 0 && sinks.element_count() != d.heads) ||
      window_buf.element_count() != 1) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  d.row_bytes = row_len * bytes;
  const int64_t window = window_buf.typed_data()[0];
  const float* sink = sinks.element_count() ? sinks.typed_data() : nullptr;
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
    Attend<kIsa, 0>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              sink, out->typed_data());
  } else if (kind == 1) {
    Attend<kIsa, 1>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              sink, out->typed_data());
  } else {
    Attend<kIsa, 2>(pool, d, q.typed_data(), k, v, t, q_lens.typed_data(), scale, window, soft_cap,
              sink, out->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

// The symbol names the operand list: a library built before sinks and the window
// operand lacks it, so `available()` is False there instead of a call failing.
static auto AttentionBinding() {
  return ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>()
      .Attr<float>("scale")
      .Attr<float>("soft_cap")
      .Attr<int64_t>("kind");
}

#if defined(__x86_64__)
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttentionSinks, PagedAttentionImpl<Isa::kAvx512>,
                              AttentionBinding());
// The same for CPUs with AVX2 + FMA + F16C (kernels_cpu/library.py picks one).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttentionSinksAvx2, PagedAttentionImpl<Isa::kAvx2>,
                              AttentionBinding());
#elif defined(__aarch64__)
// The NEON set (attention_neon.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(XlaservePagedAttentionSinksNeon, PagedAttentionImpl<Isa::kNeon>,
                              AttentionBinding());
#endif
