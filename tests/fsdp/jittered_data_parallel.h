// JitteredDataParallel: a DataParallel decorator for race-flushing parity tests. It forwards every
// call to the DDP or FSDP object it owns (ForwardingDataParallel) and sleeps a random, per-rank
// time after each module's forward, so compute and the collectives it overlaps with interleave differently on every rank
// and every run. With an FSDP inside it also keeps the collective log when training ends.
#pragma once

#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <mxddp/fsdp.h>

#include "fsdp/fsdp_engine.h"

#include "forwarding_data_parallel.h"

namespace mxddp::testing {

class JitteredDataParallel final : public ForwardingDataParallel {
 public:
  // log_out /*out*/: the inner FSDP's collective log, written when this object is destroyed.
  JitteredDataParallel(std::unique_ptr<DataParallel> inner, int64_t max_sleep_us, uint64_t seed,
                       std::vector<FsdpCollective>* log_out)
      : ForwardingDataParallel(std::move(inner)), max_sleep_us_(max_sleep_us), log_out_(log_out) {
    std::seed_seq seq{seed, static_cast<uint64_t>(communicator().rank())};
    rng_.seed(seq);
  }
  ~JitteredDataParallel() override {
    if (auto* fsdp = dynamic_cast<const FullyShardedDataParallel*>(&inner()); fsdp && log_out_)
      *log_out_ = fsdp_engine(*fsdp).collective_log();
  }

  void after_forward(const std::vector<int>& m) override {
    ForwardingDataParallel::after_forward(m);
    const int64_t us = std::uniform_int_distribution<int64_t>(0, max_sleep_us_)(rng_);
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }

 private:
  const int64_t max_sleep_us_;
  std::vector<FsdpCollective>* log_out_;
  std::mt19937_64 rng_;
};

}  // namespace mxddp::testing
