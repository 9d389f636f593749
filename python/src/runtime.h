// The process's mxddp runtime for Python: MPI, the world communicator and the memory tracker.
//
// One per process, created by init_mpi() (mxddp.torch.init) and torn down by finalize() (at
// interpreter exit): MPI can be initialized only once, and every object that uses the
// communicator must be gone before MPI_Finalize, so the runtime counts them.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include <mxddp/comm.h>
#include <mxddp/memory.h>

namespace mxddp::python {

class Runtime {
 public:
  // Initializes MPI (MPI_THREAD_MULTIPLE) and the world communicator; returns (rank, world).
  // Called again while alive: returns the same pair (timeout_ms and delay must then be the same).
  // delay: the latency injection of the parity tests (comm.h's CollectiveDelay), off by default.
  static std::pair<int, int> init_mpi(int64_t timeout_ms, const CollectiveDelay& delay = {});
  static bool initialized();
  // The live runtime; throws Error telling to call mxddp.torch.init() first.
  static Runtime& get();
  // Destroys the communicator and finalizes MPI. Throws if objects built on it are still open.
  static void finalize();

  Communicator& comm() { return *comm_; }
  MemoryTracker& tracker() { return tracker_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  const CollectiveDelay& collective_delay() const { return delay_; }  // what the communicator injects

  // Objects that hold the communicator (DDPs, optimizers) register while open.
  void add_user() { ++users_; }
  // The last one closed also frees the mpi backend's staging (grown to the largest gradient
  // reduction so far, charged as comm): with nothing open, memory_usage() reads 0 everywhere, and a
  // model built next holds what its own plan says (mxddp.torch.plan), not an earlier model's staging.
  void remove_user();

  Runtime(std::unique_ptr<MpiRuntime> mpi, int64_t timeout_ms, const CollectiveDelay& delay);
  ~Runtime();

 private:
  std::unique_ptr<MpiRuntime> mpi_;
  MemoryTracker tracker_;
  std::unique_ptr<Communicator> comm_;
  int64_t timeout_ms_;
  CollectiveDelay delay_;
  int users_ = 0;
};

}  // namespace mxddp::python
