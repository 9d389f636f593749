// Every FSDP strategy (optim_grads_params with MXFP8 params too) and DDP with the distributed
// optimizer (with MXFP8 params too), with 2 and 4 ranks on one GPU (a stream and a CUDA compute
// each): the generic model of tests/fsdp/generic_model.h trains on device buffers and its main
// params must equal the serial reference bit for bit after every iteration, as on the host
// (tests/fsdp/fsdp_any_structure_test.cc runs such cases on a claimed device in every CI run). The
// model itself computes on the host, reading and writing the device buffers through copies. And
// HSDP on a 2 x 2 grid on the GPU against the same job on the host, bit for bit, and checkpoints
// saved on the GPU resumed on the host and back. Needs a device:
// device_main.cc skips (77).
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>

#include <mxddp/cuda.h>

#include "cuda/cuda_ranks.h"
#include "fsdp/generic_model_run.h"

namespace mxddp::testing {
namespace {

struct Mode {
  DpMode mode;
  bool mxfp8;
};

TEST(CudaFsdp, EveryStrategyOnOneDeviceMatchesTheSerialReference) {
  int k = 0;
  for (StructureClass structure : {StructureClass::kNonUnitMiddle, StructureClass::kTiedFirstLast})
    for (Mode m : {Mode{DpMode::kDdpDistOpt, false}, Mode{DpMode::kDdpDistOpt, true}, Mode{DpMode::kNoShard, false},
                   Mode{DpMode::kOptim, false}, Mode{DpMode::kOptimGrads, false}, Mode{DpMode::kOptimGradsParams, false},
                   Mode{DpMode::kOptimGradsParams, true}})
      for (int dp : {2, 4}) {
        GenericCase c{.structure = structure, .seed = 11, .mode = m.mode, .fine_grained = k % 2 == 1, .mxfp8 = m.mxfp8,
                      .overlap_grad_reduce = true, .overlap_param_gather = true};
        c.run.dp = dp;
        c.run.micro_batches = k % 2 == 0 ? 3 : 1;
        ++k;
        SCOPED_TRACE(c.name() + " on cuda");
        const GenericModel model = generic_model_of(c);
        const auto want = generic_reference_of(c, model);
        const CudaRanks gpu(dp);
        run_local(
            dp,
            [&](Communicator& comm) {
              EXPECT_EQ(comm.device(), Device::cuda(0));
              run_generic_case(comm, c, model, want, /*tol=*/0);
            },
            gpu.options);
      }
}

// HSDP, a 2 x 2 grid on one GPU (each rank's shard and replica group moving its bytes with its
// compute), under each FSDP strategy: every main param element every rank updated equals the same
// job's on host memory bit for bit (the reference adds the ranks in another order, so it only
// bounds them: 1e-4 with these bf16 params).
TEST(CudaFsdp, HsdpOnOneDeviceGivesTheHostRunsBits) {
  constexpr int kShard = 2, kReplicas = 2;
  for (Mode m : {Mode{DpMode::kNoShard, false}, Mode{DpMode::kOptim, false}, Mode{DpMode::kOptimGrads, false},
                 Mode{DpMode::kOptimGradsParams, false}, Mode{DpMode::kOptimGradsParams, true}}) {
    GenericCase c{.structure = StructureClass::kTiedFirstLast, .seed = 11, .mode = m.mode, .mxfp8 = m.mxfp8,
                  .overlap_grad_reduce = true, .overlap_param_gather = true};
    c.run.dp = kShard * kReplicas;
    c.run.micro_batches = 2;
    SCOPED_TRACE(c.name() + " as 2 x 2 HSDP on cuda");
    const GenericModel model = generic_model_of(c);
    const auto want = generic_reference_of(c, model);
    const auto on_host = run_hsdp_generic_case(c, model, want, /*tol=*/1e-4, kShard, kReplicas, {}, {.timeout_ms = 60'000});
    const CudaRanks gpu(c.run.dp);
    expect_same_updated_mains(on_host, run_hsdp_generic_case(c, model, want, /*tol=*/1e-4, kShard, kReplicas,
                                                             gpu.options.computes, {.timeout_ms = 60'000}));
  }
}

// A checkpoint saved on the GPU resumes on the host and back (2 of 4 iterations each side), and the
// resumed run's main params are the serial reference's bit for bit: DDP with the distributed
// optimizer and FSDP optim_grads_params, both with MXFP8 params, at 2 ranks.
TEST(CudaFsdp, CheckpointsMoveBetweenTheDeviceAndTheHost) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / fmt::format("mxddp_cuda_ckpt_{}", ::getpid());
  for (DpMode mode : {DpMode::kDdpDistOpt, DpMode::kOptimGradsParams}) {
    GenericCase c{.structure = StructureClass::kTiedFirstLast, .seed = 11, .mode = mode, .mxfp8 = true,
                  .overlap_grad_reduce = true, .overlap_param_gather = true};
    c.run.dp = 2;
    c.run.iterations = 4;
    const GenericModel model = generic_model_of(c);
    const auto want = generic_reference_of(c, model);
    for (bool saved_on_device : {true, false}) {
      SCOPED_TRACE(c.name() + (saved_on_device ? ": saved on cuda, resumed on the host" : ": saved on the host, resumed on cuda"));
      std::filesystem::remove_all(dir);
      auto segment = [&](bool on_device, int first, int end, bool load, bool save) {
        const CudaRanks gpu(on_device ? c.run.dp : 0);  // none: the host
        run_local(
            c.run.dp,
            [&](Communicator& comm) {
              run_generic_case(comm, c, model, want, /*tol=*/0, {},
                               {.first_iteration = first, .end_iteration = end, .load_dir = load ? dir.string() : "",
                                .save_dir = save ? dir.string() : ""});
            },
            gpu.options);
      };
      segment(saved_on_device, 0, 2, false, true);
      segment(!saved_on_device, 2, 4, true, false);
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mxddp::testing
