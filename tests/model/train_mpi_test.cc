// The training loop under mpirun (-np 2 and -np 4): the same global batch gives the losses of a
// single-rank run, and a run saved and resumed across processes reproduces the uninterrupted one.
#include "model/train_util.h"
#include "mpi_main.h"

namespace mxddp::testing {
namespace {

// OpenMPI reduces in its own order, so the last bits differ from the single rank's.
constexpr double kMpiRelTol = 1e-5;

TEST(TrainMpi, SameGlobalBatchGivesTheSingleRankLosses) {
  set_compute_threads(1);
  TrainConfig c = small_train_config();
  c.global_batch_size = 8;  // accumulation 2 at -np 2, 1 at -np 4
  const TrainResult single = train_local(1, c);
  const TrainResult mpi = train(*g_mpi_comm, c);
  expect_close(losses(mpi), losses(single), kMpiRelTol, "mpi vs one rank");
  ASSERT_EQ(mpi.memory_by_rank.size(), static_cast<size_t>(g_mpi_comm->size()));
  for (const RankMemory& m : mpi.memory_by_rank) EXPECT_EQ(m.scratch_allocations_after_warmup, 0);
}

TEST(TrainMpi, OverlappedRunGivesTheSameLosses) {
  set_compute_threads(1);
  TrainConfig c = small_train_config();
  const auto base = losses(train(*g_mpi_comm, c));
  c.ddp.overlap_grad_reduce = true;
  c.ddp.bucket_size = 3000;
  c.ddp.overlap_param_gather = true;
  EXPECT_EQ(losses(train(*g_mpi_comm, c)), base);
}

TEST(TrainMpi, ResumeReproducesTheUninterruptedRun) {
  set_compute_threads(1);
  const std::string dir = shared_temp_dir("mxddp_mpi_train_resume");
  TrainConfig c = small_train_config();
  c.train_iters = 6;
  const std::vector<double> full = losses(train(*g_mpi_comm, c));
  TrainConfig first = c;
  first.train_iters = 3;
  first.save_dir = dir;
  train(*g_mpi_comm, first);
  TrainConfig rest = c;
  rest.load_dir = dir;
  const TrainResult resumed = train(*g_mpi_comm, rest);
  EXPECT_EQ(losses(resumed), std::vector<double>(full.begin() + 3, full.end()));
  g_mpi_comm->barrier();
  if (g_mpi_comm->rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace mxddp::testing
