// ParallelFor over XLA's CPU thread pool (ffi::ThreadPool).
//
// The calling thread works too, and tasks take chunks from a shared counter, so the call never
// waits for a pool thread that has not started (no deadlock when the caller is itself a pool
// thread). Chunks that are running when the caller runs out of work are waited for; tasks that
// start after that find nothing left and touch nothing but the shared counter.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxdata {

template <typename F>  // F(int64_t begin, int64_t end)
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t grain, const F& f) {
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t workers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  if (workers <= 0) {
    if (n > 0) f(0, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    int64_t done = 0;  // guarded by mu
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  // Runs chunks until none are left; returns how many it ran.
  auto drain = [state, chunks, grain, n, &f]() {
    int64_t ran = 0;
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks; ++ran) {
      f(c * grain, std::min(n, (c + 1) * grain));
    }
    return ran;
  };
  auto finish = [state](int64_t ran) {
    if (ran == 0) return;
    std::lock_guard<std::mutex> lock(state->mu);
    state->done += ran;
    state->cv.notify_all();
  };
  for (int64_t w = 0; w < workers; ++w) {
    // A task that starts late sees next >= chunks and never calls f (whose captures may be gone).
    pool.Schedule([state, chunks, drain, finish]() {
      if (state->next.load() >= chunks) return;
      finish(drain());
    });
  }
  finish(drain());
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done == chunks; });
}

}  // namespace jaxdata
