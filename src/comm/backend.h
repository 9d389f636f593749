// The engine interfaces under Communicator. A CommBackend runs one already-validated collective to
// completion on the calling thread (the communicator's progress thread); a StreamOrderedBackend
// (nccl) enqueues it in its device's stream order on the issuing thread instead. Argument
// validation and the order of issue live in Communicator, so each engine is only its data movement.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include <mxddp/comm.h>
#include <mxddp/compute.h>

#include "work_state.h"

namespace mxddp {

enum class CollectiveKind : uint8_t { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
std::string_view collective_name(CollectiveKind kind);

// One collective as issued by one rank. Pointers are in the backend's memory (device()).
//   all_reduce:     send == recv, count elements
//   reduce_scatter: send holds size*count, recv count (may be send's own block)
//   all_gather:     send holds count, recv size*count (send may be recv's own block)
//   broadcast:      send == recv, count elements
//   barrier:        no buffers, count 0
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  int64_t count = 0;
  float prescale = 1.0f;  // reductions only
  const void* send = nullptr;
  void* recv = nullptr;
};

// The fields every rank must agree on. Returns "" if a and b agree, else which field differs, with
// both values (e.g. "count 12 vs 16").
std::string describe_mismatch(const CollectiveCall& a, const CollectiveCall& b);

// A call header on the wire, for the backends whose ranks are processes (mpi, torch's gloo): the
// sequence number, then the fields describe_mismatch compares, as int64s (prescale as its f32 bits).
inline constexpr int kCallHeaderFields = 7;
std::array<int64_t, kCallHeaderFields> pack_call_header(uint64_t seq, const CollectiveCall& call);
// The count of the call a rank issues in place of its own when it failed before it could take part
// (StagedBackend: its input could not be staged). No real call has it (counts are >= 0), so every
// rank's agreement check refuses the collective at once, naming that rank, instead of waiting for
// bytes that will never come; and the ranks' sequences stay in step.
inline constexpr int64_t kRefusedCallCount = -1;
// Checks every rank's header, headers[r * stride, r * stride + kCallHeaderFields) for r < size (a
// backend may append fields of its own): each must carry sequence seq (else the ranks' sequences
// diverged, a bug in mxddp), none may be a refused call (kRefusedCallCount), and each call must
// agree with rank 0's. Throws an Error naming the collective, the first rank that differs and how.
void check_call_headers(const int64_t* headers, int size, int stride, uint64_t seq, CollectiveKind kind);

// What every engine says about itself.
class CommEngine {
 public:
  virtual ~CommEngine() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view name() const = 0;
  // Where the buffers of its collectives live and what works on them: cpu_compute() for the
  // engines between processes (mpi, torch's groups), or the rank's device compute when they are
  // staged through host memory (MpiOptions::compute, StagedBackend); the rank's own in a local
  // group (LocalOptions::computes); a CUDA compute on the rank's stream for nccl.
  virtual Compute& compute() const = 0;
};

class CommBackend : public CommEngine {
 public:
  // Called by Communicator on the issuing thread, one call at a time in issue order, just before
  // `call` is queued for run(): an engine that must act in the caller's order of work does it here
  // (StagedBackend enqueues its input's copy on the rank's stream). Must not throw: a failure here
  // is the run()'s to report, so that every rank still runs the call and the sequences stay in step.
  virtual void issue(const CollectiveCall& /*call*/) noexcept {}
  // Runs `call` to completion. Must verify that every rank issued the same call (see
  // describe_mismatch) before touching any buffer, and throw Error on a mismatch or a failure.
  virtual void run(const CollectiveCall& call) = 0;
  // Communicator::set_memory_tracker, on the progress thread between collectives. Only a backend
  // with staging buffers (mpi) has anything to charge.
  virtual void set_memory_tracker(MemoryTracker* /*tracker*/) {}
};

// One collective a stream-ordered engine has enqueued: what its Work does.
using EnqueuedCollective = detail::StreamOrderHooks;

// An engine whose collectives run in its device's stream order (nccl): Communicator calls enqueue()
// on the issuing thread, one call at a time in issue order, and the Work it returns orders the
// rank's compute stream after the collective instead of waiting on the host.
class StreamOrderedBackend : public CommEngine {
 public:
  // Enqueues `call` after the work enqueued so far on the compute stream. Must verify that every rank
  // issued the same call before touching any buffer, and throw Error on a mismatch or a failure
  // found while enqueueing; a failure found later is late_failure's.
  virtual EnqueuedCollective enqueue(const CollectiveCall& call) = 0;
};

}  // namespace mxddp
