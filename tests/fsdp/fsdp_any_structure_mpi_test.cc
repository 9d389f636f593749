// The generic model (generic_model.h) under mpirun (-np 2 and 4): every structure class under DDP
// and every FSDP strategy, against the serial reference each process computes for itself, with the
// local suite's gather checks.
//
// How close: OpenMPI sums a reduction in an order of its own and applies the 1/dp prescale after
// the sum, where the local backend (and the reference) prescale each rank's part and sum in rank
// order. With 2 ranks that is the same bits (a two-term sum commutes, and scaling by 1/2 is exact),
// so -np 2 is checked bit for bit. With 4 ranks the grads differ in their last bit, and a later
// iteration can turn that into a different bf16 (or MXFP8) rounding of a param and a visibly
// different gradient; so -np 4 checks f32-param runs over 3 iterations and bf16 or MXFP8 runs over
// their first iteration, within 1e-6 (|got - want| <= 1e-6 * max(1, |want|)).
#include "comm/recording_compute.h"
#include "fsdp/generic_model_run.h"
#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// Per structure class: DDP (replicated and distributed optimizer), each FSDP strategy and the MXFP8
// variants, micro-batches 1 and 3, with overlap, fine-grained and recompute alternating.
TEST(AnyStructureMpi, EveryStructureAndModeMatchesTheSerialReference) {
  const int dp = g_mpi_comm->size();
  const bool same_sum = dp <= 2;
  int k = 0;
  for (StructureClass structure : kStructureClasses)
    for (DpMode mode : kDpModes)
      for (bool mxfp8 : {false, true}) {
        if (mxfp8 && !mxfp8_valid(mode)) continue;
        for (int micro_batches : {1, 3}) {
          GenericCase c{.structure = structure, .seed = 11, .mode = mode, .fine_grained = k % 2 == 1, .mxfp8 = mxfp8,
                        .overlap_grad_reduce = k % 3 != 0, .overlap_param_gather = k % 4 < 2};
          c.run.dp = dp;
          c.run.micro_batches = micro_batches;
          c.run.recompute = k % 5 < 2;
          ++k;
          if (!same_sum) {
            if (!mxfp8) c.run.param_dtype = DType::kF32;
            else c.run.iterations = 1;
          }
          SCOPED_TRACE(c.name());
          const GenericModel model = generic_model_of(c);
          run_generic_case(*g_mpi_comm, c, model, generic_reference_of(c, model), same_sum ? 0.0 : 1e-6);
        }
      }
}

// Processes whose buffers are on a device (each compute claims cuda:0, as processes sharing one GPU
// would, and its host <-> device copies lag as a stream's; MpiOptions::compute), every collective staged through host memory: DDP with the
// distributed optimizer and every FSDP strategy, with MXFP8 params where they apply, give the same
// bits as the same job on host memory (every main param element this rank updated, after every
// iteration), and match the serial reference as the host suite does. Not here: DDP with the
// replicated optimizer, whose test harness steps the params in host code.
TEST(AnyStructureMpi, StagedFromADeviceGivesTheHostRunsBits) {
  const int dp = g_mpi_comm->size();
  const bool same_sum = dp <= 2;
  int k = 0;
  for (DpMode mode : kDpModes) {
    if (mode == DpMode::kDdp) continue;
    for (bool mxfp8 : {false, true}) {
      if (mxfp8 && !mxfp8_valid(mode)) continue;
      GenericCase c{.structure = StructureClass::kTiedFirstLast, .seed = 5, .mode = mode, .fine_grained = k % 2 == 1,
                    .mxfp8 = mxfp8, .overlap_grad_reduce = k % 3 != 0, .overlap_param_gather = k % 4 < 2};
      c.run.dp = dp;
      c.run.micro_batches = k % 2 == 0 ? 3 : 1;
      ++k;
      if (!same_sum) {
        if (!mxfp8) c.run.param_dtype = DType::kF32;
        else c.run.iterations = 1;
      }
      SCOPED_TRACE(c.name() + " staged from cuda:0");
      const GenericModel model = generic_model_of(c);
      const auto want = generic_reference_of(c, model);
      const double tol = same_sum ? 0.0 : 1e-6;
      std::vector<std::vector<float>> on_host(1), on_device(1);
      run_generic_case(*g_mpi_comm, c, model, want, tol, {}, {.updated_mains = &on_host[0]});
      RecordingCompute device(Device::cuda(0));
      device.lagging = true;  // its copies run behind the host, as a stream's
      auto staged = make_mpi_communicator({.compute = &device});
      run_generic_case(*staged, c, model, want, tol, {}, {.updated_mains = &on_device[0]});
      expect_same_updated_mains(on_host, on_device);
      EXPECT_GT(device.allocations.load(), 0) << "the buffers were allocated on the rank's compute";
      EXPECT_GT(device.host_allocations.load(), 0) << "the collectives were staged through host memory";
    }
  }
}

}  // namespace
}  // namespace mxddp::testing
