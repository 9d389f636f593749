// `mxddp train --metrics-file FILE`: one JSON object per line, written as training goes, so a
// crash or a kill loses at most the line being written (the end report is written only at the
// end). Rank 0 writes it. Lines, by "type":
//   iteration   iteration, consumed_samples, lm_loss, learning_rate, grad_norm, skipped, step_ms,
//               forward_ms, backward_ms, exposed_comm_ms, optimizer_ms, tokens_per_second
//   validation  iteration, lm_loss
//   memory      rank, steady_state and overall: {category: peak bytes} (at the end, one per rank)
// Each line is flushed to the kernel when written (it survives the process dying); the file is
// also fsynced at each validation and at the end. A fresh run truncates the file, a resumed one
// (--load) appends to it. scripts/plot_metrics.py draws it.
#pragma once

#include <cstdio>
#include <string>

#include <mxddp/train.h>

namespace mxddp::app {

class MetricsLog {
 public:
  // Opens path (checked as an output file: absent or a regular file, its parent a directory);
  // throws Error naming --metrics-file and the path.
  MetricsLog(const std::string& path, bool append);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void iteration(const StepRecord& r, int64_t tokens_per_iteration);
  void validation(const EvalRecord& e);
  void memory(const std::vector<RankMemory>& by_rank);

 private:
  void write_line(const std::string& line, bool sync);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace mxddp::app
