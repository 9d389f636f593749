// `mxddp train --metrics-file`: see metrics_log.h.
#include "metrics_log.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

#include <mxddp/output_file.h>

#include "train_report.h"

namespace mxddp::app {

MetricsLog::MetricsLog(const std::string& path, bool append) : path_(path) {
  check_output_file_path(path, "--metrics-file");
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  MXDDP_CHECK(file_ != nullptr, "--metrics-file '{}' cannot be opened for writing: {}", path, std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_ == nullptr) return;
  ::fsync(::fileno(file_));
  std::fclose(file_);
}

void MetricsLog::write_line(const std::string& line, bool sync) {
  const bool ok = std::fputs(line.c_str(), file_) >= 0 && std::fputc('\n', file_) != EOF && std::fflush(file_) == 0 &&
                  (!sync || ::fsync(::fileno(file_)) == 0);
  MXDDP_CHECK(ok, "--metrics-file '{}': writing failed: {}", path_, std::strerror(errno));
}

void MetricsLog::iteration(const StepRecord& r, int64_t tokens_per_iteration) {
  const nlohmann::json j = {{"type", "iteration"},
                            {"iteration", r.iteration},
                            {"consumed_samples", r.consumed_samples},
                            {"lm_loss", r.loss},
                            {"learning_rate", r.lr},
                            {"grad_norm", r.grad_norm},
                            {"skipped", r.skipped},
                            {"step_ms", r.step_ms},
                            {"forward_ms", r.forward_ms},
                            {"backward_ms", r.backward_ms},
                            {"exposed_comm_ms", r.comm_ms},
                            {"optimizer_ms", r.optimizer_ms},
                            {"tokens_per_second", r.step_ms > 0 ? static_cast<double>(tokens_per_iteration) / (r.step_ms / 1e3) : 0.0}};
  write_line(j.dump(), false);
}

void MetricsLog::validation(const EvalRecord& e) {
  write_line(nlohmann::json{{"type", "validation"}, {"iteration", e.iteration}, {"lm_loss", e.loss}}.dump(), true);
}

void MetricsLog::memory(const std::vector<RankMemory>& by_rank) {
  for (size_t rank = 0; rank < by_rank.size(); ++rank)
    write_line(nlohmann::json{{"type", "memory"},
                              {"rank", rank},
                              {"steady_state", memory_usage_json(by_rank[rank].steady)},
                              {"overall", memory_usage_json(by_rank[rank].overall)}}
                   .dump(),
               rank + 1 == by_rank.size());
}

}  // namespace mxddp::app
