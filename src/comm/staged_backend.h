// StagedBackend: a CommBackend decorator that lets an engine between processes, which moves host
// memory only (mpi), serve ranks whose buffers live on a device. Each collective's input is copied
// from the device into page-locked host memory (Compute::allocate_host), the host engine runs the
// same collective there, and its output is copied back. This is how several processes share one
// GPU, where NCCL refuses two ranks on the same device (docs/comm.md, "Ranks on a device").
#pragma once

#include <memory>

#include "backend.h"

namespace mxddp {

// The host bytes StagedBackend keeps for one collective (it keeps the largest so far, charged as
// comm at the host's place): the message as the host engine sees it, in the caller's in-place form.
// count elements of dtype for all_reduce and broadcast; size * count for an in-place reduce_scatter
// or all_gather, and count more for the block of an out-of-place one; none for a barrier. Throws an
// Error naming the count if the bytes overflow.
int64_t staged_host_bytes(CollectiveKind kind, DType dtype, int64_t count, int size, bool in_place);

class StagedBackend final : public CommBackend {
 public:
  // host: an engine on host memory (its compute() is the host's). device: the rank's compute,
  // whose memory the communicator's buffers are in; it must outlive this. tracker: charged for the
  // staging (null: one private to this backend). host_checks_agreement: whether host checks that
  // the ranks issued the same call before moving bytes (MpiOptions::check_consistency); only then
  // can a rank that fails to stage its input make every peer fail at once (kRefusedCallCount).
  StagedBackend(std::unique_ptr<CommBackend> host, Compute& device, MemoryTracker* tracker, bool host_checks_agreement);
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string_view name() const override { return host_->name(); }
  Compute& compute() const override { return device_; }
  void run(const CollectiveCall& call) override;
  void set_memory_tracker(MemoryTracker* tracker) override;

 private:
  // The call as host runs it, its input copied into the staging.
  CollectiveCall stage_in(const CollectiveCall& call);
  void copy_out(const CollectiveCall& call, const CollectiveCall& staged);
  void* staging(size_t bytes);

  std::unique_ptr<CommBackend> host_;
  Compute& device_;
  const bool host_checks_agreement_;
  MemoryTracker own_tracker_;
  MemoryTracker* tracker_;
  ComputeBuffer staging_;  // [staged_host_bytes] page-locked; declared after the trackers it is charged to
};

}  // namespace mxddp
