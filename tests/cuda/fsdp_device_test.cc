// Every FSDP strategy (optim_grads_params with MXFP8 params too) and DDP with the distributed
// optimizer (with MXFP8 params too), with 2 and 4 ranks on one GPU (a stream and a CUDA compute
// each): the generic model of tests/fsdp/generic_model.h trains on device buffers and its main
// params must equal the serial reference bit for bit after every iteration, as on the host
// (tests/fsdp/fsdp_any_structure_test.cc runs such cases on a claimed device in every CI run). The
// model itself computes on the host, reading and writing the device buffers through copies. And
// HSDP on a 2 x 2 grid on the GPU against the same job on the host, bit for bit. Needs a device:
// device_main.cc skips (77).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace mxddp::testing
