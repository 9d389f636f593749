// mxddp comm: collectives over a group of ranks, blocking or asynchronous.
//
// Owns: the Communicator (one validated entry point per collective), the Work handle an
// asynchronous collective returns, and the engines underneath it:
//   - local: N ranks are N threads of one process. Collectives read peers' buffers directly and
//     reduce in rank order 0..N-1, so results are bitwise deterministic and identical on every rank.
//   - mpi:   one process per rank under mpirun, over OpenMPI.
//   - nccl:  one process per rank, each on its own GPU (mxddp/nccl.h; built with the CUDA layer).
//
// Ordering and progress: a Communicator executes its collectives one at a time, in the order they
// were issued, on a progress thread of its own (a stream-ordered one, nccl, enqueues them on the
// issuing thread in the device's stream order instead: see Work::wait). An asynchronous call returns at once and the
// collective advances while the caller computes; a blocking call is the same call followed by
// wait(). Every rank must issue the same collectives in the same order with the same dtype, element
// count, reduce op and root; a mismatch is detected before any buffer is touched and fails the
// call on every rank with an Error naming the differing rank and field.
//
// Buffer lifetime: the caller keeps every buffer of a collective alive and unmodified until its
// Work completes (as with NCCL and MPI nonblocking calls).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <mxddp/core.h>
#include <mxddp/memory.h>

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Work: the handle of an issued collective
// ----------------------------------------------------------------------------------------------

namespace detail {
struct WorkState;
}

class Work {
 public:
  Work();  // an already-completed, successful Work
  explicit Work(std::shared_ptr<detail::WorkState> state);

  // Blocks until the collective finished. If it failed, rethrows its error (on every call).
  // On a stream-ordered communicator (nccl.h) the host does not wait for the device: wait() makes
  // the rank's compute stream wait for the collective, so the work enqueued there after it sees
  // its results, and rethrows a failure its engine found by then.
  void wait() const;
  // True once the collective finished, successfully or not (on a stream-ordered communicator:
  // once the device finished it). Never blocks.
  bool is_completed() const;

 private:
  std::shared_ptr<detail::WorkState> state_;
};

// ----------------------------------------------------------------------------------------------
// Per-operation options
// ----------------------------------------------------------------------------------------------

// Collectives move f32, bf16, u8, f64, i64, i32 and bool buffers, reduced as core.h's ReduceOp
// says for each.

// prescale (sum and avg of floats): every rank's input is multiplied by it (in f32; f64 in f64)
// as it enters the reduction (NCCL's PreMulSum): how DDP applies 1/dp without a separate pass over the
// gradients. The local backend fuses it into the reduction, bitwise equal to scaling each f32
// input first; the MPI backend applies it to the reduced result (equal up to rounding). Every rank
// must pass the same value.
struct AllReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  bool async_op = false;
  float prescale = 1.0f;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::kSum;
  bool async_op = false;
  float prescale = 1.0f;
};

struct AllGatherOptions {
  bool async_op = false;
};

struct BroadcastOptions {
  int root = 0;
  bool async_op = false;
};

struct BarrierOptions {
  bool async_op = false;
};

// ----------------------------------------------------------------------------------------------
// Communicator
// ----------------------------------------------------------------------------------------------

class CommEngine;            // the engine interfaces; private to src/comm
class CommBackend;
class StreamOrderedBackend;
class Compute;               // compute.h
class ProgressQueue;

class Communicator {
 public:
  explicit Communicator(std::unique_ptr<CommBackend> backend);
  // Collectives enqueued in the device's stream order on the issuing thread (nccl.h): no progress
  // thread, and Work::wait() orders the compute stream instead of waiting on the host.
  explicit Communicator(std::unique_ptr<StreamOrderedBackend> backend);
  ~Communicator();  // drains the collectives already issued
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  std::string_view backend_name() const;  // "local", "mpi", "nccl" (nccl.h), "torch" (the Python package)
  bool stream_ordered() const { return ordered_ != nullptr; }
  // Where this communicator's buffers live, and the rank's work on them (compute.h): cpu_compute()
  // on host memory, or a rank's own, which DDP then puts its buffers on: a local group's
  // (LocalOptions::computes), a device compute staged through host memory (MpiOptions::compute),
  // nccl's. Every view given to a collective must be on device().
  Compute& compute() const;
  Device device() const;

  // buffer /*in,out*/: reduced in place across ranks; any element count.
  Work all_reduce(TensorView buffer, const AllReduceOptions& options = {});

  // input  /*in*/:  size() equal blocks of output.numel() elements, block r destined for rank r.
  // output /*out*/: this rank's reduced block. In place when output is exactly this rank's block
  //                 of input: the rest of input is then scratch (the mpi backend's in-place form
  //                 writes block 0), as the unreduced rest of Megatron's grad buffer is.
  //                 Otherwise the two must not overlap and only output is written.
  Work reduce_scatter(TensorView input, TensorView output, const ReduceScatterOptions& options = {});

  // input  /*in*/:  this rank's block.
  // output /*out*/: size() blocks of input.numel() elements, block r from rank r. In place when
  //                 input is exactly this rank's block of output; otherwise no overlap.
  Work all_gather(TensorView input, TensorView output, const AllGatherOptions& options = {});

  // buffer /*in on root, out elsewhere*/.
  Work broadcast(TensorView buffer, const BroadcastOptions& options = {});

  Work barrier(const BarrierOptions& options = {});

  // Charges the backend's staging buffers (the mpi backend's f32 buffers, mpi_staging_bytes, and
  // for a device's buffers its page-locked copies of them, MpiOptions::compute; the local backend
  // has none) to tracker from now on, as MemoryCategory::kComm; null: a tracker
  // private to the backend. Runs after every collective this rank already issued; the staging held
  // so far is released from the old tracker, and the next reduction that needs it allocates it
  // against the new one. Before tracker is destroyed, set another (or null).
  void set_memory_tracker(MemoryTracker* tracker);

 private:
  struct Call;
  Work submit(const Call& call, bool async_op);

  // Exactly one engine: backend_ with its progress thread (queue_), or ordered_. issue_mutex_ keeps
  // the issuing threads one at a time, so either engine sees the calls in issue order.
  std::unique_ptr<CommBackend> backend_;
  std::unique_ptr<ProgressQueue> queue_;
  std::unique_ptr<StreamOrderedBackend> ordered_;
  std::unique_ptr<std::mutex> issue_mutex_;
  CommEngine* engine_ = nullptr;  // whichever of the two it is
};

// ----------------------------------------------------------------------------------------------
// The local backend: ranks as threads of this process
// ----------------------------------------------------------------------------------------------

// Latency injection, for parity tests and benchmarks (either backend). Before running a
// collective of a selected kind, a rank's progress thread sleeps a time drawn uniformly from
// [min_us, max_us] by a generator of its own (seeded from seed and the rank), so ranks reach each
// collective in a different order every time, as stragglers and network jitter make them; with
// min_us == max_us it is a fixed per-collective latency. Off while max_us is 0.
struct CollectiveDelay {
  int64_t min_us = 0;
  int64_t max_us = 0;
  uint64_t seed = 0;
  bool all_reduce = false;
  bool reduce_scatter = true;
  bool all_gather = true;
  bool broadcast = false;
};

struct LocalOptions {
  // How long a rank waits for its peers to arrive at a collective before the whole group fails
  // with an Error naming the ranks that never arrived. After that every collective of the group
  // fails at once: a group that lost a rank cannot be trusted to agree on anything again.
  int64_t timeout_ms = 300'000;
  CollectiveDelay injected_delay;
  // Where the ranks' buffers live and what moves their bytes (compute.h): computes[r] is rank r's
  // (on a device, its own stream), used for the share of each collective that rank r moves. Empty:
  // host memory, cpu_compute() for every rank. Otherwise one per rank, all on one device (a rank
  // reads its peers' buffers directly), each outliving the group. On a device a rank's compute is
  // synchronized before its buffers are read, so the work it enqueued before issuing a collective
  // is in them; and after its share is moved, so no peer reuses a buffer still being read. Work
  // on another stream that fills a buffer must be complete before the collective is issued.
  std::vector<Compute*> computes;
  // Optional, with computes: comm_computes[r] works on the same device as computes[r] but on a
  // stream of its own, and moves rank r's share of each collective. A collective then waits (on
  // its progress thread) only for the work computes[r] had enqueued when it was issued (an event
  // recorded then), never for what the rank enqueues after it, and its share runs beside that
  // later work, synchronizing only comm_computes[r]: on one GPU a bucket's reduction overlaps the
  // rest of the backward. Empty: the share runs on computes[r], synchronized around it.
  std::vector<Compute*> comm_computes;
};

class LocalGroupState;

// A group of `size` in-process ranks. communicator(r) is meant to be used by rank r's thread.
class LocalGroup {
 public:
  explicit LocalGroup(int size, const LocalOptions& options = {});
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return static_cast<int>(communicators_.size()); }
  Communicator& communicator(int rank);
  // Fails every pending and future collective of the group with `reason` (e.g. a rank crashed).
  void abort(const std::string& reason);

 private:
  std::shared_ptr<LocalGroupState> state_;
  std::vector<std::unique_ptr<Communicator>> communicators_;
};

// Runs rank_fn(communicator) on `size` threads, one per rank, and joins them. If any rank throws,
// the group is aborted (so peers blocked in a collective fail instead of waiting out the timeout)
// and the first rank's exception is rethrown here.
void run_local(int size, const std::function<void(Communicator&)>& rank_fn,
               const LocalOptions& options = {});

// ----------------------------------------------------------------------------------------------
// The MPI backend: one process per rank
// ----------------------------------------------------------------------------------------------

// Initializes MPI (MPI_THREAD_MULTIPLE: each communicator calls MPI from its progress thread) on
// construction and finalizes it on destruction; destroy every MPI communicator first. At most one
// per process, on the main thread.
class MpiRuntime {
 public:
  MpiRuntime(int* argc, char*** argv);
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  static int world_rank();
  static int world_size();
  // Ends the whole job after a failure on this rank: prints message on stderr, then
  // MPI_Abort(MPI_COMM_WORLD, exit_code); if that cannot reach the launcher within kMpiAbortGrace,
  // this rank ends alone (exit status 3). For a command's top level: a rank that failed alone and
  // returned would wait in MPI_Finalize for peers that wait in a collective for it, until their
  // watchdog fired (timeout_ms, 5 minutes by default), and its message would not be printed.
  [[noreturn]] static void abort_job(const std::string& message, int exit_code);
};

struct MpiOptions {
  // Exchanges each call's (operation, dtype, count, op, root) before running it, so a mismatch is
  // an Error instead of undefined behaviour inside MPI. Costs one small message to and from each
  // peer per collective. The exchange is also how a rank learns which peers reached a collective:
  // with it off, a stall report can only name every peer.
  bool check_consistency = true;
  // The watchdog: when a collective makes no progress for this long (no peer arrives, no transfer
  // completes), the rank prints the collective, its sequence number and the ranks it waits on
  // (stderr) and ends the job with MPI_Abort (exit status 3): MPI cannot cancel a stalled
  // collective, and a stopped rank would otherwise hang every other rank forever.
  int64_t timeout_ms = 300'000;
  // Charged for staging buffers (bf16 reductions run in f32). Null: a tracker private to the
  // communicator.
  MemoryTracker* memory_tracker = nullptr;
  CollectiveDelay injected_delay;
  // Where this rank's buffers live. Null, or a compute on the host: host memory, which MPI moves
  // itself (the communicator's compute() is then cpu_compute()). A device's compute (one GPU
  // shared by several processes, where NCCL refuses two ranks per device): every collective is
  // staged through page-locked host memory: its input's copy there enqueued on the compute's
  // stream when it is issued, MPI run on it, the output's copy back enqueued on that stream; the
  // staging (a block per collective in flight, reused) charged to memory_tracker as comm at the
  // host's place, besides the f32 staging below. Must outlive the communicator.
  Compute* compute = nullptr;
};

// The f32 staging the mpi backend holds for one reduction, in bytes (it keeps the largest so far,
// charged as comm): a bf16 all-reduce of count elements widens them to f32 (4 x count); a bf16
// reduce-scatter of count elements per rank widens the whole input and keeps the output block
// (4 x count x (size + 1)). An f32 sum of 1 MiB or more (an all-reduce, an in-place reduce-scatter:
// the gradient syncs) runs on a ring through two chunks of at most 4 MiB each (src/comm/ring.h),
// never a temporary as large as the message as MPI's own collectives allocate. Anything else
// (smaller or other dtypes' reductions, gathers) needs none: 0.
int64_t mpi_staging_bytes(bool reduce_scatter, DType dtype, int64_t count, int size);

// A communicator over all processes of MPI_COMM_WORLD (duplicated). Needs a live MpiRuntime.
std::unique_ptr<Communicator> make_mpi_communicator(const MpiOptions& options = {});

}  // namespace mxddp
