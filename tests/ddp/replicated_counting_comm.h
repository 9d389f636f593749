// CountingCommunicator: a Communicator whose engine counts the collectives it runs, by kind, and
// runs each one on another Communicator (a local rank's). Tests of the replicated optimizer use it
// to assert what a step issues (all-reduces only, no param all-gather) rather than infer it from
// values, which a gather of identical replicas would not change.
#pragma once

#include <array>
#include <atomic>
#include <memory>

#include <mxddp/comm.h>

#include "comm/backend.h"

namespace mxddp::testing {

class CountingBackend final : public CommBackend {
 public:
  using Counts = std::array<std::atomic<int>, 5>;  // by CollectiveKind
  CountingBackend(Communicator& inner, Counts& counts) : inner_(inner), counts_(counts) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view name() const override { return inner_.backend_name(); }
  Compute& compute() const override { return inner_.compute(); }

  // Runs on this communicator's progress thread; the inner one runs it on its own and we wait.
  void run(const CollectiveCall& c) override {
    ++counts_[static_cast<size_t>(c.kind)];
    const auto view = [&c](const void* p, int64_t n) {
      return TensorView{const_cast<void*>(p), c.dtype, Shape{n}, Device::cpu()};
    };
    const int n = inner_.size();
    switch (c.kind) {
      case CollectiveKind::kAllReduce:
        inner_.all_reduce(view(c.recv, c.count), {.op = c.op, .prescale = c.prescale});
        return;
      case CollectiveKind::kReduceScatter:
        inner_.reduce_scatter(view(c.send, c.count * n), view(c.recv, c.count), {.op = c.op, .prescale = c.prescale});
        return;
      case CollectiveKind::kAllGather:
        inner_.all_gather(view(c.send, c.count), view(c.recv, c.count * n));
        return;
      case CollectiveKind::kBroadcast:
        inner_.broadcast(view(c.recv, c.count), {.root = c.root});
        return;
      case CollectiveKind::kBarrier:
        inner_.barrier();
        return;
    }
  }

 private:
  Communicator& inner_;
  Counts& counts_;
};

// A rank's counting communicator over `inner`; counts(kind) is what it has run so far.
class CountingCommunicator {
 public:
  explicit CountingCommunicator(Communicator& inner)
      : comm_(std::make_unique<CountingBackend>(inner, counts_)) {}
  Communicator& comm() { return comm_; }
  // Counted when the engine starts it: read after waiting for what was issued.
  int count(CollectiveKind kind) const { return counts_[static_cast<size_t>(kind)].load(); }

 private:
  CountingBackend::Counts counts_{};
  Communicator comm_;
};

}  // namespace mxddp::testing
