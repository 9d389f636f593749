// ParamSync: the distributed optimizer's param all-gather over a ParamAndGradBuffer, bucket group
// by bucket group, and the MXFP8 reuse mechanism (reuse_grad_buf_for_mxfp8_param_ag) that stages
// those gathers inside the grad buffer.
//
// After the optimizer step each rank's shard of the param buffer holds its updated params; a sync
// all-gathers every bucket so every rank holds all of them. Groups are gathered in reverse index
// order (the last group holds the first layers, which forward needs first). With
// overlap_param_gather only the first group is dispatched at once and the forward pre-hooks
// (before_forward) wait for each group as the model reaches it and prefetch the next.
//
// With fp8_param_gather the param buffer only stages: after a group's gather, each of its params
// is moved out into the ModelParamStore (quantized to MXFP8 or copied as BF16). With reuse the
// staging area is the grad buffer, so a gather may only run while no gradients live there, and
// each group's staging is zeroed once its params are moved out (it overlaps other buckets' grads).
// force(): the one entry point for a forced sync (checkpoint, evaluation, end of training), which
// owns the reuse branch: it never trusts what the staging area holds, and re-stages first.
#pragma once

#include <functional>
#include <vector>

#include <mxddp/buffer.h>
#include <mxddp/comm.h>

#include "model_params.h"

namespace mxddp {

struct ParamSyncOptions {
  bool overlap_param_gather = false;
  bool reuse_grad_buf_for_mxfp8_param_ag = false;
};

class ParamSync {
 public:
  // store: the params' own copies with fp8_param_gather, else null. grads_live: whether
  // gradients live in the grad buffer now (a gather staged there would overwrite them).
  ParamSync(Communicator& comm, ParamAndGradBuffer& buffer, ModelParamStore* store, const ParamSyncOptions& options,
            std::function<bool()> grads_live);
  ~ParamSync();  // waits for gathers still in flight

  // Starts a sync of what is staged in this rank's shards: everything before returning, or with
  // overlap_param_gather (and not force_sync) the first group only.
  void start(bool force_sync = false);
  // The pieces of start() for a caller that dispatches group by group (the optimizer with
  // overlap_param_gather_with_optimizer_step): begin with nothing dispatched, then dispatch in
  // gather order (groups num_groups-1 down to 0).
  void begin();
  void dispatch_next();
  int next_group() const;  // the group dispatch_next would dispatch; -1 when none is left
  // Waits for `group`'s gather and those of the groups gathered before it (dispatching them if
  // needed), then dispatches the next group so it overlaps the caller's compute.
  void finish(int group);
  // The forward pre-hook: call before a module uses these params (registration indices).
  void before_forward(const std::vector<int>& params);
  void wait_in_flight();  // waits for what is dispatched, dispatches nothing new
  void complete();        // dispatches what is left and waits for everything
  bool pending() const { return pending_; }
  // Whether `group`'s gather is part of the sync under way and not yet waited for: its params'
  // values are still to land.
  bool gather_pending(int group) const { return pending_ && !waited_.at(static_cast<size_t>(group)); }
  int group_of_param(int param) const { return group_of_param_.at(static_cast<size_t>(param)); }

  // A forced sync. stage() casts the main params into this rank's shards; zero_grads() zeroes
  // the grad buffer (the staging area under reuse, which may hold gradients or zeros).
  void force(const std::function<void()>& stage, const std::function<void()>& zero_grads);
  // Before the grad buffer is zeroed under reuse: a sync still pending stages there, so finish it
  // from its still-valid staging first. Afterwards the param buffer no longer holds params.
  void before_zero_grad_buffer();
  bool param_buffer_holds_params() const { return param_buffer_holds_params_; }

 private:
  int num_groups() const { return static_cast<int>(buffer_.bucket_groups().size()); }
  void check_no_live_grads_under_staging() const;
  void dispatch(int position);  // position k gathers group num_groups-1-k
  void wait(int group);         // waits, then (once) moves the group's params out
  void on_gathered(int group);  // into the store, and zero the staging (reuse)

  Communicator& comm_;
  ParamAndGradBuffer& buffer_;
  ModelParamStore* store_;
  ParamSyncOptions options_;
  std::function<bool()> grads_live_;
  std::vector<int> group_of_param_;  // [num params]
  bool pending_ = false;
  int next_position_ = 0;                 // positions [0, this) are dispatched
  std::vector<std::vector<Work>> works_;  // [num groups]
  std::vector<bool> waited_;              // [num groups]
  bool param_buffer_holds_params_ = true;
};

}  // namespace mxddp
