// DelayedBackend: latency injection under the Communicator (see delayed_backend.h).
#include "delayed_backend.h"

#include <chrono>
#include <thread>

namespace mxddp {

namespace {
constexpr int64_t kMaxDelayUs = 60'000'000;  // a minute: beyond it a "delay" is a hang
}

void validate_collective_delay(const CollectiveDelay& delay) {
  MXDDP_CHECK(delay.min_us >= 0 && delay.min_us <= delay.max_us && delay.max_us <= kMaxDelayUs,
              "injected collective delay [{}, {}] us is not a range within [0, {}] us (min_us <= max_us)",
              delay.min_us, delay.max_us, kMaxDelayUs);
}

std::unique_ptr<CommBackend> with_injected_delay(std::unique_ptr<CommBackend> inner, const CollectiveDelay& delay) {
  validate_collective_delay(delay);
  if (delay.max_us == 0) return inner;
  return std::make_unique<DelayedBackend>(std::move(inner), delay);
}

DelayedBackend::DelayedBackend(std::unique_ptr<CommBackend> inner, const CollectiveDelay& delay)
    : inner_(std::move(inner)), delay_(delay) {
  // A distinct, reproducible stream per rank, so ranks draw different delays.
  std::seed_seq seq{delay.seed, static_cast<uint64_t>(inner_->rank()), uint64_t{0x6a09e667f3bcc909}};
  rng_.seed(seq);
}

bool DelayedBackend::selected(CollectiveKind kind) const {
  switch (kind) {
    case CollectiveKind::kAllReduce: return delay_.all_reduce;
    case CollectiveKind::kReduceScatter: return delay_.reduce_scatter;
    case CollectiveKind::kAllGather: return delay_.all_gather;
    case CollectiveKind::kBroadcast: return delay_.broadcast;
    case CollectiveKind::kBarrier: return false;
  }
  return false;
}

void DelayedBackend::run(const CollectiveCall& call) {
  if (selected(call.kind)) {
    const int64_t us = std::uniform_int_distribution<int64_t>(delay_.min_us, delay_.max_us)(rng_);
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
  inner_->run(call);
}

}  // namespace mxddp
