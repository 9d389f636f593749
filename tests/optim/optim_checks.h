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
inline void check_matches_plain_optimizer(Communicator& comm, const OptimizerConfig& cfg, int steps) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
  DistributedOptimizer opt(ddp, cfg, tracker);
  PlainTrainer ref(cfg);
  for (int s = 0; s < steps; ++s) {
    const double loss = ddp_train_step(opt, s, kGlobalBatch);
    const double ref_loss = ref.train_step(s, kGlobalBatch, comm.size());
    EXPECT_NEAR(loss, ref_loss, 1e-6 * std::fabs(ref_loss)) << "step " << s;
  }
  EXPECT_LE(max_rel_diff_to_reference(opt, ref), 1e-6) << "rank " << comm.rank() << "/" << comm.size();
  EXPECT_EQ(opt.step_count(), steps);
}

}  // namespace mxddp::testing
