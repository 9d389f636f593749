// read_hf_gpt2_params (hf.h): a Hugging Face GPT-2 model.safetensors as mxddp's GPT params.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include <mxddp/hf.h>

#include "../checkpoint/file_io.h"
#include "hf_gpt2_names.h"
#include "hf_safetensors.h"

namespace mxddp {

namespace {

// The causal-mask buffers older GPT-2 files hold beside the params ("h.<l>.attn.bias" [1, 1, T, T],
// "h.<l>.attn.masked_bias"): constants of the architecture, not weights.
bool is_mask_buffer(std::string_view name) {
  return name.starts_with("h.") && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"));
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// Element `flat` of a row-major tensor of `shape` as its index, e.g. [0, 37].
std::string index_text(int64_t flat, const std::vector<int64_t>& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = shape[d] > 0 ? flat % shape[d] : 0;
    flat = shape[d] > 0 ? flat / shape[d] : 0;
  }
  return shape_text(index);
}

// Refuses a tensor holding NaN or +-Inf, named as the file names it (values in the file's layout).
// Loaded, such a weight makes iteration 1's loss NaN, which the trainer's check can only blame on
// the gradients.
void check_finite(const std::string& path, const std::string& name, const hf::StTensor& t,
                  const std::vector<float>& values, const std::string& ours) {
  int64_t nan = 0, inf = 0, first = -1;
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i])) [[likely]] continue;
    ++(std::isnan(values[i]) ? nan : inf);
    if (first < 0) first = static_cast<int64_t>(i);
  }
  MXDDP_CHECK(first < 0, "'{}': tensor '{}' ({} {}{}) holds {} non-finite value{} ({} NaN, {} +-Inf), the first at "
              "element {} {} = {}: a model to load must be finite", path, name, t.dtype, shape_text(t.shape), ours,
              nan + inf, nan + inf == 1 ? "" : "s", nan, inf, first, index_text(first, t.shape),
              values[static_cast<size_t>(std::max<int64_t>(first, 0))]);
}

}  // namespace

HfGpt2Params read_hf_gpt2_params(const std::string& dir, const GptConfig& model) {
  const HfGpt2Config hf_config = read_hf_gpt2_config(dir);
  const GptConfig& c = hf_config.model;
  MXDDP_CHECK(model.vocab_size == c.vocab_size && model.num_layers == c.num_layers &&
                  model.hidden_size == c.hidden_size && model.num_attention_heads == c.num_attention_heads &&
                  model.seq_length >= 1 && model.seq_length <= hf_config.n_positions,
              "--load-hf '{}' is a model of {} (n_positions {}); the run's model is {}: only --seq-length may differ, "
              "up to n_positions", dir, c.describe(), hf_config.n_positions, model.describe());
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    const bool sharded = fs::exists(fs::path(dir) / "model.safetensors.index.json", ec);
    const bool pickle = fs::exists(fs::path(dir) / "pytorch_model.bin", ec);
    MXDDP_FAIL("--load-hf '{}' has no model.safetensors{}: save it with save_pretrained(DIR) (safetensors, one file; "
               "max_shard_size large enough for the model)", dir,
               sharded ? " (it holds a sharded checkpoint, which is not read here)"
                       : pickle ? " (only pytorch_model.bin, a pickle, which is not read here)" : "");
  }
  const hf::StFile file = hf::read_safetensors(path, "--load-hf model.safetensors");

  // Names as save_pretrained of GPT2LMHeadModel writes them ("transformer.h.0..."), or of GPT2Model
  // (no prefix): one or the other, never both.
  std::map<std::string, std::string> by_name;  // name without the prefix -> the file's name
  std::vector<std::string> foreign;
  for (const auto& [name, tensor] : file.tensors) {
    std::string_view short_name = name;
    if (short_name.starts_with(hf::kPrefix)) short_name.remove_prefix(hf::kPrefix.size());
    if (name == "lm_head.weight" || is_mask_buffer(short_name)) continue;
    MXDDP_CHECK(by_name.emplace(std::string(short_name), name).second,
                "'{}' holds both '{}' and '{}{}': one model's tensors, please", path, short_name, hf::kPrefix, short_name);
  }
  const std::vector<ParamSpec> specs = gpt_param_specs(model);
  const std::vector<hf::Gpt2Tensor> names = hf::gpt2_tensors(model);
  HfGpt2Params out;
  out.values.resize(specs.size());
  std::set<std::string> used;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto it = by_name.find(names[i].name);
    MXDDP_CHECK(it != by_name.end(), "'{}' has no tensor '{}{}' (mxddp's {}): not a GPT-2 model of this config", path,
                hf::kPrefix, names[i].name, specs[i].name);
    used.insert(it->first);
    const hf::StTensor& t = file.tensors.at(it->second);
    // What HF's tensor must be: mxddp's shape, transposed for a Conv1D weight; wpe has n_positions rows.
    std::vector<int64_t> expected;
    for (int d = 0; d < specs[i].shape.ndim(); ++d) expected.push_back(specs[i].shape[d]);
    if (names[i].transposed) std::reverse(expected.begin(), expected.end());
    if (i == 1) expected[0] = hf_config.n_positions;
    MXDDP_CHECK(t.shape == expected, "'{}': tensor '{}' has shape {} ({}); GPT-2 of config.json's sizes needs {}", path,
                it->second, shape_text(t.shape), t.dtype, shape_text(expected));
    std::vector<float> v = hf::tensor_f32(file, it->second);
    check_finite(path, it->second, t, v, fmt::format(", mxddp's {}", specs[i].name));
    if (names[i].transposed) v = hf::transpose(v, expected[0], expected[1]);
    if (i == 1) v.resize(static_cast<size_t>(specs[i].shape.numel()));  // the first seq_length positions
    out.values[i] = std::move(v);
  }
  for (const auto& [short_name, name] : by_name)
    if (!used.contains(short_name)) foreign.push_back(name);
  MXDDP_CHECK(foreign.empty(), "'{}' holds tensors that are not part of GPT-2 of config.json's {} layers: {}", path,
              model.num_layers, fmt::join(foreign, ", "));
  // A file with an untied head (saved by hand) must hold the embedding again, or the model is not ours.
  if (const auto head = file.tensors.find("lm_head.weight"); head != file.tensors.end()) {
    const std::vector<int64_t> wte_shape = {model.vocab_size, model.hidden_size};
    const std::vector<float> head_values = hf::tensor_f32(file, "lm_head.weight");
    check_finite(path, "lm_head.weight", head->second, head_values, "");
    MXDDP_CHECK(head->second.shape == wte_shape && head_values == out.values[0],
                "'{}': lm_head.weight differs from the token embedding (wte); mxddp's LM head is tied to it", path);
  }
  out.safetensors_crc32 = ckpt::crc32_of(file.bytes);
  out.config_crc32 = ckpt::crc32_of(ckpt::read_file((fs::path(dir) / "config.json").string()));
  return out;
}

}  // namespace mxddp
