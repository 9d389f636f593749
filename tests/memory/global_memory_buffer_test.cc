// The global memory buffer: pointer stability within capacity, geometric or exact growth, keys by
// (name, dtype), scratch accounting, and one pool per rank thread.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/memory.h>

namespace mxddp {
namespace {

TEST(GlobalMemoryBuffer, SameStorageWithinCapacity) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker);
  TensorView a = pool.get_tensor(Shape{64, 64}, DType::kF32, "w");
  TensorView b = pool.get_tensor(Shape{100}, DType::kF32, "w");
  TensorView c = pool.get_tensor(Shape{64, 64}, DType::kF32, "w");
  EXPECT_EQ(a.data, b.data);
  EXPECT_EQ(a.data, c.data);
  EXPECT_EQ(c.shape, Shape({64, 64}));
  EXPECT_EQ(pool.allocation_count(), 1);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kScratch), 64 * 64 * 4);
}

TEST(GlobalMemoryBuffer, KeysAreNameAndDType) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker);
  void* f = pool.get_tensor(Shape{16}, DType::kF32, "x").data;
  void* h = pool.get_tensor(Shape{16}, DType::kBF16, "x").data;
  void* g = pool.get_tensor(Shape{16}, DType::kF32, "y").data;
  EXPECT_NE(f, h);
  EXPECT_NE(f, g);
  EXPECT_EQ(pool.total_bytes(), 16 * 4 + 16 * 2 + 16 * 4);
}

TEST(GlobalMemoryBuffer, GrowsGeometricallyByDefault) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker);
  pool.get_tensor(Shape{1000}, DType::kF32, "act");
  pool.get_tensor(Shape{1001}, DType::kF32, "act");
  EXPECT_EQ(pool.capacity_numel("act", DType::kF32), 2000) << "at least twice the old capacity";
  pool.get_tensor(Shape{5000}, DType::kF32, "act");
  EXPECT_EQ(pool.capacity_numel("act", DType::kF32), 5000) << "at least the request";
  // Growing one element at a time costs O(log n) allocations.
  for (int64_t n = 5001; n <= 100'000; ++n) pool.get_tensor(Shape{n}, DType::kF32, "act");
  EXPECT_LE(pool.allocation_count(), 8);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kScratch), pool.total_bytes());
}

TEST(GlobalMemoryBuffer, GrowsExactlyWhenConfigured) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker, {.grow_exact = true});
  pool.get_tensor(Shape{1000}, DType::kBF16, "act");
  pool.get_tensor(Shape{1001}, DType::kBF16, "act");
  EXPECT_EQ(pool.capacity_numel("act", DType::kBF16), 1001);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kScratch), 1001 * 2);
  EXPECT_EQ(tracker.usage().peak(MemoryCategory::kScratch), 1001 * 2) << "old storage is freed before the new";
}

TEST(GlobalMemoryBuffer, ContentsPersistAndAreNotZeroed) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker);
  auto* p = pool.get_tensor(Shape{8}, DType::kF32, "s").data_as<float>();
  p[3] = 42.0f;
  EXPECT_EQ(pool.get_tensor(Shape{4}, DType::kF32, "s").data_as<float>()[3], 42.0f);
}

TEST(GlobalMemoryBuffer, OnePoolPerRankThread) {
  constexpr int kRanks = 4;
  std::vector<MemoryTracker> trackers(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      GlobalMemoryBuffer pool(trackers[static_cast<size_t>(r)]);
      for (int step = 0; step < 200; ++step) {
        auto* p = pool.get_tensor(Shape{256 + step}, DType::kF32, "act").data_as<float>();
        for (int i = 0; i < 256 + step; ++i) p[i] = static_cast<float>(r);
        for (int i = 0; i < 256 + step; ++i) ASSERT_EQ(p[i], static_cast<float>(r));
      }
    });
  for (auto& t : threads) t.join();
  for (auto& t : trackers) EXPECT_EQ(t.usage().live(MemoryCategory::kScratch), 0);
}

}  // namespace
}  // namespace mxddp
