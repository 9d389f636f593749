// StagedBackend (staged_backend.h): a device rank's collective through host memory.
//
// Order of events for one collective:
//   1. issue(), on the issuing thread: a staging block is taken (one per collective in flight,
//      reused across steps), the input's copy into it is enqueued on the rank's stream, and an event
//      recorded after it. The copy thus runs right after the work the rank enqueued before the
//      collective (a bucket's last grads), never waiting for what it enqueues after (the rest of
//      backward);
//   2. run(), on the communicator's progress thread: the event is waited for, and the host engine
//      runs the collective on the staging, in the caller's form (in place or not), so it takes the
//      path and summation order the host communicator takes for the same call. It checks that every
//      rank issued the same call before it moves anything, so a disagreement leaves the device
//      buffers as they were;
//   3. still in run(): the output's copy back is enqueued on the rank's stream, and the block goes
//      back to the free ones with an event after that copy. No host wait: the rank's work after
//      Work::wait() is enqueued after the copy, and a later collective's input copy into the same
//      block is too, so the block is not overwritten before the copy out of it has read it (the
//      host writes a block only after waiting for an event after that later copy). A block is
//      freed (replaced by a larger one, or at the end) only after its event.
// A rank that fails in step 1 or in the wait (no page-locked memory left, a device fault) still
// takes part in the host engine's agreement check, with a refused call (kRefusedCallCount): every
// rank then fails the collective at once, naming it, rather than waiting out the timeout for its
// bytes.
#include "staged_backend.h"

#include <algorithm>
#include <exception>
#include <limits>

namespace mxddp {

int64_t staged_host_bytes(CollectiveKind kind, DType dtype, int64_t count, int size, bool in_place) {
  MXDDP_CHECK(count >= 0 && size >= 1, "staged_host_bytes: count {} and size {} must be >= 0 and >= 1", count, size);
  if (kind == CollectiveKind::kBarrier) return 0;
  const bool whole = kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllGather;
  const auto element_bytes = static_cast<int64_t>(dtype_size_bytes(dtype));
  const int64_t per_count_bytes = whole ? element_bytes * (size + (in_place ? 0 : 1)) : element_bytes;
  MXDDP_CHECK(count <= std::numeric_limits<int64_t>::max() / per_count_bytes,
              "{} of {} {} elements per rank over {} ranks: the staging's byte count overflows", collective_name(kind),
              count, dtype_name(dtype), size);
  return count * per_count_bytes;
}

StagedBackend::StagedBackend(std::unique_ptr<CommBackend> host, Compute& device, MemoryTracker* tracker,
                             bool host_checks_agreement)
    : host_(std::move(host)),
      device_(device),
      host_checks_agreement_(host_checks_agreement),
      tracker_(tracker ? tracker : &own_tracker_) {
  MXDDP_CHECK(host_ != nullptr, "StagedBackend: no host engine");
  MXDDP_CHECK(host_->compute().place() == MemoryPlace::kHost,
              "StagedBackend: the engine {} works on {} memory; staging serves an engine on host memory", host_->name(),
              to_string(host_->compute().device()));
}

// The copies out of the blocks may still be queued on the rank's stream: they finish first. (The
// Communicator has run every issued call before it destroys its engine: none is pending.)
StagedBackend::~StagedBackend() {
  for (FreeBlock& f : free_) {
    try {
      wait_read(f);
    } catch (...) {  // a device that failed is not the destructor's to report; its next use will say
    }
  }
}

void StagedBackend::set_memory_tracker(MemoryTracker* tracker) {
  std::lock_guard lock(mutex_);
  for (FreeBlock& f : free_) wait_read(f);  // no copy still uses a block freed here
  free_.clear();  // un-charged from the old tracker; the next collectives allocate anew
  tracker_ = tracker ? tracker : &own_tracker_;
  host_->set_memory_tracker(tracker);
}

// The smallest free block that holds bytes; else a new one, after freeing the largest free block
// (so that the blocks number the collectives in flight, each grown to the largest it staged, and
// the peak does not count a block with its successor). A block that is freed waits for the copy
// out of it first.
ComputeBuffer StagedBackend::take_block(size_t bytes) {
  std::lock_guard lock(mutex_);
  auto size_of = [](const FreeBlock& f) { return f.block.size_bytes(); };
  auto fits = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it)
    if (size_of(*it) >= bytes && (fits == free_.end() || size_of(*it) < size_of(*fits))) fits = it;
  if (fits != free_.end()) {
    ComputeBuffer block = std::move(fits->block);  // a copy out of it still queued runs before the next copy in
    free_.erase(fits);
    return block;
  }
  if (!free_.empty()) {
    auto largest = std::max_element(free_.begin(), free_.end(),
                                    [&](const FreeBlock& a, const FreeBlock& b) { return size_of(a) < size_of(b); });
    wait_read(*largest);
    free_.erase(largest);
  }
  return device_.allocate_host(bytes, MemoryCategory::kComm, *tracker_, /*zeroed=*/false);
}

// Until no copy uses the block. Without an event (an issue that failed before recording one, whose
// input copy may still be queued) that takes the whole stream.
void StagedBackend::wait_read(FreeBlock& f) {
  if (f.read) f.read->wait();
  else device_.synchronize();
}

void StagedBackend::give_back(ComputeBuffer block, std::unique_ptr<ComputeEvent> read) {
  if (block.data() == nullptr) return;
  std::lock_guard lock(mutex_);
  free_.push_back({std::move(block), std::move(read)});
}

namespace {

// One rank's count of the call's elements, in bytes.
size_t block_bytes_of(const CollectiveCall& call) {
  return static_cast<size_t>(call.count) * dtype_size_bytes(call.dtype);
}

bool in_place(const CollectiveCall& call, int rank) {
  const size_t own_offset_bytes = static_cast<size_t>(rank) * block_bytes_of(call);
  if (call.kind == CollectiveKind::kReduceScatter)
    return static_cast<const char*>(call.recv) == static_cast<const char*>(call.send) + own_offset_bytes;
  if (call.kind == CollectiveKind::kAllGather)
    return static_cast<const char*>(call.send) == static_cast<const char*>(call.recv) + own_offset_bytes;
  return true;
}

}  // namespace

// Enqueues the input's copy into host (staged_host_bytes of the call); returns the call as host runs it.
CollectiveCall StagedBackend::stage_in(const CollectiveCall& call, char* host) {
  const size_t block_bytes = block_bytes_of(call);
  const bool same_buffer = in_place(call, rank());
  CollectiveCall staged = call;
  switch (call.kind) {
    case CollectiveKind::kAllReduce:
      device_.copy_to_host_async(host, call.send, block_bytes);
      staged.send = staged.recv = host;
      break;
    case CollectiveKind::kBroadcast:  // only the root's input is read
      if (rank() == call.root) device_.copy_to_host_async(host, call.send, block_bytes);
      staged.send = staged.recv = host;
      break;
    case CollectiveKind::kReduceScatter: {
      const size_t whole_bytes = block_bytes * static_cast<size_t>(size());
      device_.copy_to_host_async(host, call.send, whole_bytes);
      staged.send = host;
      staged.recv = same_buffer ? host + static_cast<size_t>(rank()) * block_bytes : host + whole_bytes;
      break;
    }
    case CollectiveKind::kAllGather: {
      const size_t whole_bytes = block_bytes * static_cast<size_t>(size());
      char* send = same_buffer ? host + static_cast<size_t>(rank()) * block_bytes : host + whole_bytes;
      device_.copy_to_host_async(send, call.send, block_bytes);
      staged.send = send;
      staged.recv = host;
      break;
    }
    case CollectiveKind::kBarrier:
      break;
  }
  return staged;
}

// Only what the collective writes: a reduce-scatter's block (not the rest of an in-place input),
// not a broadcast root's buffer. Enqueued: the rank's stream runs it before its later work.
void StagedBackend::copy_out(const CollectiveCall& call, const CollectiveCall& staged) {
  const size_t block_bytes = block_bytes_of(call);
  switch (call.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduceScatter:
      device_.copy_from_host(call.recv, staged.recv, block_bytes);
      break;
    case CollectiveKind::kBroadcast:
      if (rank() != call.root) device_.copy_from_host(call.recv, staged.recv, block_bytes);
      break;
    case CollectiveKind::kAllGather:
      device_.copy_from_host(call.recv, staged.recv, block_bytes * static_cast<size_t>(size()));
      break;
    case CollectiveKind::kBarrier:
      break;
  }
}

void StagedBackend::issue(const CollectiveCall& call) noexcept {
  if (call.kind == CollectiveKind::kBarrier) return;  // nothing to stage
  Staged staged;
  staged.issued = call;
  try {
    const auto bytes =
        static_cast<size_t>(staged_host_bytes(call.kind, call.dtype, call.count, size(), in_place(call, rank())));
    staged.block = take_block(bytes);
    staged.call = stage_in(call, static_cast<char*>(staged.block.data()));
    staged.input = device_.record_event();
  } catch (...) {
    staged.failure = std::current_exception();
  }
  try {
    std::lock_guard lock(mutex_);
    pending_.push_back(std::move(staged));
  } catch (...) {  // no memory for the queue's node: run() finds no entry for the call and says so
  }
}

// Without the agreement check the peers cannot be told: they wait for this rank's bytes until the
// host engine's watchdog ends the job.
void StagedBackend::refuse(std::exception_ptr failure) {
  if (host_checks_agreement_) {
    try {
      host_->run(CollectiveCall{.kind = CollectiveKind::kBarrier, .count = kRefusedCallCount});
    } catch (...) {  // it fails on every rank, by design; this rank's own cause is the news
    }
  }
  std::rethrow_exception(failure);
}

void StagedBackend::run(const CollectiveCall& call) {
  if (call.kind == CollectiveKind::kBarrier) {
    host_->run(call);
    return;
  }
  Staged staged;
  {
    std::lock_guard lock(mutex_);
    const auto is_this_call = [&](const Staged& s) {
      return s.issued.send == call.send && s.issued.recv == call.recv && describe_mismatch(s.issued, call).empty();
    };
    if (pending_.empty() || !is_this_call(pending_.front())) {
      try {
        MXDDP_FAIL("{} of {} elements: its staging was lost when it was issued (out of memory)",
                   collective_name(call.kind), call.count);
      } catch (...) {
        staged.failure = std::current_exception();
      }
    } else {
      staged = std::move(pending_.front());
      pending_.pop_front();
    }
  }
  if (!staged.failure) {
    try {
      staged.input->wait();
    } catch (...) {
      staged.failure = std::current_exception();
    }
  }
  // A block given back after a failure carries its input's event (if it was recorded): freeing it
  // then waits for that copy only.
  if (staged.failure) {
    give_back(std::move(staged.block), std::move(staged.input));
    refuse(staged.failure);
  }
  try {
    host_->run(staged.call);
  } catch (...) {
    give_back(std::move(staged.block), std::move(staged.input));
    throw;
  }
  copy_out(call, staged.call);
  give_back(std::move(staged.block), device_.record_event());
}

}  // namespace mxddp
