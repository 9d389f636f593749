// FSDP under mpirun (-np 2 and -np 4): every strategy trains to DDP's losses over MPI, MXFP8 params
// (their scales MAX all-reduced over MPI) to DDP MXFP8's, and a checkpoint saved by FSDP across
// processes resumes under DDP.
#include <mxddp/fsdp.h>

#include "model/train_util.h"
#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// OpenMPI's reduce-scatter and all-reduce may sum in different orders: the last bits differ.
constexpr double kMpiRelTol = 1e-5;

TrainConfig fsdp_config(ShardingStrategy s) {
  TrainConfig c = small_train_config();
  c.global_batch_size = 8;
  c.eval_iters = 0;
  c.use_megatron_fsdp = true;
  c.fsdp.data_parallel_sharding_strategy = s;
  c.fsdp.overlap_grad_reduce = c.fsdp.overlap_param_gather = true;
  return c;
}

TEST(FsdpMpi, EveryStrategyMatchesDdp) {
  set_compute_threads(1);
  TrainConfig ddp = small_train_config();
  ddp.global_batch_size = 8;
  ddp.eval_iters = 0;
  const std::vector<double> want = losses(train(*g_mpi_comm, ddp));
  for (ShardingStrategy s : {ShardingStrategy::kNoShard, ShardingStrategy::kOptim, ShardingStrategy::kOptimGrads,
                             ShardingStrategy::kOptimGradsParams}) {
    const TrainResult r = train(*g_mpi_comm, fsdp_config(s));
    expect_close(losses(r), want, kMpiRelTol, std::string(sharding_strategy_name(s)).c_str());
    for (const RankMemory& m : r.memory_by_rank) EXPECT_EQ(m.steady.live(MemoryCategory::kGathered), 0);
  }
}

TEST(FsdpMpi, Mxfp8ParamsMatchDdpMxfp8WithAndWithoutTheFineGrainedGather) {
  set_compute_threads(1);
  TrainConfig ddp = small_train_config();
  ddp.global_batch_size = 8;
  ddp.eval_iters = 0;
  ddp.ddp.fp8_param_gather = true;
  const std::vector<double> want = losses(train(*g_mpi_comm, ddp));
  for (bool fine_grained : {false, true}) {
    TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams);
    c.ddp.fp8_param_gather = true;
    c.recompute_granularity = fine_grained ? RecomputeGranularity::kSelective : RecomputeGranularity::kFull;
    if (fine_grained) c.recompute_modules = {RecomputeModule::kMlp};  // requires the fine-grained gather
    const TrainResult r = train(*g_mpi_comm, c);
    expect_close(losses(r), want, kMpiRelTol, fine_grained ? "mxfp8 fine-grained" : "mxfp8 unit");
    for (const RankMemory& m : r.memory_by_rank) {
      EXPECT_EQ(m.steady.live(MemoryCategory::kGathered), 0);
      EXPECT_GT(m.peak_gathered_bytes_by_slot[static_cast<size_t>(GatherSlot::kRowwise)], 0);
      EXPECT_GT(m.peak_gathered_bytes_by_slot[static_cast<size_t>(GatherSlot::kColwise)], 0);
    }
  }
}

TEST(FsdpMpi, FsdpCheckpointResumesUnderDdp) {
  set_compute_threads(1);
  const std::string dir = shared_temp_dir("mxddp_mpi_fsdp_resume");
  TrainConfig ddp = small_train_config();
  ddp.eval_iters = 0;
  ddp.train_iters = 6;
  const std::vector<double> full = losses(train(*g_mpi_comm, ddp));
  TrainConfig first = fsdp_config(ShardingStrategy::kOptimGradsParams);
  first.global_batch_size = ddp.global_batch_size;
  first.train_iters = 3;
  first.save_dir = dir + "/ckpt";
  train(*g_mpi_comm, first);
  ddp.load_dir = first.save_dir;
  const TrainResult resumed = train(*g_mpi_comm, ddp);
  expect_close(losses(resumed), std::vector<double>(full.begin() + 3, full.end()), kMpiRelTol, "fsdp -> ddp");
}

}  // namespace
}  // namespace mxddp::testing
