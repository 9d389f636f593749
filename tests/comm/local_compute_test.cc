// The local backend moves its ranks' bytes through their Computes (LocalOptions::computes, the
// path a device's buffers take): every collective's reduction and copies go through the rank's
// own compute, which is synchronized around them, or with comm computes through those, after an
// event recorded when the collective was issued and without waiting for the rank's later work; a compute that fails fails the collective on
// every rank without a hang; computes that do not fit the group, and views elsewhere than the
// computes' memory, are errors naming them. On host memory here; tests/cuda/ runs the same on a
// device where there is one.
#include <atomic>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/collective_checks.h"
#include "comm/recording_compute.h"
#include "core/error_of.h"

namespace mxddp::testing {
namespace {

constexpr int kRanks = 3;
constexpr int64_t kBlock = 5000;

// Four collectives on host memory, each result checked: an all_reduce, a reduce_scatter, an
// all_gather and a 1-element broadcast from rank 2.
void run_four_collectives(Communicator& comm) {
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
}

TEST(LocalGroupComputes, EveryCollectiveMovesThroughEachRanksOwnCompute) {
  std::vector<RecordingCompute> computes(kRanks);
  LocalOptions options;
  for (auto& c : computes) options.computes.push_back(&c);
  run_local(kRanks, run_four_collectives, options);
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

TEST(LocalGroupComputes, WithCommComputesACollectiveWaitsForItsIssueEventAndMovesOnTheCommCompute) {
  std::vector<RecordingCompute> computes(kRanks), comm_computes(kRanks);
  LocalOptions options;
  for (int r = 0; r < kRanks; ++r) {
    options.computes.push_back(&computes[static_cast<size_t>(r)]);
    options.comm_computes.push_back(&comm_computes[static_cast<size_t>(r)]);
  }
  run_local(kRanks, run_four_collectives, options);
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RecordingCompute& c = computes[static_cast<size_t>(r)];
    const RecordingCompute& m = comm_computes[static_cast<size_t>(r)];
    EXPECT_EQ(c.synchronizes.load(), 0) << "the rank's compute is never synchronized whole";
    EXPECT_EQ(c.events_recorded.load(), 4) << "one event per collective, when it is issued";
    EXPECT_EQ(c.event_waits.load(), 4);
    EXPECT_EQ(c.reduces.load() + c.copies.load(), 0) << "the rank's compute moves nothing";
    EXPECT_EQ(m.reduces.load(), 2);
    EXPECT_EQ(m.copies.load(), r == 2 ? 2 : 1);
    EXPECT_EQ(m.synchronizes.load(), 4) << "after each collective's share, the comm compute alone";
  }
}

// On a (claimed) device whose copies run behind the host: a collective's input copied in before
// it was issued is in its buffer, and a copy the rank enqueues after issuing it is neither waited
// for nor run by the collective: it is still queued when the collective's Work returns.
TEST(LocalGroupComputes, ACollectiveOnACommComputeDoesNotWaitForTheRanksLaterWork) {
  constexpr int64_t kCount = 4096;
  std::deque<RecordingCompute> computes, comm_computes;  // constructed in place: neither copies nor moves
  LocalOptions options;
  for (int r = 0; r < 2; ++r) {
    computes.emplace_back(Device::cuda(5));
    computes.back().lagging = true;
    comm_computes.emplace_back(Device::cuda(5));
    options.computes.push_back(&computes.back());
    options.comm_computes.push_back(&comm_computes.back());
  }
  MemoryTracker tracker;
  std::atomic<int> later_still_queued{0};
  run_local(2, [&](Communicator& comm) {
    const int r = comm.rank();
    RecordingCompute& mine = computes[static_cast<size_t>(r)];
    ComputeBuffer sum = mine.allocate(kCount * sizeof(float), MemoryCategory::kGrads, tracker);
    ComputeBuffer later = mine.allocate(kCount * sizeof(float), MemoryCategory::kGrads, tracker);
    const std::vector<float> input(kCount, static_cast<float>(r + 1));
    mine.copy_from_host(sum.data(), input.data(), kCount * sizeof(float));  // queued
    Work work = comm.all_reduce(TensorView{sum.data(), DType::kF32, Shape{kCount}, Device::cuda(5)}, {.async_op = true});
    const std::vector<float> next(kCount, 9.0f);
    mine.copy_from_host(later.data(), next.data(), kCount * sizeof(float));  // the rank's later work
    work.wait();
    if (mine.queued_copies() == 1) ++later_still_queued;
    std::vector<float> out(kCount);
    mine.copy_to_host(out.data(), sum.data(), kCount * sizeof(float));
    for (int64_t i = 0; i < kCount; ++i) ASSERT_EQ(out[static_cast<size_t>(i)], 3.0f) << i;
    EXPECT_EQ(mine.synchronizes.load(), 0);
  }, options);
  EXPECT_EQ(later_still_queued.load(), 2) << "each rank's later copy was still queued after its all_reduce";
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
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&cpu0, &cpu1}, .comm_computes = {&cpu0}}); })
                .find("2 ranks with 2 computes got 1 comm computes"),
            std::string::npos);
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&cpu0, &cpu1}, .comm_computes = {&cpu1, nullptr}}); })
                .find("comm compute of local rank 1 is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { LocalGroup(2, {.computes = {&gpu3, &gpu3b}, .comm_computes = {&gpu3b, &gpu1}}); })
                .find("local rank 1's comm compute works on cuda:1 but its compute on cuda:3"),
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
