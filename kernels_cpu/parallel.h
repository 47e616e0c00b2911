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
//
// `Team` is the same for a sequence of parallel loops in one call (the fused
// decoder layers run ~150 of them a step): its helpers stay for the whole
// call and wait for the next loop spinning, instead of being scheduled (and
// woken) once per loop. Each loop is a `ParallelWork` the caller publishes,
// runs its share of and waits for, so a helper that never starts, or starts
// late, only leaves the caller more items; a helper holding an old loop finds
// its items all claimed and never calls its function.

#ifndef XLASERVE_KERNELS_CPU_PARALLEL_H_
#define XLASERVE_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

// A spin-wait hint to the core (x86 PAUSE, ARM YIELD).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

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

class Team {
 public:
  // Up to `threads` - 1 helpers from the pool (threads: the caller included).
  Team(xla::ffi::ThreadPool& pool, int64_t threads) : state_(std::make_shared<State>()) {
    const int64_t helpers = std::min<int64_t>(threads, ThreadLimit(pool)) - 1;
    for (int64_t h = 0; h < helpers; ++h) {
      pool.Schedule([state = state_] { state->Help(); });
    }
    helpers_ = std::max<int64_t>(helpers, 0);
  }
  ~Team() { state_->stop.store(true, std::memory_order_release); }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  // fn(0) .. fn(count - 1) over the caller and the helpers; returns when all are done.
  void For(int64_t count, std::function<void(int64_t)> fn) {
    if (count <= 0) return;
    if (helpers_ == 0 || count == 1) {
      for (int64_t i = 0; i < count; ++i) fn(i);
      return;
    }
    auto work = std::make_shared<ParallelWork>();
    work->fn = std::move(fn);
    work->count = count;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->work = work;
    }
    state_->epoch.fetch_add(1, std::memory_order_release);
    work->Run();
    // Spin for the helpers' last items, then yield: a helper the OS descheduled
    // mid-item (the host thread shares these cores) needs a core to finish on.
    for (int spins = 0; work->done.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < 2048) {
        CpuRelax();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  struct State {
    std::mutex mu;
    std::shared_ptr<ParallelWork> work;
    std::atomic<uint64_t> epoch{0};
    std::atomic<bool> stop{false};

    void Help() {
      uint64_t seen = 0;
      int idle = 0;
      while (!stop.load(std::memory_order_acquire)) {
        const uint64_t e = epoch.load(std::memory_order_acquire);
        if (e == seen) {
          // Spin between loops (microseconds apart); yield the core when it drags on.
          if (++idle < 2048) {
            CpuRelax();
          } else {
            std::this_thread::yield();
          }
          continue;
        }
        seen = e;
        idle = 0;
        std::shared_ptr<ParallelWork> w;
        {
          std::lock_guard<std::mutex> lock(mu);
          w = work;
        }
        if (w) w->Run();
      }
    }
  };
  std::shared_ptr<State> state_;
  int64_t helpers_ = 0;
};

}  // namespace xlaserve

#endif  // XLASERVE_KERNELS_CPU_PARALLEL_H_
