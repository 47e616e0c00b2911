// Splitting a custom call's work over XLA:CPU's intra-op thread pool.
//
// `ParallelFor(pool, n, fn)` runs fn(0) .. fn(n - 1) on the calling thread and
// on up to pool.num_threads() pool threads. Every thread, the caller included,
// claims work items from one atomic counter, so the caller never waits for an
// item nobody started: a pool whose threads are all busy (another op running
// concurrently, or the same kernel waiting elsewhere) only means the caller
// does more of the items itself, never a deadlock. A pool task that starts
// after every item is claimed finds nothing to do; the state it touches is
// held by a shared_ptr, so it outlives the call.

#ifndef XLASERVE_KERNELS_CPU_PARALLEL_H_
#define XLASERVE_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

struct ParallelWork {
  std::function<void(int64_t)> fn;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Threads a call may use, the caller included: XLASERVE_NATIVE_THREADS when set (a
// tuning knob), else the caller plus every pool thread.
inline int64_t ThreadLimit(xla::ffi::ThreadPool& pool) {
  static const int64_t limit = [] {
    const char* env = std::getenv("XLASERVE_NATIVE_THREADS");
    return env == nullptr ? int64_t{0} : std::max<int64_t>(1, std::atoll(env));
  }();
  const int64_t all = pool.num_threads() + 1;
  return limit > 0 ? std::min(limit, all) : all;
}

inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count,
                        std::function<void(int64_t)> fn) {
  if (count <= 0) return;
  const int64_t helpers = std::min<int64_t>(ThreadLimit(pool) - 1, count - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  auto work = std::make_shared<ParallelWork>();
  work->fn = std::move(fn);
  work->count = count;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_PARALLEL_H_
