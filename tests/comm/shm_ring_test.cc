// The shared-memory ring transport (src/comm/shm_ring.h) with ranks as threads of this process
// (each its own transport and channels, as separate processes would have): ring.h's reduce-scatter
// (summing out of the slots, with no scratch) and all-gather through it equal the serial reference
// over messages several channels long, ragged and empty blocks; a summing receive adds into place; a stalled neighbour is an Error after timeout_ms naming it; a message-size
// mismatch is caught; the names are gone once set up, and a missing neighbour is reported, not
// a crash.
#include <barrier>
#include <cerrno>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mxddp/core.h>

#include "comm/ring.h"
#include "comm/shm_ring.h"

namespace mxddp::testing {
namespace {

std::string unique_prefix() {
  static int n = 0;
  return "mxddp-test-" + std::to_string(getpid()) + "-" + std::to_string(n++);
}

// Sets up `size` transports as the torch backend does (create, connect, unlink, a barrier between
// phases), then runs body(rank, transport) on a thread per rank; rethrows the first failure.
void run_ranks(int size, int64_t timeout_ms, const std::function<void(int, ShmRingTransport&)>& body) {
  const std::string prefix = unique_prefix();
  std::barrier sync(size);
  std::vector<std::string> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<ShmRingTransport> t;
      try {
        t = ShmRingTransport::create(prefix, r, size, timeout_ms);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      sync.arrive_and_wait();
      std::string why;
      const bool connected = t && t->connect(why);
      sync.arrive_and_wait();
      if (!connected) {
        if (errors[static_cast<size_t>(r)].empty()) errors[static_cast<size_t>(r)] = "connect: " + why;
        return;
      }
      t->unlink_own();
      try {
        body(r, *t);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& th : threads) th.join();
  for (int r = 0; r < size; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

// Ranks 0 and 1 of a two-rank ring, set up on this thread (both or neither).
std::pair<std::unique_ptr<ShmRingTransport>, std::unique_ptr<ShmRingTransport>> connected_pair() {
  const std::string prefix = unique_prefix();
  auto a = ShmRingTransport::create(prefix, 0, 2, 5'000);
  auto b = ShmRingTransport::create(prefix, 1, 2, 5'000);
  std::string why;
  if (!a->connect(why) || !b->connect(why)) {
    ADD_FAILURE() << why;
    return {};
  }
  return {std::move(a), std::move(b)};
}

float quarter(int rank, int64_t i) { return static_cast<float>(((rank * 37 + i * 11 + (i >> 7)) % 64) - 32) * 0.25f; }

class ShmRing : public ::testing::TestWithParam<int> {};

TEST_P(ShmRing, ReduceScatterAndAllGatherMatchTheReference) {
  const int size = GetParam();
  // Blocks of 2.3 channels' worth of bytes and a ragged remainder: pieces of a full slot, a partial
  // last one, and messages longer than the channel (the waits must move both directions).
  const int64_t count = (kShmSlots * kShmSlotBytes / 4) * 2 * size + size / 2 + 13;
  std::vector<int64_t> offsets(static_cast<size_t>(size) + 1);
  for (int b = 0; b <= size; ++b) offsets[static_cast<size_t>(b)] = count * b / size;
  std::vector<std::vector<float>> data(static_cast<size_t>(size));
  run_ranks(size, 30'000, [&](int r, ShmRingTransport& t) {
    auto& d = data[static_cast<size_t>(r)];
    d.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) d[static_cast<size_t>(i)] = quarter(r, i);
    static_assert(SummingTransport<ShmRingTransport>, "the reduce-scatter sums out of the slots");
    ring_reduce_scatter_sum(t, r, size, d.data(), offsets.data(), /*scratch=*/nullptr);  // none needed
    std::vector<int64_t> bytes(offsets);
    for (int64_t& o : bytes) o *= 4;
    ring_all_gather(t, r, size, reinterpret_cast<char*>(d.data()), bytes.data());
  });
  for (int r = 0; r < size; ++r) {
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < size; ++q) want += quarter(q, i);
      bad += data[static_cast<size_t>(r)][static_cast<size_t>(i)] != want;
    }
    EXPECT_EQ(bad, 0) << "rank " << r << " of " << size;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmRing, ::testing::Values(2, 3, 4));

TEST(ShmRingTransport, EmptyAndTinyBlocksGather) {
  // 3 elements over 4 ranks: block 0 is empty (offsets 0, 0, 1, 2, 3).
  const int size = 4;
  const std::vector<int64_t> offsets = {0, 0, 4, 8, 12};
  std::vector<std::vector<float>> data(size, std::vector<float>(3, -1.0f));
  run_ranks(size, 30'000, [&](int r, ShmRingTransport& t) {
    auto& d = data[static_cast<size_t>(r)];
    if (r > 0) d[static_cast<size_t>(r - 1)] = static_cast<float>(10 * r);
    ring_all_gather(t, r, size, reinterpret_cast<char*>(d.data()), offsets.data());
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(data[static_cast<size_t>(r)], (std::vector<float>{10, 20, 30})) << r;
}

TEST(ShmRingTransport, SummingReceiveAddsIntoPlace) {
  auto [a, b] = connected_pair();
  ASSERT_TRUE(a && b);
  // Longer than a slot: the sum is taken piece by piece as the slots fill.
  const int64_t n = kShmSlotBytes / 4 + 5;
  std::vector<float> sent(static_cast<size_t>(n)), mine(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    sent[static_cast<size_t>(i)] = quarter(1, i);
    mine[static_cast<size_t>(i)] = quarter(0, i);
  }
  auto send = b->isend(sent.data(), 4 * n, 0);
  auto recv = a->irecv_sum(mine.data(), n, 1);
  a->wait(recv);
  b->wait(send);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += mine[static_cast<size_t>(i)] != quarter(0, i) + quarter(1, i);
  EXPECT_EQ(bad, 0);
  EXPECT_THROW(a->irecv_sum(mine.data(), -1, 1), Error);
}

TEST(ShmRingTransport, StalledNeighbourIsAnErrorNamingIt) {
  const std::string prefix = unique_prefix();
  auto a = ShmRingTransport::create(prefix, 0, 2, /*timeout_ms=*/200);
  auto b = ShmRingTransport::create(prefix, 1, 2, 200);
  std::string why;
  ASSERT_TRUE(a->connect(why)) << why;
  ASSERT_TRUE(b->connect(why)) << why;
  float x = 0;
  auto req = a->irecv(&x, 4, 1);  // rank 1 never sends
  const auto t0 = std::chrono::steady_clock::now();
  try {
    a->wait(req);
    FAIL() << "a receive from a neighbour that never sends returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 made no progress for 200 ms (timeout_ms) receiving from rank 1"),
              std::string::npos) << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(200));
}

TEST(ShmRingTransport, MismatchedMessageSizesAreCaught) {
  auto [a, b] = connected_pair();
  ASSERT_TRUE(a && b);
  std::vector<char> out(100, 'x'), in(50);
  auto s = a->isend(out.data(), 100, 1);
  auto r = b->irecv(in.data(), 50, 0);
  try {
    b->wait(r);
    FAIL() << "a 100-byte piece was taken into a 50-byte receive";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("got a piece of 100 bytes from rank 0 where 50 of a 50-byte message "
                                         "remained"), std::string::npos) << e.what();
  }
  a->wait(s);  // the send completed when it was copied into the channel
}

TEST(ShmRingTransport, NamesAreGoneAfterSetupAndMisuseIsRefused) {
  const std::string prefix = unique_prefix();
  auto a = ShmRingTransport::create(prefix, 0, 2, 1'000);
  EXPECT_THROW(ShmRingTransport::create(prefix, 0, 2, 1'000), Error) << "the name is taken";
  std::string why;
  EXPECT_FALSE(a->connect(why)) << "rank 1's channel does not exist yet";
  EXPECT_NE(why.find("shm_open(/" + prefix + "-1) failed"), std::string::npos) << why;
  auto b = ShmRingTransport::create(prefix, 1, 2, 1'000);
  ASSERT_TRUE(a->connect(why) && b->connect(why)) << why;
  a->unlink_own();
  b->unlink_own();
  for (int r = 0; r < 2; ++r) {
    const std::string name = "/" + prefix + "-" + std::to_string(r);
    EXPECT_EQ(shm_open(name.c_str(), O_RDONLY, 0), -1) << name << " is still linked";
    EXPECT_EQ(errno, ENOENT);
  }
  float x = 1;
  EXPECT_THROW(a->isend(&x, 4, 0), Error) << "rank 0 sends only to rank 1";
  EXPECT_THROW(a->irecv(&x, 4, 0), Error) << "rank 0 receives only from rank 1";
  EXPECT_THROW(ShmRingTransport::create("a/b", 0, 2, 1'000), Error);
  EXPECT_THROW(ShmRingTransport::create(prefix + "x", 2, 2, 1'000), Error);
  EXPECT_THROW(ShmRingTransport::create(prefix + "y", 0, 2, 0), Error);
}

}  // namespace
}  // namespace mxddp::testing
