// The process's mxddp runtime for Python: the world communicator (over MPI, or over the default
// torch.distributed process group), the communicators of the user's other process groups, and the
// memory tracker.
//
// One per process, created by init_mpi() or init_torch() (mxddp.torch.init) and torn down by
// finalize() (at interpreter exit, by mxddp.torch.shutdown): MPI can be initialized only once, and
// every object that uses a communicator must be gone before the communicator (and MPI_Finalize),
// so the runtime counts them. Under torch.distributed the communicators call Python from their
// progress threads, so they must be drained while the interpreter still runs: finalize() before
// it ends, and every wait on them from a thread that holds the GIL must release it first.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include <nanobind/nanobind.h>

#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/memory.h>

namespace mxddp::python {

// Whether Python can still be called (the interpreter is up and not finalizing): a C++ object
// that outlives it must leak its Python references instead of releasing them.
bool python_is_usable();

class Runtime {
 public:
  // Initializes MPI (MPI_THREAD_MULTIPLE) and the world communicator; returns (rank, world).
  // Called again while alive: returns the same pair (timeout_ms and delay must then be the same).
  // delay: the latency injection of the parity tests (comm.h's CollectiveDelay), off by default.
  static std::pair<int, int> init_mpi(int64_t timeout_ms, const CollectiveDelay& delay = {});
  // The world communicator over torch.distributed's default group (runner: a
  // mxddp.torch.process_group.GroupRunner over it; rank and size in it). Called again while alive:
  // returns the same pair. Needs the GIL.
  static std::pair<int, int> init_torch(nanobind::object runner, int rank, int size, int64_t timeout_ms,
                                        const CollectiveDelay& delay = {});
  static bool initialized();
  // The live runtime; throws Error telling to call mxddp.torch.init() first.
  static Runtime& get();
  // Destroys the communicators (each drains its collectives first) and finalizes MPI if it was
  // started. Throws if objects built on them are still open. Call without the GIL (the torch
  // communicators take it to release their Python objects).
  static void finalize();

  // "mpi" or "torch": what the world communicator runs on.
  const char* backend() const { return mpi_ ? "mpi" : "torch"; }
  bool uses_mpi() const { return mpi_ != nullptr; }

  Communicator& comm() { return *comm_; }
  // A communicator over another torch process group (see add_torch_group); kWorld: comm().
  static constexpr int kWorld = -1;
  Communicator& comm(int id);
  // Adds a communicator over a torch process group (runner: a GroupRunner over a private gloo
  // duplicate of it; rank and size in it) and returns its id. It lives until finalize(). Needs the GIL.
  int add_torch_group(nanobind::object runner, int rank, int size);
  // Adds a communicator over the ranks of communicator host_id (kWorld, or an add_torch_group id)
  // whose buffers live on CUDA device `device` and whose work is ordered on `stream` (the rank's
  // compute stream: torch's current stream; 0 is the legacy default stream), and returns its id.
  // Collective over those ranks. engine:
  //   "nccl":   an NCCL communicator (nccl.h), each rank on a GPU of its own; host_id's rank 0 makes
  //             the unique id and broadcasts it over host_id;
  //   "staged": the host engine, each collective staged through page-locked host memory (ranks
  //             that share a GPU): under MPI a second MPI communicator (host_id must be kWorld),
  //             under torch.distributed a torch one over runner (a GroupRunner over a private gloo
  //             group of the same ranks: the host communicator's own runner is busy with its work).
  // It lives until finalize(). Needs the GIL; releases it while the ranks join.
  int add_device_group(int host_id, int device, uintptr_t stream, const std::string& engine, nanobind::object runner);

  MemoryTracker& tracker() { return tracker_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  const CollectiveDelay& collective_delay() const { return delay_; }  // what the communicators inject

  // Objects that hold a communicator (DDPs, optimizers) register while open.
  void add_user() { ++users_; }
  // The last one closed also frees the backends' staging (grown to the largest gradient reduction
  // so far, charged as comm): with nothing open, memory_usage() reads 0 everywhere, and a model
  // built next holds what its own plan says (mxddp.torch.plan), not an earlier model's staging.
  // Waits for the communicators' queues, without the GIL (a torch communicator needs it).
  void remove_user();

  Runtime(std::unique_ptr<MpiRuntime> mpi, int64_t timeout_ms, const CollectiveDelay& delay);
  ~Runtime();

 private:
  std::unique_ptr<MpiRuntime> mpi_;  // null under torch.distributed
  MemoryTracker tracker_;
  std::unique_ptr<Communicator> comm_;
  std::map<int, std::unique_ptr<Compute>> device_computes_;  // the staged device groups' computes (outlive groups_)
  std::map<int, std::unique_ptr<Communicator>> groups_;
  int64_t timeout_ms_;
  CollectiveDelay delay_;
  int users_ = 0;
};

}  // namespace mxddp::python
