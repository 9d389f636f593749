// mxddp nccl: the NCCL engine under Communicator (comm.h), for ranks that are processes, each on a
// GPU of its own. Built with the CUDA layer when CMake finds NCCL's header and library (MXDDP_NCCL,
// the target mxddp_nccl; scripts/setup.sh points it at the nvidia-nccl wheel torch installs); this
// header needs no CUDA or NCCL header to be included.
//
// How a rank joins: rank 0 makes a unique id (nccl_unique_id), every rank receives it out of band
// (nccl_unique_id_over_mpi under mpirun; a launcher's store; a file), and each calls
// make_nccl_communicator(id, rank, size) with the device it owns. NCCL refuses two ranks of one
// communicator on the same GPU.
//
// Ordering: the communicator's buffers are on the rank's device, and its compute() is a CUDA
// compute on the rank's compute stream (NcclOptions::stream). The progress thread runs each
// collective on a communication stream of its own, after an event recorded on the compute stream
// when the collective is taken up, so the work enqueued before a collective was issued is in its
// buffers, and the work enqueued after it overlaps it on the device. The progress thread then waits
// for the communication stream (polling, under the watchdog) before the Work completes: once
// wait() returns, the results are in the buffers for any stream. Only the progress thread ever
// waits on the host.
//
// What NCCL computes differs from the local backend's rank-order arithmetic: NCCL sums in its own
// order (rings, trees), bf16 in bf16; a prescale is its PreMulSum; max may not propagate NaN. The
// results agree with the CPU's within rounding, not bit for bit (docs/cuda.md).
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include <mxddp/comm.h>
#include <mxddp/cuda.h>

namespace mxddp {

// NCCL's ncclUniqueId (NCCL_UNIQUE_ID_BYTES), as plain bytes to send however the ranks can.
struct NcclUniqueId {
  std::array<char, 128> bytes{};
  bool operator==(const NcclUniqueId&) const = default;
};

// The NCCL library's version code as it reports it at run time (e.g. 23007 for 2.30.7).
int nccl_version();

// A fresh id (ncclGetUniqueId): made by one rank, given to all. Needs no GPU; it opens the
// bootstrap's listening socket on this host, which the other ranks then connect to.
NcclUniqueId nccl_unique_id();

// Rank 0 of MPI_COMM_WORLD makes an id and broadcasts it to every rank. Needs a live MpiRuntime
// (comm.h); call it on every rank, from the main thread.
NcclUniqueId nccl_unique_id_over_mpi();

struct NcclOptions {
  // The CUDA ordinal this rank's buffers and NCCL communicator live on; -1: the calling thread's
  // current device.
  int device = -1;
  // The stream the rank's compute work runs on (Communicator::compute() enqueues there, and each
  // collective waits for it): null: a stream the communicator creates and owns.
  CudaStream stream = nullptr;
  // Checks before each collective that every rank issued the same call (an all-gather of each
  // rank's call header, and a wait for it), as the mpi backend does: a mismatch is an Error on
  // every rank instead of a hang or corrupt data inside NCCL.
  bool check_consistency = true;
  // The watchdog: joining the group, or a collective, that has not completed after this long
  // aborts the NCCL communicator (ncclCommAbort) and fails, naming what it waited for; every later
  // collective then fails at once.
  int64_t timeout_ms = 300'000;
  CollectiveDelay injected_delay;
};

// Joins rank `rank` of `size` to the group of `id` (ncclCommInitRankConfig, nonblocking, under the
// watchdog). Throws an Error naming the value for a rank or size out of range or a device that does
// not exist, and CUDA's or NCCL's reason when the group cannot be made (no usable device, a peer
// that never joined).
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     const NcclOptions& options = {});

}  // namespace mxddp
