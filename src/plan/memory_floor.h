// The least memory a training run can need, computed from its config alone, so that a run that
// cannot fit is refused with the figure before anything is allocated (a --num-layers in the
// billions used to grow until the kernel killed it). A floor, not a plan: it counts what every
// mode must hold (the padding, buckets and transient gathers are left out), so it never refuses
// a run that fits; `mxddp train --report` measures the real figures.
#pragma once

#include <cstdint>
#include <string>

#include <mxddp/train.h>

namespace mxddp {

// Bytes, as doubles: a hostile config's figures exceed int64 and only their size matters here.
struct TrainMemoryFloor {
  double init_bytes = 0;       // the f32 initial values, alive while the buffers are built
  double params_bytes = 0;     // model params (bf16, f32 or MXFP8 payloads), this rank's share
  double grads_bytes = 0;      // this rank's share of the grad buffer
  double main_params_bytes = 0;
  double optimizer_state_bytes = 0;
  double activations_bytes = 0;  // one micro-batch: each layer's input and the logits, f32
  double data_bytes = 0;         // the corpus each rank holds
  // One rank's floor: the larger of the build phase (initial values beside the buffers) and the
  // steady state, plus the data.
  double rank_bytes() const;
  std::string describe() const;  // "initial values 1.2 GiB, params 640 MiB, ..."
};

// data_bytes: the corpus size (the built-in corpus, or the --data file's size).
TrainMemoryFloor train_memory_floor(const TrainConfig& config, int dp, double data_bytes);

// What this machine can still give: MemAvailable, capped by the cgroup's limit less its usage
// when one is set. Negative if neither can be read.
double available_memory_bytes();

// Throws Error when ranks_here ranks of this config need more than the machine has available,
// naming the figures and what to change. Does nothing when the available memory is unknown. The
// floor is checked first (it costs nothing, whatever the config), then the exact plan (plan.h):
// each rank's peak, or the build phase with the initial values, plus the data.
void check_train_fits_in_memory(const TrainConfig& config, int dp, int ranks_here, double data_bytes);

}  // namespace mxddp
