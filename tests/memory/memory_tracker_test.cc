// The tracker sees every HostBuffer, per category, live and peak, from several threads at once, and
// keeps the device's bytes apart from the host's.
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
  EXPECT_EQ(tracker.summary().find("device"), std::string::npos) << "a host-only tracker has one pair of columns";
  EXPECT_EQ(tracker.usage().at(MemoryPlace::kDevice).total_peak_bytes, 0);
}

// A plan's tracker places a category's charges without a place where set_default_place says; an
// explicit place still wins, and the other categories keep the host.
TEST(MemoryTracker, ADefaultPlacePerCategoryTakesChargesWithoutAPlace) {
  MemoryTracker tracker;
  tracker.set_default_place(MemoryCategory::kGrads, MemoryPlace::kDevice);
  EXPECT_EQ(tracker.default_place(MemoryCategory::kGrads), MemoryPlace::kDevice);
  EXPECT_EQ(tracker.default_place(MemoryCategory::kScratch), MemoryPlace::kHost);
  tracker.on_allocate(MemoryCategory::kGrads, 1000);
  tracker.on_allocate(MemoryCategory::kGrads, 24, MemoryPlace::kHost);
  tracker.on_allocate(MemoryCategory::kScratch, 500);
  tracker.on_free(MemoryCategory::kGrads, 400);
  const MemoryUsage u = tracker.usage();
  EXPECT_EQ(u.at(MemoryPlace::kDevice).live(MemoryCategory::kGrads), 600);
  EXPECT_EQ(u.at(MemoryPlace::kDevice).peak(MemoryCategory::kGrads), 1000);
  EXPECT_EQ(u.at(MemoryPlace::kHost).live(MemoryCategory::kGrads), 24);
  EXPECT_EQ(u.at(MemoryPlace::kHost).live(MemoryCategory::kScratch), 500);
  EXPECT_EQ(u.live(MemoryCategory::kGrads), 624);
}

TEST(MemoryTracker, DeviceAndHostBytesAreChargedApartAndTogether) {
  MemoryTracker tracker;
  tracker.on_allocate(MemoryCategory::kGrads, 4096, MemoryPlace::kDevice);
  tracker.on_allocate(MemoryCategory::kGrads, 100);  // the host by default
  tracker.on_allocate(MemoryCategory::kComm, 300);
  tracker.on_free(MemoryCategory::kComm, 300);
  tracker.on_allocate(MemoryCategory::kOptimizerState, 8192, MemoryPlace::kDevice);
  const MemoryUsage u = tracker.usage();
  const MemoryAmounts& device = u.at(MemoryPlace::kDevice);
  const MemoryAmounts& host = u.at(MemoryPlace::kHost);
  EXPECT_EQ(device.live(MemoryCategory::kGrads), 4096);
  EXPECT_EQ(host.live(MemoryCategory::kGrads), 100);
  EXPECT_EQ(u.live(MemoryCategory::kGrads), 4196);
  EXPECT_EQ(device.total_live_bytes, 4096 + 8192);
  // Each place's peak is its own: the host's came with the comm bytes, before the device's last.
  EXPECT_EQ(host.total_peak_bytes, 400);
  EXPECT_EQ(device.total_peak_bytes, 4096 + 8192);
  EXPECT_EQ(u.total_peak_bytes, 4096 + 8192 + 100);
  EXPECT_EQ(host.peak(MemoryCategory::kComm), 300);
  EXPECT_EQ(device.peak(MemoryCategory::kComm), 0);
  // With device bytes the summary shows both places.
  const std::string summary = tracker.summary();
  EXPECT_NE(summary.find("device_peak"), std::string::npos) << summary;
  EXPECT_NE(summary.find("host_peak"), std::string::npos) << summary;
  // Two periods as one keep each place's own peaks.
  tracker.on_free(MemoryCategory::kOptimizerState, 8192, MemoryPlace::kDevice);
  tracker.reset_peaks();
  const MemoryUsage later = tracker.usage();
  EXPECT_EQ(later.at(MemoryPlace::kDevice).total_peak_bytes, 4096);
  const MemoryUsage both = max_peaks(u, later);
  EXPECT_EQ(both.at(MemoryPlace::kDevice).total_peak_bytes, 4096 + 8192);
  EXPECT_EQ(both.at(MemoryPlace::kDevice).total_live_bytes, 4096);
  EXPECT_EQ(both.at(MemoryPlace::kHost).total_peak_bytes, 400);
  EXPECT_EQ(memory_place_name(MemoryPlace::kDevice), "device");
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
