// What is particular to the local backend and to argument validation: bitwise determinism, the
// timeout of a rank that never arrives, aborting a group when a rank fails, and the errors a
// single rank's bad arguments raise before anything is issued.
#include <atomic>
#include <chrono>
#include <limits>
#include <random>
#include <thread>

#include "comm/collective_checks.h"

namespace mxddp::testing {
namespace {

// Sums of random floats depend on order; the local backend must give the fixed-order (rank
// 0..N-1) result, bitwise, on every rank.
TEST(LocalBackend, AllReduceIsBitwiseTheRankOrderedSum) {
  constexpr int kRanks = 5;
  constexpr int64_t kN = 10'007;
  std::vector<std::vector<float>> inputs(kRanks, std::vector<float>(kN));
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  for (auto& v : inputs)
    for (float& x : v) x = dist(rng) * std::exp2(static_cast<float>(rng() % 20) - 10.0f);
  std::vector<float> want(kN);
  for (int64_t i = 0; i < kN; ++i) {
    float acc = inputs[0][static_cast<size_t>(i)];
    for (int r = 1; r < kRanks; ++r) acc += inputs[static_cast<size_t>(r)][static_cast<size_t>(i)];
    want[static_cast<size_t>(i)] = acc;
  }
  run_local(kRanks, [&](Communicator& comm) {
    std::vector<float> buf = inputs[static_cast<size_t>(comm.rank())];
    comm.all_reduce(TensorView{buf.data(), DType::kF32, Shape{kN}, Device::cpu()});
    EXPECT_EQ(std::memcmp(buf.data(), want.data(), sizeof(float) * kN), 0) << "rank " << comm.rank();
  });
}

TEST(LocalBackend, BF16SumAccumulatesInF32AndRoundsOnce) {
  // 1 + 3 x 2^-9: in bf16 each partial sum 1 + 2^-9 would round back to 1 (ties to even), so a
  // bf16 accumulator gives 1.0; f32 accumulation gives 1 + 3 x 2^-9, which rounds to 1 + 2^-7.
  run_local(4, [](Communicator& comm) {
    bf16_bits x = f32_to_bf16(comm.rank() == 0 ? 1.0f : std::exp2(-9.0f));
    comm.all_reduce(TensorView{&x, DType::kBF16, Shape{1}, Device::cpu()});
    EXPECT_EQ(bf16_to_f32(x), 1.0f + std::exp2(-7.0f));
  });
}

// Prescale is fused into the rank-ordered sum: bitwise sum_r fl(x_r * s), with no separate pass.
TEST(LocalBackend, PrescaleIsFusedIntoTheRankOrderedSum) {
  run_local(3, [](Communicator& comm) {
    float x[2] = {0.1f * static_cast<float>(comm.rank() + 1), 3.0f};
    comm.all_reduce(TensorView{x, DType::kF32, Shape{2}, Device::cpu()}, {.prescale = 1.0f / 3.0f});
    const float s = 1.0f / 3.0f;
    float want = 0.1f * 1.0f * s;
    want += 0.1f * 2.0f * s;
    want += 0.1f * 3.0f * s;
    EXPECT_EQ(x[0], want);
    EXPECT_EQ(x[1], 3.0f * s + 3.0f * s + 3.0f * s);
  });
}

TEST(LocalBackend, PrescaleMismatchAcrossRanksIsAnError) {
  run_local(2, [](Communicator& comm) {
    float x = 1;
    try {
      comm.all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()}, {.prescale = comm.rank() ? 0.5f : 1.0f});
      ADD_FAILURE() << "differing prescales accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("prescale 1 vs 0.5"), std::string::npos) << e.what();
    }
  });
}

TEST(LocalBackend, MaxPropagatesNaN) {
  run_local(3, [](Communicator& comm) {
    float x[2] = {comm.rank() == 1 ? std::nanf("") : 1.0f, static_cast<float>(comm.rank())};
    comm.all_reduce(TensorView{x, DType::kF32, Shape{2}, Device::cpu()}, {.op = ReduceOp::kMax});
    EXPECT_TRUE(std::isnan(x[0]));
    EXPECT_EQ(x[1], 2.0f);
  });
}

TEST(LocalBackend, U8SumWrapsModulo256) {
  run_local(3, [](Communicator& comm) {
    uint8_t x = 200;
    comm.all_reduce(TensorView{&x, DType::kU8, Shape{1}, Device::cpu()});
    EXPECT_EQ(x, static_cast<uint8_t>(600 % 256));
  });
}

TEST(LocalBackend, RankThatNeverArrivesTimesOutWithClearError) {
  LocalGroup group(3, {.timeout_ms = 200});
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      float x = 1;
      try {
        group.communicator(r).all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()});
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("timeout_ms"), std::string::npos) << e;
    EXPECT_NE(e.find("rank(s) 2 never arrived"), std::string::npos) << e;
  }
  // The late rank is refused rather than reading buffers its peers have released.
  float x = 1;
  try {
    group.communicator(2).all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()});
    ADD_FAILURE() << "the late rank's collective ran after its peers had given up";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("refused"), std::string::npos) << e.what();
  }
}

// A huge timeout means "wait long", never "fail at once": now() + 9223372036854 ms overflowed
// steady_clock into the past and every collective timed out immediately. Rank 1 arrives late, so
// the collective only succeeds if rank 0 really waits.
TEST(LocalBackend, HugeTimeoutWaitsInsteadOfOverflowingTheDeadline) {
  for (const int64_t timeout_ms : {int64_t{9'223'372'036'854}, std::numeric_limits<int64_t>::max()}) {
    run_local(2, [](Communicator& comm) {
      if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      float x = 1;
      comm.all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()});
      EXPECT_EQ(x, 2.0f);
    }, {.timeout_ms = timeout_ms});
  }
}

TEST(LocalBackend, FailingRankAbortsPeersAndItsErrorIsRethrown) {
  std::atomic<int> aborted_peers{0};
  try {
    run_local(4, [&](Communicator& comm) {
      if (comm.rank() == 2) throw std::runtime_error("rank two broke");
      try {
        comm.barrier();
      } catch (const Error& e) {
        if (std::string(e.what()).find("rank 2 failed: rank two broke") != std::string::npos) ++aborted_peers;
        throw;
      }
    }, {.timeout_ms = 600'000});  // the abort, not the timeout, must release the peers
    ADD_FAILURE() << "run_local did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank two broke");
  }
  EXPECT_EQ(aborted_peers.load(), 3);
}

TEST(LocalBackend, AsyncWorkRethrowsFailureOnWait) {
  LocalGroup group(2, {.timeout_ms = 100});
  float x = 1;
  Work work = group.communicator(0).all_reduce(TensorView{&x, DType::kF32, Shape{1}, Device::cpu()}, {.async_op = true});
  EXPECT_THROW(work.wait(), Error);
  EXPECT_TRUE(work.is_completed());
  EXPECT_THROW(work.wait(), Error) << "wait() must rethrow on every call";
}

TEST(Communicator, RejectsBadArgumentsBeforeIssuingAnything) {
  LocalGroup group(2);
  Communicator& comm = group.communicator(1);
  std::vector<float> f(8);
  std::vector<bf16_bits> h(4);
  std::vector<uint8_t> u(8);
  const TensorView f8{f.data(), DType::kF32, Shape{8}, Device::cpu()};
  const auto expect_error = [](auto&& fn, std::string_view needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { comm.all_reduce(TensorView{f.data(), DType::kF16, Shape{8}, Device::cpu()}); }, "dtype f16");
  expect_error([&] { comm.all_reduce(TensorView{f.data(), DType::kF32, Shape{8}, Device::cuda(0)}); }, "cuda:0");
  expect_error([&] { comm.all_reduce(TensorView{u.data(), DType::kU8, Shape{8}, Device::cpu()}, {.op = ReduceOp::kAvg}); },
               "avg is defined for f32 and bf16");
  expect_error([&] { comm.reduce_scatter(f8, f8.slice(0, 3)); }, "size (2) x output (3)");
  expect_error([&] { comm.reduce_scatter(f8, TensorView{h.data(), DType::kBF16, Shape{4}, Device::cpu()}); },
               "input is f32 but output is bf16");
  expect_error([&] { comm.reduce_scatter(f8, f8.slice(1, 4)); }, "not this rank's block 1");
  expect_error([&] { comm.all_gather(f8.slice(0, 4), f8); }, "not this rank's block 1");
  expect_error([&] { comm.all_gather(f8.slice(0, 3), f8); }, "size (2) x input (3)");
  expect_error([&] { comm.broadcast(f8, {.root = 2}); }, "root 2 is not a rank; valid: 0..1");
  expect_error([&] { comm.all_reduce(TensorView{nullptr, DType::kF32, Shape{8}, Device::cpu()}); }, "null data pointer");
  expect_error([&] { comm.all_reduce(f8, {.op = ReduceOp::kMax, .prescale = 0.5f}); }, "not max");
  expect_error([&] { comm.all_reduce(TensorView{u.data(), DType::kU8, Shape{8}, Device::cpu()}, {.prescale = 2.0f}); },
               "not u8");
  expect_error([&] { comm.reduce_scatter(f8, f8.slice(4, 4), {.prescale = INFINITY}); }, "prescale must be finite");
}

TEST(LocalGroup, RejectsBadConstruction) {
  EXPECT_THROW(LocalGroup(0), Error);
  EXPECT_THROW(LocalGroup(2, {.timeout_ms = 0}), Error);
  LocalGroup group(2);
  EXPECT_THROW(group.communicator(2), Error);
  EXPECT_EQ(group.communicator(1).rank(), 1);
  EXPECT_EQ(group.communicator(1).size(), 2);
  EXPECT_EQ(group.communicator(1).backend_name(), "local");
}

// Collectives issued async and blocking, interleaved, complete in issue order on every rank.
TEST(LocalBackend, AsyncAndBlockingCallsKeepIssueOrder) {
  run_local(3, [](Communicator& comm) {
    std::vector<float> a(4096, 1.0f), b(4096, 2.0f);
    Work wa = comm.all_reduce(TensorView{a.data(), DType::kF32, Shape{4096}, Device::cpu()}, {.async_op = true});
    comm.all_reduce(TensorView{b.data(), DType::kF32, Shape{4096}, Device::cpu()});
    EXPECT_TRUE(wa.is_completed()) << "a blocking call returned before an earlier async one finished";
    wa.wait();
    EXPECT_EQ(a[4095], 3.0f);
    EXPECT_EQ(b[0], 6.0f);
  });
}

}  // namespace
}  // namespace mxddp::testing
