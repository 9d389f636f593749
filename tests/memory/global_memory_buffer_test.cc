// The global memory buffer: pointer stability within capacity, geometric or exact growth, keys by
// (name, dtype), scratch accounting, one pool per rank thread, and a pool in a rank's memory on a
// (claimed) device, which the reference GPT refuses.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/compute.h>
#include <mxddp/ddp.h>
#include <mxddp/model.h>

#include "comm/recording_compute.h"

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

// A pool given a compute keeps its storage in that compute's memory: views on its device, bytes
// charged as device scratch, every block allocated through it (never zeroed: scratch is written
// before it is read), and the growth rules unchanged. The compute here claims cuda:5 (host memory
// at poisoned addresses, tests/comm/recording_compute.h), so nothing may touch the storage directly.
TEST(GlobalMemoryBuffer, LivesInTheComputesMemory) {
  MemoryTracker tracker;
  testing::RecordingCompute device(Device::cuda(5));
  GlobalMemoryBuffer pool(tracker, {.compute = &device});
  EXPECT_EQ(&pool.compute(), &device);
  const TensorView a = pool.get_tensor(Shape{1000}, DType::kF32, "act");
  EXPECT_EQ(a.device, Device::cuda(5));
  EXPECT_EQ(a.shape, Shape({1000}));
  EXPECT_EQ(pool.get_tensor(Shape{10, 100}, DType::kF32, "act").data, a.data) << "within capacity: the same storage";
  pool.get_tensor(Shape{1001}, DType::kF32, "act");
  EXPECT_EQ(pool.capacity_numel("act", DType::kF32), 2000);
  pool.get_tensor(Shape{64}, DType::kBF16, "act");
  EXPECT_EQ(device.allocations.load(), 3);
  EXPECT_EQ(pool.allocation_count(), 3);
  const MemoryUsage usage = tracker.usage();
  EXPECT_EQ(usage.at(MemoryPlace::kDevice).live(MemoryCategory::kScratch), 2000 * 4 + 64 * 2);
  EXPECT_EQ(usage.at(MemoryPlace::kDevice).peak(MemoryCategory::kScratch), 2000 * 4 + 64 * 2)
      << "the old block is freed before the new one";
  EXPECT_EQ(usage.at(MemoryPlace::kHost).live(MemoryCategory::kScratch), 0);
  // The contents are the compute's to move: a value written through it is there on the next request.
  const float value = 42.0f;
  device.copy_from_host(pool.get_tensor(Shape{8}, DType::kF32, "act").data_as<float>() + 3, &value, sizeof value);
  float back = 0;
  device.copy_to_host(&back, pool.get_tensor(Shape{4}, DType::kF32, "act").data_as<float>() + 3, sizeof back);
  EXPECT_EQ(back, 42.0f);
  EXPECT_EQ(tracker.usage().at(MemoryPlace::kDevice).live(MemoryCategory::kScratch), 2000 * 4 + 64 * 2);
}

TEST(GlobalMemoryBuffer, RefusesARequestWhoseBytesOverflow) {
  MemoryTracker tracker;
  GlobalMemoryBuffer pool(tracker, {.grow_exact = true});
  try {
    pool.get_tensor(Shape{int64_t{1} << 31, int64_t{1} << 30}, DType::kF64, "huge");
    FAIL() << "2^61 f64 elements were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scratch tensor 'huge' in bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.total_bytes(), 0);
  EXPECT_EQ(tracker.usage().live(MemoryCategory::kScratch), 0);
}

// The reference GPT computes on the CPU: a global memory buffer on a device is refused, naming it.
TEST(GlobalMemoryBuffer, TheReferenceGptRefusesAPoolOnADevice) {
  const GptConfig config{.num_layers = 1, .hidden_size = 16, .num_attention_heads = 2, .seq_length = 8};
  run_local(1, [&](Communicator& comm) {
    MemoryTracker tracker;
    const std::vector<ParamSpec> specs = gpt_param_specs(config);
    DistributedDataParallel ddp(comm, specs, DdpConfig{}, tracker);
    testing::RecordingCompute device(Device::cuda(5));
    GlobalMemoryBuffer pool(tracker, {.compute = &device});
    try {
      GptModel gpt(ddp, pool, config);
      ADD_FAILURE() << "a GPT was built over a pool on cuda:5";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("its global memory buffer is on cuda:5"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace mxddp
