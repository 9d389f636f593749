// inspect_checkpoint and its JSON form (see checkpoint.h): the checks of manifest.h, the same a
// load runs, on every file instead of the ones a rank needs, with the problems collected rather
// than thrown.
#include <algorithm>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>

#include "manifest.h"

namespace mxddp {

namespace {

// CheckpointInfo::param_dtype: each dtype with its param count, in order of first appearance.
std::string param_dtype_summary(const std::vector<CheckpointParamInfo>& params, const std::string& model_dtype,
                                bool fp8_param_gather) {
  std::vector<std::pair<std::string, int>> counts;
  for (const CheckpointParamInfo& p : params) {
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& c) { return c.first == p.dtype; });
    if (it == counts.end()) counts.emplace_back(p.dtype, 1);
    else ++it->second;
  }
  if (counts.size() <= 1 && (counts.empty() || counts[0].first == model_dtype)) {
    if (!fp8_param_gather) return model_dtype;
    // Saved with fp8_param_gather before the manifest marked which params were MXFP8.
    return fmt::format("{}, MXFP8 for the params the run quantized (this save does not list them)", model_dtype);
  }
  // The params that are not the model dtype first: they are what the line is for.
  std::stable_partition(counts.begin(), counts.end(), [&](const auto& c) { return c.first != model_dtype; });
  std::vector<std::string> parts;
  for (const auto& [dtype, n] : counts) parts.push_back(fmt::format("{} ({} param{})", dtype, n, n == 1 ? "" : "s"));
  return fmt::format("{}, saved as {}", fmt::join(parts, " and "), model_dtype);
}

}  // namespace

CheckpointInfo ckpt::manifest_info(const std::string& dir, const Manifest& m) {
  CheckpointInfo info;
  info.dir = dir;
  info.step = m.step;
  info.saved_dp = m.dp;
  info.optimizer = m.optimizer;
  info.state_names = m.state_names;
  info.model_dtype = std::string(dtype_name(m.model_dtype));
  info.model_config = m.model_config;
  info.metadata = m.metadata;
  for (const ManifestParam& p : m.params)
    info.params.push_back({p.name, p.shape, static_cast<int>(p.slices.size()), p.shared_embedding,
                           p.mxfp8_elem.empty() ? info.model_dtype : "mxfp8_" + p.mxfp8_elem});
  info.param_dtype = param_dtype_summary(info.params, info.model_dtype, m.fp8_param_gather);
  info.problems = coverage_problems(m);
  for (std::string& problem : unlisted_rank_file_problems(dir, m)) info.problems.push_back(std::move(problem));
  return info;
}

CheckpointInfo inspect_checkpoint(const std::string& requested_dir) {
  const std::string dir = ckpt::checkpoint_to_read(requested_dir);
  const ckpt::Manifest m = ckpt::read_manifest(dir);  // throws: nothing in it can be trusted
  CheckpointInfo info = ckpt::manifest_info(dir, m);
  for (const ckpt::ManifestFile& f : m.files) {
    std::vector<std::string> problems;
    ckpt::check_rank_file(info.dir, m, f, problems);
    info.files.push_back({f.name, f.size_bytes, f.crc32, problems.empty() ? "ok" : fmt::format("{}", fmt::join(problems, "; "))});
    info.problems.insert(info.problems.end(), problems.begin(), problems.end());
  }
  return info;
}

std::string checkpoint_info_json(const CheckpointInfo& info) {
  using nlohmann::json;
  json j = {{"dir", info.dir},
            {"ok", info.ok()},
            {"step", info.step},
            {"saved_dp", info.saved_dp},
            {"optimizer", info.optimizer},
            {"state_names", info.state_names},
            {"model_dtype", info.model_dtype},
            {"param_dtype", info.param_dtype},
            {"model_config", ckpt::config_fields_json(info.model_config)},
            {"metadata", info.metadata},
            {"params", json::array()},
            {"files", json::array()},
            {"problems", info.problems}};
  for (const CheckpointParamInfo& p : info.params) {
    json shape = json::array();
    for (int d = 0; d < p.shape.ndim(); ++d) shape.push_back(p.shape[d]);
    j["params"].push_back({{"name", p.name}, {"shape", shape}, {"slices", p.slices}, {"shared_embedding", p.shared_embedding},
                           {"dtype", p.dtype}});
  }
  for (const CheckpointFileInfo& f : info.files)
    j["files"].push_back({{"name", f.name}, {"bytes", f.size_bytes}, {"crc32", f.crc32}, {"status", f.status}});
  return j.dump(1);
}

}  // namespace mxddp
