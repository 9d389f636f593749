// The JSON report of `mxddp train --report FILE`: the config, per-step loss and timings (rank 0's),
// validation losses, throughput and every rank's memory by category (peak and steady state).
#pragma once

#include <string>

#include <mxddp/train.h>

namespace mxddp::app {

// Writes atomically (a temporary file renamed into place); throws Error if it cannot.
void write_train_report(const std::string& path, const TrainConfig& config, const TrainResult& result, int dp,
                        const std::string& backend);

}  // namespace mxddp::app
