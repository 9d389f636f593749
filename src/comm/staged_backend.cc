// StagedBackend (staged_backend.h): a device rank's collective through host memory.
//
// Order of events for one collective, on the communicator's progress thread:
//   1. the input is copied to the page-locked staging. The copy runs in the compute's order, after
//      what the rank enqueued before the collective (and, as with the local backend's device ranks,
//      whatever it enqueued since), and copy_to_host waits for it;
//   2. the host engine runs the collective on the staging, in the caller's form (in place or not),
//      so it takes the path and summation order the host communicator takes for the same call. It
//      checks that every rank issued the same call before it moves anything, so a disagreement
//      leaves the device buffers as they were;
//   3. the output is copied back, and the compute synchronized, so that the staging may be
//      overwritten by the next collective and the Work completes with the bytes on the device.
// A rank that fails in step 1 (no page-locked memory left, a device fault) still takes part in the
// host engine's agreement check, with a refused call (kRefusedCallCount): every rank then fails the
// collective at once, naming it, rather than waiting out the timeout for its bytes.
#include "staged_backend.h"

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

void StagedBackend::set_memory_tracker(MemoryTracker* tracker) {
  staging_ = ComputeBuffer();  // un-charged from the old tracker; the next collective re-allocates
  tracker_ = tracker ? tracker : &own_tracker_;
  host_->set_memory_tracker(tracker);
}

void* StagedBackend::staging(size_t bytes) {
  if (staging_.size_bytes() < bytes) {
    staging_ = ComputeBuffer();  // freed before its successor is allocated: the peak is the larger one
    staging_ = device_.allocate_host(bytes, MemoryCategory::kComm, *tracker_, /*zeroed=*/false);
  }
  return staging_.data();
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

CollectiveCall StagedBackend::stage_in(const CollectiveCall& call) {
  const size_t block_bytes = block_bytes_of(call);
  const bool same_buffer = in_place(call, rank());
  auto* host = static_cast<char*>(
      staging(static_cast<size_t>(staged_host_bytes(call.kind, call.dtype, call.count, size(), same_buffer))));
  CollectiveCall staged = call;
  switch (call.kind) {
    case CollectiveKind::kAllReduce:
      device_.copy_to_host(host, call.send, block_bytes);
      staged.send = staged.recv = host;
      break;
    case CollectiveKind::kBroadcast:  // only the root's input is read
      if (rank() == call.root) device_.copy_to_host(host, call.send, block_bytes);
      staged.send = staged.recv = host;
      break;
    case CollectiveKind::kReduceScatter: {
      const size_t whole_bytes = block_bytes * static_cast<size_t>(size());
      device_.copy_to_host(host, call.send, whole_bytes);
      staged.send = host;
      staged.recv = same_buffer ? host + static_cast<size_t>(rank()) * block_bytes : host + whole_bytes;
      break;
    }
    case CollectiveKind::kAllGather: {
      const size_t whole_bytes = block_bytes * static_cast<size_t>(size());
      char* send = same_buffer ? host + static_cast<size_t>(rank()) * block_bytes : host + whole_bytes;
      device_.copy_to_host(send, call.send, block_bytes);
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
// not a broadcast root's buffer.
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
  device_.synchronize();  // the staging is free again, and the bytes are on the device
}

void StagedBackend::run(const CollectiveCall& call) {
  if (call.kind == CollectiveKind::kBarrier) {
    host_->run(call);
    return;
  }
  CollectiveCall staged;
  try {
    staged = stage_in(call);
  } catch (...) {
    // Without the agreement check the peers cannot be told: they wait for this rank's bytes until
    // the host engine's watchdog ends the job.
    if (host_checks_agreement_) {
      try {
        host_->run(CollectiveCall{.kind = CollectiveKind::kBarrier, .count = kRefusedCallCount});
      } catch (...) {  // it fails on every rank, by design; this rank's own cause is the news
      }
    }
    throw;
  }
  host_->run(staged);
  copy_out(call, staged);
}

}  // namespace mxddp
