// The tracker sees every HostBuffer, per category, live and peak, from several threads at once.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/memory.h>

namespace mxddp {
namespace {

TEST(MemoryTracker, HostBufferChargesLiveAndPeakPerCategory) {
  MemoryTracker tracker;
  {
    HostBuffer grads(1000, MemoryCategory::kGrads, tracker);
    EXPECT_TRUE(is_aligned(grads.data(), kHostAlignmentBytes));
    {
      HostBuffer params(500, MemoryCategory::kParams, tracker);
      const MemoryUsage u = tracker.usage();
      EXPECT_EQ(u.live(MemoryCategory::kGrads), 1000);
      EXPECT_EQ(u.live(MemoryCategory::kParams), 500);
      EXPECT_EQ(u.total_live_bytes, 1500);
    }
    const MemoryUsage u = tracker.usage();
    EXPECT_EQ(u.live(MemoryCategory::kParams), 0);
    EXPECT_EQ(u.peak(MemoryCategory::kParams), 500);
    EXPECT_EQ(u.total_peak_bytes, 1500);
    HostBuffer moved = std::move(grads);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 1000) << "a move must not double-count or free";
  }
  EXPECT_EQ(tracker.usage().total_live_bytes, 0);
  tracker.reset_peaks();
  EXPECT_EQ(tracker.usage().total_peak_bytes, 0);
  EXPECT_NE(tracker.summary().find("optimizer_state"), std::string::npos);
}

TEST(MemoryTracker, ConcurrentChargesBalance) {
  MemoryTracker tracker;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) HostBuffer b(64 + static_cast<size_t>(i % 7), MemoryCategory::kComm, tracker);
    });
  for (auto& t : threads) t.join();
  const MemoryUsage u = tracker.usage();
  EXPECT_EQ(u.live(MemoryCategory::kComm), 0);
  EXPECT_GE(u.peak(MemoryCategory::kComm), 64);
  EXPECT_LE(u.peak(MemoryCategory::kComm), 4 * 70);
}

TEST(HostBuffer, ViewChecksCapacity) {
  MemoryTracker tracker;
  HostBuffer b(40, MemoryCategory::kScratch, tracker);
  EXPECT_EQ(b.view(DType::kF32, Shape{2, 5}).numel(), 10);
  EXPECT_THROW(b.view(DType::kF32, Shape{11}), Error);
  HostBuffer empty(0, MemoryCategory::kScratch, tracker);
  EXPECT_EQ(empty.data(), nullptr);
}

}  // namespace
}  // namespace mxddp
