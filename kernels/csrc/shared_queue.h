// Work handed out as threads become free, for the decode kernels.
//
// at::parallel_for gives each thread one fixed share of the range. In a served worker the
// engine's threads share their cores with the HTTP server and the coordinator, and when one of
// them is preempted the other finishes its share and waits: the whole call is late by the time
// the preempted thread was off its core. Here each thread takes the next chunk of indices from
// a shared counter, so the thread that is running takes over the rest of the work. Which thread
// computes an index never changes its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tandem {

// Calls `work(begin, end)` on torch's threads for consecutive chunks of [0, n), each of about
// `chunk` indices; `setup()` runs once per thread first and its result is passed to `work`.
template <typename Setup, typename Work>
void parallel_chunks(int64_t n, int64_t chunk, const Setup& setup, const Work& work) {
  std::atomic<int64_t> next{0};
  chunk = std::max<int64_t>(chunk, 1);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    auto state = setup();
    for (int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk)) {
      work(state, begin, std::min(n, begin + chunk));
    }
  });
}

}  // namespace tandem
