// How work is spread over torch's threads without changing any result.
#pragma once

#include "simd.h"

namespace adaspark {

// Per-row work between the matmuls, f(r) for rows [0, n): on both threads when the call has
// enough rows to pay for a parallel region. Each row runs the same code on either thread.
template <class F>
void for_rows(int64_t n, const F& f) {
  constexpr int64_t kRowsPerThread = 4;
  if (n < 2 * kRowsPerThread) {
    for (int64_t r = 0; r < n; ++r) f(r);
    return;
  }
  at::parallel_for(0, n, kRowsPerThread, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// Calls f(i, ahead, first) for every i in [0, n), each on one of torch's threads: ahead is the
// index the same thread takes next (-1 if none: what to prefetch), first whether i is the
// thread's first. The threads claim indices a few at a time from a shared counter instead of
// taking a fixed half each, so a thread slowed by another process on its core takes fewer and
// the call does not wait for it (a static split runs at the pace of the slowest core). Which
// thread computes an index changes nothing in its result. begin() / end() run once per thread.
struct Nothing {  // a hook that does nothing, whatever it is passed
  template <class... A>
  void operator()(const A&...) const {}
};
template <class F, class Begin = Nothing, class End = Nothing>
void for_claimed(int64_t n, const F& f, const Begin& begin = {}, const End& end = {}) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t claim = std::max<int64_t>(1, (n + 8 * threads - 1) / (8 * threads));  // ~8 each
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    begin();
    bool first = true;
    for (int64_t at = counter.fetch_add(claim); at < n;) {
      const int64_t next = counter.fetch_add(claim);  // claimed ahead, for the prefetch
      const int64_t stop = std::min(at + claim, n);
      for (int64_t i = at; i < stop; ++i, first = false)
        f(i, i + 1 < stop ? i + 1 : (next < n ? next : -1), first);
      at = next;
    }
    end();
  });
}

}  // namespace adaspark
