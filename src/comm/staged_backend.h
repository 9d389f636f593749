// StagedBackend: a CommBackend decorator that lets an engine between processes, which moves host
// memory only (mpi), serve ranks whose buffers live on a device. Each collective's input is copied
// from the device into page-locked host memory (Compute::allocate_host), the host engine runs the
// same collective there, and its output is copied back. This is how several processes share one
// GPU, where NCCL refuses two ranks on the same device (docs/comm.md, "Ranks on a device").
// The copies run in the rank's stream order: the input's is enqueued when the collective is issued,
// the output's when the host engine is done, so neither waits for the rank's later work.
#pragma once

#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

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
  ~StagedBackend() override;
  StagedBackend(const StagedBackend&) = delete;
  StagedBackend& operator=(const StagedBackend&) = delete;
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string_view name() const override { return host_->name(); }
  Compute& compute() const override { return device_; }
  void issue(const CollectiveCall& call) noexcept override;
  void run(const CollectiveCall& call) override;
  void set_memory_tracker(MemoryTracker* tracker) override;

 private:
  // One collective between issue() and run(): its input's copy enqueued into its own staging block.
  struct Staged {
    CollectiveCall issued;                // as the caller issued it
    CollectiveCall call;                  // as host runs it, its buffers in block
    ComputeBuffer block;                  // [staged_host_bytes] page-locked
    std::unique_ptr<ComputeEvent> input;  // reached when the input's copy is done
    std::exception_ptr failure;           // why this rank could not stage it
  };
  // A staging block no pending call holds, and an event after the last copy that uses it (null: an
  // issue failed before it recorded one): a block is freed only once no copy uses it.
  struct FreeBlock {
    ComputeBuffer block;
    std::unique_ptr<ComputeEvent> read;
  };

  CollectiveCall stage_in(const CollectiveCall& call, char* host);
  void copy_out(const CollectiveCall& call, const CollectiveCall& staged);
  ComputeBuffer take_block(size_t bytes);
  void give_back(ComputeBuffer block, std::unique_ptr<ComputeEvent> read = nullptr);
  void wait_read(FreeBlock& f);
  [[noreturn]] void refuse(std::exception_ptr failure);

  std::unique_ptr<CommBackend> host_;
  Compute& device_;
  const bool host_checks_agreement_;
  MemoryTracker own_tracker_;
  std::mutex mutex_;  // guards tracker_, pending_ and free_ (issue() and run() are on two threads)
  MemoryTracker* tracker_;
  std::deque<Staged> pending_;  // issued, not yet run, in issue order
  std::vector<FreeBlock> free_;  // declared after the trackers its blocks are charged to
};

}  // namespace mxddp
