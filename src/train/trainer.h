// The training loop behind train() (train.h), as one object per rank whose phases are named
// member functions: set up (check the run, load the data, build the DDP or FSDP, the distributed
// optimizer and the GPT), load a checkpoint, run the iterations (each: zero_grad, the
// micro-batches, finish_grad_sync, the step; then the exit decision, the replica check,
// evaluation and save), finish (the final param sync, throughput and every rank's memory).
//
// Private to src/train: train() is the public entry point, and drives it as
//   Trainer t(comm, config, callbacks);  // set up
//   t.load_checkpoint();                 // with config.load_dir
//   t.run_iterations();
//   return t.finish();
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <mxddp/checkpoint_history.h>
#include <mxddp/train.h>

#include "train_data.h"

namespace mxddp {

class Trainer {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective. Sets the run up; throws Error naming a bad config, a --save directory that is not
  // free, or a run that cannot fit in memory, before anything is allocated. comm, config and
  // callbacks must outlive this object.
  Trainer(Communicator& comm, const TrainConfig& config, const TrainCallbacks& callbacks);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Collective. Resumes from config.load_dir (nothing without one): the optimizer's state and
  // the iteration to start from.
  void load_checkpoint();
  // Collective. Iterations from the start (or resumed) one up to train_iters, or until an exit
  // condition stops them.
  void run_iterations();
  // Collective. The model holds the final params; returns what the run measured.
  TrainResult finish();

 private:
  // ---- Set-up phases, in this order (the constructor).
  // Every rank the same job (launch_check.h), the config, --save and its lock, the memory the run
  // needs, the compute threads.
  void check_run();
  // With --save and more than one rank: every rank sees rank 0's lock file in it (the directory is
  // shared by every rank's host) and can write there; otherwise every rank throws, naming the ranks.
  void check_save_dir_shared();
  void load_data();             // the training and validation splits; every rank the same data
  void build_data_parallel();   // DDP or FSDP over the GPT's params, wrapped when the callbacks ask
  void build_optimizer_and_model();

  // ---- One iteration and what follows it.
  StepRecord run_iteration(int64_t it);  // it: 0-based
  double run_micro_batches();  // the next global batch's; returns the sum of the micro-batches' losses
  // Stops the run (every rank together) on a NaN or Inf loss or gradient, unless that check is off.
  void check_finite(const StepRecord& rec, const StepResult& step);
  void mark_steady_state();              // after the first iteration: peaks from here are steady
  // The exit decision, replica check, evaluation and save due after `iteration` (1-based);
  // returns false when the run stops there.
  bool after_iteration(int64_t iteration);
  void check_weight_hashes(int64_t iteration);
  // The mean loss over eval_iters global batches of a split (eval_split_names), all-reduced.
  void evaluate(int64_t iteration, const std::string& split = "validation");
  void save_checkpoint(int64_t iteration);
  // Whether to stop after `iteration`, the same on every rank.
  struct ExitDecision {
    std::string reason;      // why; "" to go on
    bool requested = false;  // by TrainCallbacks::stop_requested (a signal): save before anything else
  };
  ExitDecision exit_decision(int64_t iteration);

  RankMemory rank_memory() const;
  int accumulation_steps() const { return config_.accumulation_steps(comm_.size()); }
  // This rank's micro-batch m starts at this sequence of a global batch (see TokenDataset).
  int64_t first_sequence(int m) const;

  Communicator& comm_;
  const TrainConfig& config_;
  const TrainCallbacks& callbacks_;
  const Clock::time_point start_time_;  // --exit-duration-in-mins counts from here, as Megatron's
  std::optional<SaveDirLock> save_lock_;  // rank 0's, with --save: held for the run's life
  // Declared in the order they are built, so they are destroyed model first, data last.
  std::optional<TrainData> data_;
  MemoryTracker tracker_;
  GlobalMemoryBuffer pool_{tracker_};
  // The communicator's staging (the mpi backend's f32 buffers) is charged to tracker_ while the
  // run lasts, so the report counts it as comm, as the plan does; handed back before tracker_ goes.
  struct StagingCharge {
    StagingCharge(Communicator& comm, MemoryTracker& tracker) : comm(comm) { comm.set_memory_tracker(&tracker); }
    // Waits for this rank's collectives still in flight (they may use the staging), then releases
    // it; the task only frees a buffer and sets a pointer, so it does not throw.
    ~StagingCharge() { comm.set_memory_tracker(nullptr); }
    StagingCharge(const StagingCharge&) = delete;
    StagingCharge& operator=(const StagingCharge&) = delete;
    Communicator& comm;
  };
  StagingCharge staging_charge_{comm_, tracker_};
  std::unique_ptr<DataParallel> data_parallel_;    // DDP or FSDP: the model and the optimizer see only this
  const FullyShardedDataParallel* fsdp_ = nullptr;  // the same object under FSDP, for its gather peaks
  std::optional<DistributedOptimizer> optimizer_;
  std::optional<GptModel> model_;
  std::vector<int32_t> tokens_;  // [micro-batch, T + 1]
  // The model's modules in forward order (GptModel's hooks): the embeddings, each layer (or
  // fine-grained submodule), the final norm. The weight-hash check reads each between its hooks.
  std::vector<std::vector<int>> forward_modules_;
  TrainResult result_;
  // Training samples consumed so far, resumes included: the next sample to read (TokenDataset).
  int64_t consumed_samples_ = 0;
  MemoryUsage warmup_usage_;  // the tracker after the first iteration
  int64_t allocations_at_warmup_ = 0;
  Clock::time_point train_start_;
};

}  // namespace mxddp
