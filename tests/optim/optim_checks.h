// Distributed-optimizer checks shared by the local suite and the MPI suite.
#pragma once

#include <gtest/gtest.h>

#include "optim/mlp.h"

namespace mxddp::testing {

constexpr int kGlobalBatch = 12;  // divisible by dp 1, 2, 3 and 4

inline DdpConfig optim_ddp_config(bool overlap_param_gather = false) {
  // Small buckets so the model spans several bucket groups (and several gathers).
  return DdpConfig{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 128,
                   .overlap_param_gather = overlap_param_gather};
}

// N steps at this communicator's dp against the unsharded reference over the same global batch.
// The reference sums the ranks' gradients in rank order, as the local backend does; rel_tol
// allows for engines (MPI) whose summation order is their own.
inline void check_matches_plain_optimizer(Communicator& comm, const OptimizerConfig& cfg, int steps,
                                          double rel_tol = 1e-6, DType param_dtype = DType::kBF16) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DdpConfig ddp_cfg = optim_ddp_config();
  ddp_cfg.param_dtype = param_dtype;
  DistributedDataParallel ddp(comm, mlp_params(), ddp_cfg, tracker, views_of(init));
  DistributedOptimizer opt(ddp, cfg, tracker);
  PlainTrainer ref(cfg, param_dtype);
  for (int s = 0; s < steps; ++s) {
    const double loss = ddp_train_step(opt, s, kGlobalBatch);
    const double ref_loss = ref.train_step(s, kGlobalBatch, comm.size());
    EXPECT_NEAR(loss, ref_loss, rel_tol * std::fabs(ref_loss)) << "step " << s;
  }
  EXPECT_LE(max_rel_diff_to_reference(opt, ref), rel_tol) << "rank " << comm.rank() << "/" << comm.size();
  EXPECT_EQ(opt.step_count(), steps);
}

}  // namespace mxddp::testing
