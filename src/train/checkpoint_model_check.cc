// gpt_checkpoint_problems (see train.h): what `mxddp ckpt inspect` adds to the checkpoint layer's
// own checks. That layer knows no model; a load compares the manifest's param list with the
// model it loads into. inspect has no model, but the manifest records the GPT config it was saved
// from, so the param list that config implies stands in for it.
#include <fmt/format.h>

#include <mxddp/train.h>

namespace mxddp {

std::vector<std::string> gpt_checkpoint_problems(const CheckpointInfo& info) {
  if (info.model_config.empty()) return {};  // saved without a model config: nothing to compare
  GptConfig config;
  try {
    config = GptConfig::from_fields(info.model_config);
  } catch (const Error& e) {
    return {fmt::format("the manifest's model_config is not a GPT config: {}", e.message())};
  }
  // Counted before the list is built: a crafted num_layers must not allocate billions of specs.
  const int64_t expected_count = GptParamIds(config).count();
  if (static_cast<int64_t>(info.params.size()) != expected_count)
    return {fmt::format("the manifest lists {} params; its model_config ({} layers) has {}", info.params.size(),
                        config.num_layers, expected_count)};
  std::vector<std::string> problems;
  const std::vector<ParamSpec> specs = gpt_param_specs(config);
  for (size_t p = 0; p < specs.size(); ++p) {
    const CheckpointParamInfo& got = info.params[p];
    const ParamSpec& want = specs[p];
    if (got.name != want.name || got.shape != want.shape || got.shared_embedding != want.shared_embedding)
      problems.push_back(fmt::format("param {} is '{}' {}{}; the manifest's model_config implies '{}' {}{}", p,
                                     got.name, got.shape.to_string(), got.shared_embedding ? " (shared embedding)" : "",
                                     want.name, want.shape.to_string(), want.shared_embedding ? " (shared embedding)" : ""));
  }
  return problems;
}

}  // namespace mxddp
