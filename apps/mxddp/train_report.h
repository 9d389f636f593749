// The JSON report of `mxddp train --report FILE`: the config, per-step loss and timings (rank 0's),
// validation losses, throughput and every rank's memory by category (peak and steady state).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include <mxddp/train.h>

namespace mxddp::app {

// {category: {live_bytes, peak_bytes}, ..., total: {...}}: one rank's memory, as the report and
// the metrics file (metrics_log.h) write it.
nlohmann::json memory_usage_json(const MemoryUsage& usage);

// Writes atomically (a temporary file renamed into place); throws Error if it cannot.
void write_train_report(const std::string& path, const TrainConfig& config, const TrainResult& result, int dp,
                        const std::string& backend);

}  // namespace mxddp::app
