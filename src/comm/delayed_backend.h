// DelayedBackend: a CommBackend decorator that sleeps before the collectives CollectiveDelay
// selects, then runs them on the engine it wraps. It sits under the Communicator, so the sleep
// happens on the progress thread: the caller's asynchronous collectives start late, exactly as a
// slow peer or a slow link would make them, while its compute goes on.
#pragma once

#include <memory>
#include <random>

#include "backend.h"

namespace mxddp {

// Checks the fields (0 <= min_us <= max_us <= one minute); the Error names the bad value.
void validate_collective_delay(const CollectiveDelay& delay);

// inner unchanged when delay.max_us == 0; otherwise inner wrapped in a DelayedBackend.
std::unique_ptr<CommBackend> with_injected_delay(std::unique_ptr<CommBackend> inner, const CollectiveDelay& delay);

class DelayedBackend final : public CommBackend {
 public:
  // delay: already validated (with_injected_delay is the entry point).
  DelayedBackend(std::unique_ptr<CommBackend> inner, const CollectiveDelay& delay);
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return inner_->name(); }
  Compute& compute() const override { return inner_->compute(); }
  void issue(const CollectiveCall& call) noexcept override { inner_->issue(call); }
  void run(const CollectiveCall& call) override;
  void set_memory_tracker(MemoryTracker* tracker) override { inner_->set_memory_tracker(tracker); }

 private:
  bool selected(CollectiveKind kind) const;

  std::unique_ptr<CommBackend> inner_;
  const CollectiveDelay delay_;
  std::mt19937_64 rng_;  // touched only by the progress thread
};

}  // namespace mxddp
