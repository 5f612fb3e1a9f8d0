// Fork-join threads for host-side graph construction (data/): run f(t) for t in [0, threads) on
// threads that live for one call only, so nothing is left running between calls.
//
// Graph building runs outside XLA (no FFI thread pool is at hand), on arrays of up to 2**31 edges,
// so it starts its own threads, named "jaxdata-build" (tests count jaxdata's threads to catch
// leaks); the calling thread does chunk 0 itself. Workers must not throw: callers validate their
// inputs first.
#pragma once
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "common/thread_name.h"

namespace jaxdata::data {

// The CPUs this process may run on (its affinity mask), at least 1.
inline int AvailableCpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// How many threads to use for n items: `requested` (<= 0: all available CPUs), but at least
// `min_per_thread` items each, so that small inputs run on the calling thread alone.
inline int ThreadsFor(int64_t n, int requested, int64_t min_per_thread = int64_t(1) << 16) {
  const int64_t cpus = requested > 0 ? requested : AvailableCpus();
  return int(std::clamp<int64_t>(n / std::max<int64_t>(min_per_thread, 1), 1, std::min<int64_t>(cpus, 256)));
}

// [begin, end) of part t of n items split into `parts` near-equal parts.
inline int64_t PartBegin(int64_t n, int parts, int t) { return n / parts * t + std::min<int64_t>(t, n % parts); }

template <typename F>  // F(int t)
void RunThreads(int threads, const F& f) {
  if (threads <= 1) {
    f(0);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    workers.emplace_back([&f, t] {
      NameThisThread("jaxdata-build");
      f(t);
    });
  }
  f(0);
  for (auto& w : workers) w.join();
}

// f(begin, end) over [0, n) split into `threads` parts.
template <typename F>
void ParallelRanges(int64_t n, int threads, const F& f) {
  RunThreads(threads, [&](int t) { f(PartBegin(n, threads, t), PartBegin(n, threads, t + 1)); });
}

}  // namespace jaxdata::data
