// The mpi communicator for ranks whose buffers are on a device (MpiOptions::compute;
// src/comm/staged_backend.h), under mpirun at 2 and 4 processes. Each process's compute claims
// cuda:0, as processes sharing one GPU would (tests/comm/recording_compute.h: host memory behind
// poisoned pointers, so any direct host read or write of a "device" buffer faults at once) and
// lags: its copies between host and "device" run later, in order, as on a stream, so staging read
// before its copy is waited for, or reused while a copy out of it is queued, gives wrong bytes. Every
// collective must give the bits the host communicator (g_mpi_comm) gives for the same inputs, touch
// on the device only what the collective writes, keep its staging in host memory charged as comm,
// and leave the device buffers as they were when the ranks disagree.
#include <array>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "comm/collective_checks.h"
#include "comm/recording_compute.h"
#include "comm/staged_backend.h"
#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// A buffer in the compute's memory, filled and read through host copies.
struct DeviceBuf {
  DeviceBuf(Compute& compute_in, Buf init, MemoryTracker& tracker)
      : compute(compute_in),
        dtype(init.view().dtype),
        numel(init.numel()),
        block(compute.allocate(init.view().nbytes(), MemoryCategory::kComm, tracker)) {
    compute.copy_from_host(block.data(), init.view().data, init.view().nbytes());
  }
  TensorView view() const { return block.view(dtype, Shape{numel}); }
  Buf read() const {
    Buf out(dtype, numel);
    compute.copy_to_host(out.view().data, block.data(), out.view().nbytes());
    return out;
  }
  Compute& compute;
  DType dtype;
  int64_t numel;
  ComputeBuffer block;
};

Buf filled(DType dtype, int64_t n, int rank) {
  Buf b(dtype, n);
  for (int64_t i = 0; i < n; ++i) b.set(i, value_at(rank, i));
  return b;
}

void expect_same(const Buf& got, int64_t got_offset, const Buf& want, int64_t want_offset, int64_t n,
                 const std::string& what) {
  expect_all(got, got_offset, n, [&](int64_t i) { return want.get(want_offset + i); }, what);
}

class StagedMpi : public ::testing::TestWithParam<DType> {
 protected:
  StagedMpi() : device_(Device::cuda(0)), comm_(make_mpi_communicator({.memory_tracker = &tracker_, .compute = &device_})) {
    device_.lagging = true;  // its copies run behind the host, as a stream's
  }

  Communicator& host() { return *g_mpi_comm; }
  Communicator& staged() { return *comm_; }
  int rank() { return host().rank(); }
  int size() { return host().size(); }
  std::string what(std::string_view op, int64_t n) { return label(staged(), op, GetParam(), n); }

  MemoryTracker tracker_;
  RecordingCompute device_;
  std::unique_ptr<Communicator> comm_;
};

// Every collective, reduce op, prescale and in-place form (the dtypes collective_checks.h fills:
// f32, bf16, u8), at counts that do not divide by the rank count and (f32, 300000 elements) past
// the mpi backend's ring threshold: the device run gives the values the host run gives for the
// same call. (These inputs sum exactly in any order; that the staged call takes the host call's
// path, in place or not, is staged_backend.cc's design, not something these values could show.)
TEST_P(StagedMpi, EveryCollectiveGivesTheHostCommunicatorsResult) {
  const DType dtype = GetParam();
  const int r = rank();
  const int n_ranks = size();
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{65537}, int64_t{300000}}) {
    if (n == 300000 && dtype != DType::kF32) continue;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      if (dtype == DType::kU8 && op == ReduceOp::kAvg) continue;
      const float prescale = op == ReduceOp::kMax || dtype == DType::kU8 ? 1.0f : 0.25f;
      const ReduceScatterOptions options{.op = op, .prescale = prescale};
      {
        Buf want = filled(dtype, n, r);
        host().all_reduce(want.view(), {.op = op, .prescale = prescale});
        DeviceBuf buf(device_, filled(dtype, n, r), tracker_);
        staged().all_reduce(buf.view(), {.op = op, .async_op = n % 2 == 1, .prescale = prescale}).wait();
        expect_same(buf.read(), 0, want, 0, n, what(fmt::format("all_reduce/{}", reduce_op_name(op)), n));
      }
      for (bool in_place : {true, false}) {
        const Buf input = filled(dtype, n * n_ranks, r);
        DeviceBuf in(device_, input, tracker_);
        const std::string op_name = fmt::format("reduce_scatter/{}{}", reduce_op_name(op), in_place ? "/in_place" : "");
        if (in_place) {
          Buf want = input;
          host().reduce_scatter(want.view(), want.view().slice(r * n, n), options);
          staged().reduce_scatter(in.view(), in.view().slice(r * n, n), options);
          const Buf got = in.read();
          expect_same(got, r * n, want, r * n, n, what(op_name, n));
          // Only this rank's block is written on the device; the other blocks keep the input.
          expect_same(got, 0, input, 0, r * n, what(op_name + " (blocks before its own)", n));
          expect_same(got, (r + 1) * n, input, (r + 1) * n, (n_ranks - r - 1) * n, what(op_name + " (blocks after)", n));
        } else {
          Buf host_input = input;
          Buf want(dtype, n);
          host().reduce_scatter(host_input.view(), want.view(), options);
          DeviceBuf out(device_, Buf(dtype, n), tracker_);
          staged().reduce_scatter(in.view(), out.view(), options);
          expect_same(out.read(), 0, want, 0, n, what(op_name, n));
          expect_same(in.read(), 0, input, 0, n * n_ranks, what(op_name + " (the input is read only)", n));
        }
      }
    }
    for (bool in_place : {true, false}) {
      Buf mine = filled(dtype, n, r);
      Buf want(dtype, n * n_ranks);
      host().all_gather(mine.view(), want.view());
      DeviceBuf out(device_, Buf(dtype, n * n_ranks), tracker_);
      if (in_place) {
        device_.copy_from_host(out.view().slice(r * n, n).data, mine.view().data, mine.view().nbytes());
        staged().all_gather(out.view().slice(r * n, n), out.view());
      } else {
        DeviceBuf in(device_, mine, tracker_);
        staged().all_gather(in.view(), out.view());
      }
      expect_same(out.read(), 0, want, 0, n * n_ranks, what(in_place ? "all_gather/in_place" : "all_gather", n));
    }
    for (int root : {0, n_ranks - 1}) {
      Buf want = filled(dtype, n, r);
      host().broadcast(want.view(), {.root = root});
      DeviceBuf buf(device_, filled(dtype, n, r), tracker_);
      const int copies_in_before = device_.copies_from_host.load();
      staged().broadcast(buf.view(), {.root = root});
      expect_same(buf.read(), 0, want, 0, n, what(fmt::format("broadcast/root{}", root), n));
      EXPECT_EQ(device_.copies_from_host.load() - copies_in_before, r == root ? 0 : 1)
          << what(fmt::format("broadcast/root{}", root), n) << ": the root's buffer is not written, the others' once";
    }
  }
  staged().barrier();
}

INSTANTIATE_TEST_SUITE_P(DTypes, StagedMpi, ::testing::Values(DType::kF32, DType::kBF16, DType::kU8),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

TEST(StagedMpiBackend, TheCommunicatorIsOnTheDeviceAndRefusesHostViews) {
  RecordingCompute device(Device::cuda(0));
  auto comm = make_mpi_communicator({.compute = &device});
  EXPECT_EQ(comm->device(), Device::cuda(0));
  EXPECT_EQ(&comm->compute(), &device);
  EXPECT_EQ(comm->backend_name(), "mpi");
  EXPECT_EQ(comm->rank(), g_mpi_comm->rank());
  Buf host_buf(DType::kF32, 4);
  try {
    comm->all_reduce(host_buf.view());
    ADD_FAILURE() << "a host view was accepted by a communicator on cuda:0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is on cpu; this communicator's buffers are on cuda:0"), std::string::npos)
        << e.what();
  }
  // A compute on the host is the host's memory, which MPI moves itself: nothing is staged.
  RecordingCompute on_host(Device::cpu());
  auto plain = make_mpi_communicator({.compute = &on_host});
  EXPECT_EQ(plain->device(), Device::cpu());
  plain->all_reduce(host_buf.view());
  EXPECT_EQ(on_host.host_allocations.load(), 0);
}

// The staging is host memory from the compute (allocate_host: page-locked on a real device), kept
// at the largest message so far and charged to the tracker as comm at the host's place; nothing is
// charged on the device for it, and set_memory_tracker moves the charge.
TEST(StagedMpiBackend, StagingIsTheComputesHostMemoryChargedAsComm) {
  MemoryTracker staging_tracker;
  MemoryTracker buffers;
  RecordingCompute device(Device::cuda(0));
  device.lagging = true;
  auto comm = make_mpi_communicator({.memory_tracker = &staging_tracker, .compute = &device});
  const int n = comm->size();
  auto host_comm = [&] { return staging_tracker.usage().at(MemoryPlace::kHost).live(MemoryCategory::kComm); };
  EXPECT_EQ(host_comm(), 0) << "nothing is staged before a collective";
  DeviceBuf f32(device, filled(DType::kF32, 1000, comm->rank()), buffers);
  comm->all_reduce(f32.view());
  EXPECT_EQ(host_comm(), 4000);
  EXPECT_EQ(staged_host_bytes(CollectiveKind::kAllReduce, DType::kF32, 1000, n, true), 4000);
  EXPECT_EQ(device.host_allocations.load(), 1);
  // A bf16 reduce-scatter of 500 per rank stages 1000 x n bytes (held: 4000 when n <= 4), and the mpi
  // backend beneath widens it to f32 in its own staging.
  DeviceBuf whole(device, filled(DType::kBF16, 500 * n, comm->rank()), buffers);
  comm->reduce_scatter(whole.view(), whole.view().slice(comm->rank() * 500, 500));
  const int64_t staged =
      std::max<int64_t>(4000, staged_host_bytes(CollectiveKind::kReduceScatter, DType::kBF16, 500, n, true));
  EXPECT_EQ(host_comm(), staged + mpi_staging_bytes(true, DType::kBF16, 500, n));
  EXPECT_EQ(device.host_allocations.load(), n <= 4 ? 1 : 2) << "the staging grows only for a larger message";
  EXPECT_EQ(staging_tracker.usage().at(MemoryPlace::kDevice).total_live_bytes, 0) << "staging is host memory";
  // Handed to another tracker: released from this one, charged there by the next collective.
  MemoryTracker other;
  comm->set_memory_tracker(&other);
  EXPECT_EQ(staging_tracker.usage().total_live_bytes, 0) << "handed over: released from the first tracker";
  comm->all_reduce(f32.view());
  EXPECT_EQ(other.usage().at(MemoryPlace::kHost).live(MemoryCategory::kComm), 4000);
  comm->set_memory_tracker(nullptr);
  EXPECT_EQ(other.usage().total_live_bytes, 0);
  EXPECT_EQ(staged_host_bytes(CollectiveKind::kBarrier, DType::kF32, 0, n, true), 0);
  EXPECT_EQ(staged_host_bytes(CollectiveKind::kAllGather, DType::kU8, 3, n, true), 3 * n);
  EXPECT_EQ(staged_host_bytes(CollectiveKind::kAllGather, DType::kU8, 3, n, false), 3 * (n + 1))
      << "an out-of-place gather stages its input block beside the output";
  try {
    staged_host_bytes(CollectiveKind::kAllGather, DType::kF64, int64_t{1} << 60, 4, true);
    ADD_FAILURE() << "an overflowing staging size was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1152921504606846976 f64 elements per rank over 4 ranks"), std::string::npos)
        << e.what();
  }
}

// The input's copy is enqueued on the rank's stream when the collective is issued, on the issuing
// thread, so it runs right after the work before the collective and never waits for what the rank
// enqueues after it (the rest of backward); nothing in the staged path waits for the rank's whole
// stream. Three buckets' reduce-scatters issued back to back, as DDP issues them, each stage into a
// block of their own, give the host communicator's result, and the next step reuses the blocks.
TEST(StagedMpiBackend, TheInputIsCopiedWhenIssuedAndNothingWaitsForTheWholeStream) {
  MemoryTracker tracker;
  RecordingCompute device(Device::cuda(0));
  device.lagging = true;
  // Each reduce-scatter held 20 ms on the progress thread, so that all three are in flight at once.
  auto comm = make_mpi_communicator(
      {.injected_delay = {.min_us = 20'000, .max_us = 20'000, .reduce_scatter = true}, .compute = &device});
  const int r = comm->rank();
  const int n_ranks = comm->size();
  const std::array<int64_t, 3> bucket_numel = {1000, 300, 4096};
  std::vector<std::unique_ptr<DeviceBuf>> buckets;
  std::vector<Buf> inputs;
  int allocations_after_first_step = 0;
  for (int step = 0; step < 2; ++step) {
    buckets.clear();
    inputs.clear();
    for (size_t b = 0; b < bucket_numel.size(); ++b) {
      inputs.push_back(filled(DType::kF32, bucket_numel[b] * n_ranks, r + static_cast<int>(b) + step));
      buckets.push_back(std::make_unique<DeviceBuf>(device, inputs.back(), tracker));
    }
    const int synchronizes_before = device.synchronizes.load();
    const int waits_before = device.event_waits.load();
    std::vector<Work> works;
    for (size_t b = 0; b < bucket_numel.size(); ++b) {
      const int64_t m = bucket_numel[b];
      const int copies_before = device.copies_to_host_async.load();
      works.push_back(comm->reduce_scatter(buckets[b]->view(), buckets[b]->view().slice(r * m, m), {.async_op = true}));
      EXPECT_EQ(device.copies_to_host_async.load() - copies_before, 1)
          << "bucket " << b << ": its input's copy is enqueued by the time the call returns";
      EXPECT_EQ(device.async_copy_thread.load(), std::this_thread::get_id())
          << "bucket " << b << ": the input's copy is enqueued on the issuing thread, in its order of work";
    }
    for (Work& w : works) w.wait();
    EXPECT_EQ(device.synchronizes.load() - synchronizes_before, 0) << "the staged path waited for the whole stream";
    EXPECT_EQ(device.event_waits.load() - waits_before, 3) << "one wait per collective, for its input's copy";
    for (size_t b = 0; b < bucket_numel.size(); ++b) {
      const int64_t m = bucket_numel[b];
      Buf want = inputs[b];
      g_mpi_comm->reduce_scatter(want.view(), want.view().slice(r * m, m));
      expect_same(buckets[b]->read(), r * m, want, r * m, m, fmt::format("step {} bucket {}", step, b));
    }
    if (step == 0) allocations_after_first_step = device.host_allocations.load();
  }
  EXPECT_EQ(allocations_after_first_step, 3) << "one staging block per collective in flight";
  EXPECT_EQ(device.host_allocations.load(), allocations_after_first_step) << "the next step reuses the blocks";
}

// Ranks that disagree fail on every rank, naming the field, before anything reaches the device
// buffers; the communicator stays usable.
TEST(StagedMpiBackend, DisagreeingRanksLeaveTheDeviceBuffersAsTheyWere) {
  if (g_mpi_comm->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  MemoryTracker tracker;
  RecordingCompute device(Device::cuda(0));
  device.lagging = true;
  auto comm = make_mpi_communicator({.compute = &device});
  const Buf input = filled(DType::kF32, 16 + comm->rank(), comm->rank());
  DeviceBuf buf(device, input, tracker);
  try {
    comm->all_reduce(buf.view());
    ADD_FAILURE() << "all_reduce with counts differing across ranks did not throw on rank " << comm->rank();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("element count 16 vs 17"), std::string::npos) << e.what();
  }
  expect_same(buf.read(), 0, input, 0, input.numel(), "the device buffer after the refused all_reduce");
  DeviceBuf good(device, filled(DType::kF32, 8, comm->rank()), tracker);
  comm->all_reduce(good.view());
  expect_all(good.read(), 0, 8, [&](int64_t i) { return expected_reduction(DType::kF32, ReduceOp::kSum, comm->size(), i); },
             "an all_reduce after the refused one");
}

// A rank that cannot stage its input (here: no page-locked memory left on the last rank) still
// takes part in the agreement check with a refused call: every rank fails the collective at once,
// the failing one with its own cause, the others naming it, and nothing moves; the ranks stay in
// step, so the next collective works.
TEST(StagedMpiBackend, ARankThatCannotStageFailsTheCollectiveOnEveryRankAtOnce) {
  if (g_mpi_comm->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  MemoryTracker tracker;
  RecordingCompute device(Device::cuda(0));
  device.lagging = true;
  auto comm = make_mpi_communicator({.timeout_ms = 60'000, .compute = &device});
  const int last = comm->size() - 1;
  device.fail_host_allocation = comm->rank() == last;
  const Buf input = filled(DType::kF32, 64, comm->rank());
  DeviceBuf buf(device, input, tracker);
  const auto start = std::chrono::steady_clock::now();
  try {
    comm->all_reduce(buf.view());
    ADD_FAILURE() << "an all_reduce that rank " << last << " could not stage completed on rank " << comm->rank();
  } catch (const Error& e) {
    const std::string want = comm->rank() == last ? "no page-locked host memory left (injected)"
                                                  : fmt::format("rank {} failed before it could take part", last);
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "the peers waited for the timeout";
  expect_same(buf.read(), 0, input, 0, 64, "the device buffer after the refused all_reduce");
  device.fail_host_allocation = false;
  comm->all_reduce(buf.view());
  expect_all(buf.read(), 0, 64, [&](int64_t i) { return expected_reduction(DType::kF32, ReduceOp::kSum, comm->size(), i); },
             "an all_reduce after the refused one");
}

}  // namespace
}  // namespace mxddp::testing
