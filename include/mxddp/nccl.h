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
// Ordering (stream order, never a host wait): the communicator's buffers are on the rank's device,
// and its compute() is a CUDA compute on the rank's compute stream (NcclOptions::stream). Issuing a
// collective enqueues it at once, on the issuing thread, on an NCCL stream of the communicator's,
// after an event recorded on the compute stream: the work enqueued before the collective was
// issued is in its buffers, and the work enqueued after it overlaps it on the device.
// Work::wait() makes the compute stream wait for the collective and returns (a blocking call is
// the same): work enqueued on the compute stream after it sees the results, and so does the host
// through the compute's copies, which wait for that stream. Work on another stream must wait for
// the compute stream first. is_completed() asks the device. A watchdog thread retires the
// collectives as they complete; one still running after timeout_ms, or an asynchronous NCCL
// error, aborts the communicator, and every later wait() and call rethrows that failure (the
// buffers of the collectives then in flight are undefined: destroy the communicator).
//
// Threads: joining, issuing and wait() make the rank's device the calling thread's current device
// and leave it so (as torch.cuda.set_device does); the rank's compute launches there. HSDP over a
// stream-ordered communicator is refused (its two communicators would not be ordered together).
//
// What NCCL computes differs from the local backend's rank-order arithmetic: NCCL sums in its own
// order (rings, trees), bf16 in bf16; a prescale is its PreMulSum; max may not propagate NaN. The
// results agree with the CPU's within rounding, not bit for bit (docs/cuda.md). No staging: the
// communicator's set_memory_tracker has nothing to charge.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>

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
  // collective waits for it); it must outlive the communicator and its Works. nullptr names the
  // legacy default stream (torch's default stream). None: a stream the communicator creates and
  // owns (kept alive by the Works that order it).
  std::optional<CudaStream> stream;
  // Checks before each collective that every rank issued the same call, as the mpi backend does: a
  // mismatch is an Error on every rank instead of a hang or corrupt data inside NCCL. The headers go
  // over a second NCCL communicator (split from the first, on a stream of its own), and the issuing
  // thread waits for that small gather only, that is for its peers to reach the collective.
  bool check_consistency = true;
  // The watchdog: joining the group, or a collective, that has not completed after this long
  // aborts the NCCL communicator (ncclCommAbort) and fails, naming what it waited for; every later
  // collective then fails at once.
  int64_t timeout_ms = 300'000;
};

// Joins rank `rank` of `size` to the group of `id` (ncclCommInitRankConfig, nonblocking, under the
// watchdog; NCCL 2.18 or later, for the header group's ncclCommSplit). Throws an Error naming the value for a rank or size out of range or a device that does
// not exist, and CUDA's or NCCL's reason when the group cannot be made (no usable device, a peer
// that never joined).
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int rank, int size,
                                                     const NcclOptions& options = {});

}  // namespace mxddp
