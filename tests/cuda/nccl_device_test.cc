// The NCCL communicator on the GPU, at world 1 (one GPU cannot host two NCCL ranks: NCCL refuses
// duplicate devices; under mpirun with a GPU per rank, nccl_mpi_test joins more). Every collective
// (PreMulSum prescales, bf16 avg, i64 max, reduce-scatter in and out of place, an overlapped
// all-gather, a broadcast) on the rank's device buffers must give the bytes the local backend gives
// on the host; DDP with the distributed optimizer (bf16 params, and MXFP8 params gathered through
// the grad buffer) the host run's params; and every FSDP strategy on the generic model the serial
// reference's main params, bit for bit. Needs a device: device_main.cc skips (77).
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/cuda.h>
#include <mxddp/nccl.h>

#include "cuda/device_jobs.h"
#include "fsdp/generic_model_run.h"

namespace mxddp::testing {
namespace {

std::unique_ptr<Communicator> nccl_world_1() {
  std::unique_ptr<Communicator> comm = make_nccl_communicator(nccl_unique_id(), 0, 1, {.device = 0, .timeout_ms = 60'000});
  EXPECT_EQ(comm->backend_name(), "nccl");
  EXPECT_EQ(comm->device(), Device::cuda(0));
  return comm;
}

TEST(NcclDevice, EveryCollectiveGivesTheHostRunsBytes) {
  std::vector<uint8_t> on_host;
  run_local(1, [&](Communicator& comm) { on_host = run_job(comm, cpu_compute()); });
  const std::unique_ptr<Communicator> comm = nccl_world_1();
  const std::vector<uint8_t> on_device = run_job(*comm, comm->compute());
  expect_same_job_bytes(on_host, on_device, 1);
  comm->barrier();
}

TEST(NcclDevice, DdpAndTheDistributedOptimizerGiveTheHostRunsParams) {
  for (bool mxfp8_reuse : {false, true}) {
    SCOPED_TRACE(mxfp8_reuse ? "MXFP8 params gathered through the grad buffer" : "bf16 params");
    DdpResult on_host;
    run_local(1, [&](Communicator& comm) { on_host = train_ddp(comm, cpu_compute(), mxfp8_reuse); });
    const std::unique_ptr<Communicator> comm = nccl_world_1();
    const DdpResult on_device = train_ddp(*comm, comm->compute(), mxfp8_reuse);
    EXPECT_TRUE(on_host.params == on_device.params) << "the params differ";
  }
}

TEST(NcclDevice, EveryFsdpStrategyMatchesTheSerialReference) {
  for (DpMode mode : {DpMode::kNoShard, DpMode::kOptim, DpMode::kOptimGrads, DpMode::kOptimGradsParams})
    for (bool mxfp8 : {false, true}) {
      if (mxfp8 && mode != DpMode::kOptimGradsParams) continue;
      GenericCase c{.structure = StructureClass::kTiedFirstLast, .seed = 5, .mode = mode, .mxfp8 = mxfp8,
                    .overlap_grad_reduce = true, .overlap_param_gather = true};
      c.run.dp = 1;
      c.run.micro_batches = 2;
      SCOPED_TRACE(c.name() + " on NCCL");
      const GenericModel model = generic_model_of(c);
      const auto want = generic_reference_of(c, model);
      const std::unique_ptr<Communicator> comm = nccl_world_1();
      run_generic_case(*comm, c, model, want, /*tol=*/0);
    }
}

// Stream order: with the compute stream busy (100 passes of zeroing 1 GiB queued), an all-reduce
// issued and waited on returns at once, the device not having run it yet; once the compute stream
// is synchronized, the collective is complete and its result there.
TEST(NcclDevice, WaitOrdersTheComputeStreamWithoutBlockingTheHost) {
  const std::unique_ptr<Communicator> comm = nccl_world_1();
  Compute& compute = comm->compute();
  MemoryTracker tracker;
  const size_t big_bytes = size_t{1} << 30;
  const ComputeBuffer big = compute.allocate(big_bytes, MemoryCategory::kScratch, tracker, /*zeroed=*/false);
  const ComputeBuffer small = compute.allocate(1024 * sizeof(float), MemoryCategory::kScratch, tracker);
  std::vector<float> ones(1024, 1.0f);
  compute.copy_from_host(small.data(), ones.data(), ones.size() * sizeof(float));
  // A first collective and zeroing, waited for: NCCL's and the kernels' first-use setup may block
  // the host, which is not what this measures.
  comm->all_reduce(small.view(DType::kF32, Shape{1024}));
  compute.zero(big.data(), big_bytes);
  compute.synchronize();
  for (int i = 0; i < 100; ++i) compute.zero(big.data(), big_bytes);
  const auto start = std::chrono::steady_clock::now();
  Work work = comm->all_reduce(small.view(DType::kF32, Shape{1024}), {.async_op = true, .prescale = 0.5f});
  work.wait();
  const double wait_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_FALSE(work.is_completed()) << "the device was still zeroing, yet the collective reads as done";
  std::printf("issue + wait behind ~35 ms of queued work: %.3f ms on the host\n", wait_ms);
  compute.copy_to_host(ones.data(), small.data(), ones.size() * sizeof(float));  // waits for the compute stream
  EXPECT_TRUE(work.is_completed());
  for (float v : ones) ASSERT_EQ(v, 0.5f);
}

// A peer that never joins: rank 0 of 2 alone gives up after timeout_ms, naming what it waited for,
// instead of hanging (the nonblocking join under the watchdog).
TEST(NcclDevice, AJoinNoPeerAnswersFailsAfterTheTimeout) {
  const auto start = std::chrono::steady_clock::now();
  try {
    make_nccl_communicator(nccl_unique_id(), 0, 2, {.device = 0, .timeout_ms = 3'000});
    ADD_FAILURE() << "rank 0 of 2 joined alone";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 joining the NCCL group on cuda:0"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

}  // namespace
}  // namespace mxddp::testing
