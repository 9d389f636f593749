// parallel_elements (src/core/parallel_elements.h): every element in exactly one range, ranges
// contiguous and split at multiples of the alignment, one range per thread at most, short and
// nested passes on the calling thread; parallel_zero zeroes exactly the bytes asked.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include <gtest/gtest.h>

#include "core/parallel_elements.h"

namespace mxddp {
namespace {

struct Range {
  int64_t begin, end;
  int thread;
};

std::vector<Range> ranges_of(int64_t n, int64_t min_per_thread, int64_t align) {
  std::vector<Range> ranges(64, Range{-1, -1, -1});
  std::atomic<int> count{0};
  parallel_elements(
      n,
      [&](int64_t b, int64_t e) {
        const int i = count.fetch_add(1);
        ranges[static_cast<size_t>(i)] = {b, e, omp_get_thread_num()};
      },
      min_per_thread, align);
  ranges.resize(static_cast<size_t>(count.load()));
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  return ranges;
}

TEST(ParallelElements, EveryElementInOneAlignedRangePerThread) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{63}, kParallelElementsPerThreadMin * 2 - 1,
                      kParallelElementsPerThreadMin * 2, kParallelElementsPerThreadMin * 3 + 7, int64_t{1} << 22}) {
      const std::vector<Range> ranges = ranges_of(n, kParallelElementsPerThreadMin, 64);
      if (n == 0) {
        EXPECT_TRUE(ranges.empty()) << "no call for nothing";
        continue;
      }
      // OMP_THREAD_LIMIT (the TSan preset sets 1) caps what a region gets.
      const int64_t cap = std::min(threads, omp_get_thread_limit());
      const int64_t want = std::max<int64_t>(1, std::min<int64_t>(cap, n / kParallelElementsPerThreadMin));
      ASSERT_EQ(static_cast<int64_t>(ranges.size()), want) << n << " elements, " << threads << " threads";
      int64_t at = 0;
      for (const Range& r : ranges) {
        EXPECT_EQ(r.begin, at) << "contiguous, no gap or overlap";
        EXPECT_LT(r.begin, r.end);
        if (r.begin != 0) {
          EXPECT_EQ(r.begin % 64, 0) << "split at a multiple of the alignment";
        }
        at = r.end;
      }
      EXPECT_EQ(at, n);
    }
  }
  omp_set_num_threads(saved);
}

TEST(ParallelElements, ItemsWithTheirOwnMinimumAndNestedCallsStayOnTheCallingThread) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  const std::vector<Range> items = ranges_of(5, 2, 1);  // e.g. the norm's chunks
  ASSERT_EQ(items.size(), omp_get_thread_limit() >= 2 ? 2u : 1u);
  EXPECT_EQ(items.front().begin, 0);
  EXPECT_EQ(items.back().end, 5);
  if (items.size() == 2) {
    EXPECT_NE(items[0].thread, items[1].thread);
  }
  std::vector<int> inner_calls(2, 0);
  int team = 0;
#pragma omp parallel num_threads(2)
  {
    const int t = omp_get_thread_num();
    if (t == 0) team = omp_get_num_threads();
    parallel_elements(int64_t{1} << 22, [&](int64_t b, int64_t e) {
      EXPECT_EQ(b, 0);
      EXPECT_EQ(e, int64_t{1} << 22);
      EXPECT_EQ(omp_get_thread_num(), t);
      ++inner_calls[static_cast<size_t>(t)];
    });
  }
  EXPECT_EQ(inner_calls, (std::vector<int>{1, team == 2 ? 1 : 0})) << "inside a parallel region: one call, on this thread";
  omp_set_num_threads(saved);
}

TEST(ParallelElements, ParallelZeroZeroesExactlyItsBytes) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  const size_t bytes = (size_t{1} << 20) + 13;
  std::vector<unsigned char> data(bytes + 2, 0xab);
  parallel_zero(data.data() + 1, bytes);
  EXPECT_EQ(data.front(), 0xab);
  EXPECT_EQ(data.back(), 0xab);
  for (size_t i = 1; i <= bytes; ++i) ASSERT_EQ(data[i], 0) << "byte " << i;
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace mxddp
