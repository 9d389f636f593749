// Small collectives on host values, whatever memory the communicator's collectives run on: the
// launch check's texts, the checkpoint layer's failure flags, save ids, file sizes and CRCs. On a
// device's they go through a few bytes of its compute, copied in and back, as the optimizer stages
// its norm. Internal to the layers (src/), not a public header.
#pragma once

#include <mxddp/comm.h>
#include <mxddp/compute.h>

namespace mxddp {

// A host view's bytes in the communicator's memory for one collective: the view itself on the
// host; on a device, a copy there (of the host bytes when copy_in), put back by copy_out().
class CommStaged {
 public:
  CommStaged(Communicator& comm, const TensorView& host, bool copy_in) : comm_(comm), host_(host) {
    if (comm.device().is_cpu()) return;
    block_ = comm.compute().allocate(host.nbytes(), MemoryCategory::kComm, tracker_);
    if (copy_in) comm.compute().copy_from_host(block_.data(), host.data, host.nbytes());
  }
  TensorView view() const { return comm_.device().is_cpu() ? host_ : block_.view(host_.dtype, host_.shape); }
  void copy_out() const {
    if (!comm_.device().is_cpu()) comm_.compute().copy_to_host(host_.data, block_.data(), host_.nbytes());
  }

 private:
  Communicator& comm_;
  TensorView host_;
  MemoryTracker tracker_;  // a few bytes for one collective, not the rank's
  ComputeBuffer block_;
};

// comm.all_reduce / broadcast / all_gather of host views (device Device::cpu()), waited for. Each
// waits once more after the copy back: on a stream-ordered communicator (nccl) the first wait only
// ordered the compute stream, and a failure its engine found while the copy waited for the device
// (an aborted, partly written result) must be rethrown, never read as the answer.
inline void all_reduce_host(Communicator& comm, const TensorView& buffer, const AllReduceOptions& options = {}) {
  const CommStaged staged(comm, buffer, /*copy_in=*/true);
  const Work work = comm.all_reduce(staged.view(), options);
  staged.copy_out();
  work.wait();
}

inline void broadcast_host(Communicator& comm, const TensorView& buffer, const BroadcastOptions& options = {}) {
  const CommStaged staged(comm, buffer, /*copy_in=*/true);
  const Work work = comm.broadcast(staged.view(), options);
  staged.copy_out();
  work.wait();
}

inline void all_gather_host(Communicator& comm, const TensorView& input, const TensorView& output) {
  const CommStaged in(comm, input, /*copy_in=*/true), out(comm, output, /*copy_in=*/false);
  const Work work = comm.all_gather(in.view(), out.view());
  out.copy_out();
  work.wait();
}

}  // namespace mxddp
