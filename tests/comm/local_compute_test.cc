// The local backend moves its ranks' bytes through their Computes (LocalOptions::computes, the
// path a device's buffers take): every collective's reduction and copies go through the rank's
// own compute, which is synchronized around them; a compute that fails fails the collective on
// every rank without a hang; computes that do not fit the group, and views elsewhere than the
// computes' memory, are errors naming them. On host memory here; tests/cuda/ runs the same on a
// device where there is one.
#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/collective_checks.h"
#include "comm/recording_compute.h"
#include "core/error_of.h"

namespace mxddp::testing {
namespace {

TEST(LocalGroupComputes, EveryCollectiveMovesThroughEachRanksOwnCompute) {
  constexpr int kRanks = 3;
  constexpr int64_t kBlock = 5000;
  std::vector<RecordingCompute> computes(kRanks);
  LocalOptions options;
  for (auto& c : computes) options.computes.push_back(&c);
  run_local(kRanks, [&](Communicator& comm) {
    const int r = comm.rank();
    EXPECT_EQ(comm.device(), Device::cpu());
    std::vector<float> all(kRanks * kBlock), block(kBlock);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<float>(r + 1) * static_cast<float>(i % 97);
    comm.all_reduce(TensorView{all.data(), DType::kF32, Shape{kRanks * kBlock}, Device::cpu()});
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], 6.0f * static_cast<float>(i % 97)) << i;
    comm.reduce_scatter(TensorView{all.data(), DType::kF32, Shape{kRanks * kBlock}, Device::cpu()},
                        TensorView{block.data(), DType::kF32, Shape{kBlock}, Device::cpu()});
    const size_t first = static_cast<size_t>(r * kBlock);
    for (size_t i = 0; i < block.size(); ++i) ASSERT_EQ(block[i], 18.0f * static_cast<float>((first + i) % 97)) << i;
    for (float& x : block) x = static_cast<float>(r);
    comm.all_gather(TensorView{block.data(), DType::kF32, Shape{kBlock}, Device::cpu()},
                    TensorView{all.data(), DType::kF32, Shape{kRanks * kBlock}, Device::cpu()});
    for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], static_cast<float>(i / kBlock)) << i;
    int64_t word = r == 2 ? 77 : 0;
    comm.broadcast(TensorView{&word, DType::kI64, Shape{1}, Device::cpu()}, {.root = 2});
    EXPECT_EQ(word, 77);
  }, options);
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RecordingCompute& c = computes[static_cast<size_t>(r)];
    EXPECT_EQ(c.reduces.load(), 2) << "its share of the all_reduce and its block of the reduce_scatter";
    // The all_gather's push of its block; the 1-element broadcast is rank 2's share alone (its
    // 64-byte-aligned partition gives the others nothing to move).
    EXPECT_EQ(c.copies.load(), r == 2 ? 2 : 1);
    EXPECT_EQ(c.synchronizes.load(), 2 * 4) << "before and after each of the 4 collectives";
  }
}

TEST(LocalGroupComputes, AComputeThatFailsFailsTheCollectiveOnEveryRankWithoutAHang) {
  RecordingCompute good0, bad1(Device::cpu(), /*fail_reduce=*/true), good2;
  std::atomic<int> peers_told{0};
  LocalOptions options{.timeout_ms = 600'000};  // the abort, not the timeout, must release them
  options.computes = {&good0, &bad1, &good2};
  try {
    run_local(3, [&](Communicator& comm) {
      std::vector<float> x(4096, 1.0f);
      try {
        comm.all_reduce(TensorView{x.data(), DType::kF32, Shape{4096}, Device::cpu()});
      } catch (const Error& e) {
        const std::string what = e.what();
        if (comm.rank() != 1 && what.find("rank 1 could not move its share of all_reduce #1: ") != std::string::npos &&
            what.find("the device faulted (injected)") != std::string::npos)
          ++peers_told;
        throw;
      }
      ADD_FAILURE() << "rank " << comm.rank() << "'s all_reduce succeeded although rank 1 could not do its share";
    }, options);
    ADD_FAILURE() << "run_local did not rethrow";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
  }
  EXPECT_EQ(peers_told.load(), 2);
}

TEST(LocalGroupComputes, ComputesThatDoNotFitTheGroupAndViewsElsewhereAreErrors) {
  RecordingCompute cpu0, cpu1, gpu1(Device::cuda(1)), gpu3(Device::cuda(3)), gpu3b(Device::cuda(3));
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&cpu0}}); }).find("2 ranks got 1 computes"), std::string::npos);
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&cpu0, nullptr}}); }).find("compute of local rank 1 is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&cpu0, &gpu1}}); })
                .find("local rank 1's compute works on cuda:1 but rank 0's on cpu"),
            std::string::npos);
  LocalGroup on_device(2, {.computes = {&gpu3, &gpu3b}});
  EXPECT_EQ(on_device.communicator(0).device(), Device::cuda(3));
  float x[4] = {};
  EXPECT_NE(error_of([&] { on_device.communicator(0).all_reduce(TensorView{x, DType::kF32, Shape{4}, Device::cpu()}); })
                .find("all_reduce: buffer is on cpu; this communicator's buffers are on cuda:3"),
            std::string::npos);
  LocalGroup on_host(2, {.computes = {&cpu0, &cpu1}});
  EXPECT_NE(error_of([&] {
              on_host.communicator(1).all_gather(TensorView{x, DType::kF32, Shape{2}, Device::cuda(0)},
                                                 TensorView{x, DType::kF32, Shape{4}, Device::cpu()});
            }).find("all_gather: input is on cuda:0; this communicator's buffers are on cpu"),
            std::string::npos);
  EXPECT_EQ(gpu3.reduces.load() + cpu0.reduces.load() + cpu1.reduces.load(), 0) << "nothing was issued";
}

}  // namespace
}  // namespace mxddp::testing
