// Passes over long arrays (the row kernels' rows, the optimizer's update, zeroing the grad buffer)
// spread over the calling thread's OpenMP threads: a rank's compute threads where set_compute_threads ran
// (the CLI, the local backend's rank threads), OMP_NUM_THREADS or the CPUs OpenMP may use
// otherwise. Each thread gets one contiguous range, so a pass whose every element is computed on
// its own gives the same bits at any thread count. The including target links OpenMP.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mxddp {

// Below this many elements per thread, starting the threads costs more than the pass saves.
inline constexpr int64_t kParallelElementsPerThreadMin = int64_t{1} << 16;

// Calls f(begin, end) over [0, items) in one contiguous range per thread of a team of `threads`
// (at most), split at multiples of align; with threads <= 1, or from inside a parallel region, one
// call on the calling thread. Nothing is called for no items. f must not throw. Which thread runs
// a range must never change what is computed for it: that is the caller's side of the contract.
template <typename F>
void parallel_split(int64_t items, int64_t threads, int64_t align, F&& f) {
  if (items <= 0) return;
  if (threads <= 1 || omp_in_parallel()) {
    f(int64_t{0}, items);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t begin = t == 0 ? 0 : items * t / nt / align * align;
    const int64_t end = t + 1 == nt ? items : items * (t + 1) / nt / align * align;
    if (begin < end) f(begin, end);
  }
}

// parallel_split over [0, n) on the calling thread's OpenMP threads, at most one per
// min_per_thread elements; the split points are multiples of align (the default 64: no two threads
// write one cache line of f32 or BF16 data).
template <typename F>
void parallel_elements(int64_t n, F&& f, int64_t min_per_thread = kParallelElementsPerThreadMin, int64_t align = 64) {
  parallel_split(n, std::min<int64_t>(omp_get_max_threads(), n / min_per_thread), align, f);
}

// memset(data, 0, bytes) over the calling thread's OpenMP threads: zeroing a grad buffer, every
// iteration.
inline void parallel_zero(void* data, size_t bytes) {
  auto* at = static_cast<unsigned char*>(data);
  parallel_elements(static_cast<int64_t>(bytes),
                    [&](int64_t b0, int64_t b1) { std::memset(at + b0, 0, static_cast<size_t>(b1 - b0)); });
}

}  // namespace mxddp
