// A Communicator whose collectives run on a torch.distributed process group (gloo, on the CPU), for
// ranks that torchrun, srun or the user's own torch.distributed.init_process_group started.
//
// The engine calls a small Python object (mxddp.torch.process_group.GroupRunner) from the
// communicator's progress thread: it takes the GIL only to hand the buffers to torch (DLPack views,
// no copies) and issue the op, and torch releases the GIL while gloo moves the data, so the
// training loop's Python (the backward) goes on meanwhile. Every blocking call on the main thread
// that can wait for this communicator must therefore run without the GIL (the bindings release it).
#pragma once

#include <memory>

#include <nanobind/nanobind.h>

#include <mxddp/comm.h>
#include <mxddp/memory.h>

namespace mxddp::python {

// runner: a GroupRunner over the group (methods all_reduce, reduce_scatter, all_gather, broadcast,
// barrier); rank, size: this process's rank in that group and the group's size. tracker: charged
// for the f32 staging of bf16 reductions (as the mpi backend's; null: a tracker of its own).
// delay: comm.h's latency injection (off by default). device: null, or a device's compute (ranks
// that share a GPU): the communicator's buffers are then that device's memory, and each collective
// is staged through page-locked host memory (src/comm/staged_backend.h), as MpiOptions::compute
// does for the mpi engine. Call with the GIL held.
std::unique_ptr<Communicator> make_torch_communicator(nanobind::object runner, int rank, int size,
                                                      MemoryTracker* tracker, const CollectiveDelay& delay = {},
                                                      Compute* device = nullptr);

}  // namespace mxddp::python
