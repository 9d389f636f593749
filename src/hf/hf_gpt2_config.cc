// read_hf_gpt2_config (hf.h): a Hugging Face GPT2Config as mxddp's GptConfig, refusing, by field,
// every setting under which GPT2LMHeadModel computes something other than mxddp's GPT.
#include <climits>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include <mxddp/hf.h>
#include <mxddp/input_file.h>

#include "hf_gpt2_names.h"

namespace mxddp {

namespace {

// GPT2Config's defaults (transformers' configuration_gpt2.py) for the fields read here: a key a
// config.json leaves out has this value in GPT2LMHeadModel.
const nlohmann::json& gpt2_defaults() {
  static const nlohmann::json d = {
      {"vocab_size", 50257}, {"n_positions", 1024}, {"n_embd", 768}, {"n_layer", 12}, {"n_head", 12},
      {"n_inner", nullptr}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},
      {"scale_attn_weights", true}, {"scale_attn_by_inverse_layer_idx", false}, {"reorder_and_upcast_attn", false},
      {"add_cross_attention", false}, {"tie_word_embeddings", true}, {"attn_pdrop", 0.1}, {"embd_pdrop", 0.1},
      {"resid_pdrop", 0.1}};
  return d;
}

}  // namespace

HfGpt2Config read_hf_gpt2_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  std::error_code ec;
  MXDDP_CHECK(std::filesystem::exists(path, ec),
              "--load-hf '{}' has no config.json: give a directory written by save_pretrained (config.json and "
              "model.safetensors)", dir);
  const std::vector<char> bytes = InputFile(path, "--load-hf config.json").read_all();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    MXDDP_FAIL("'{}' is not JSON: {}", path, e.what());
  }
  MXDDP_CHECK(j.is_object(), "'{}' is not a JSON object", path);
  auto field = [&](const char* key) -> const nlohmann::json& {
    return j.contains(key) ? j[key] : gpt2_defaults().at(key);
  };
  auto integer = [&](const char* key) {
    const nlohmann::json& v = field(key);
    MXDDP_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= INT_MAX,
                "'{}': {} is {}; expected an integer in [1, {}]", path, key, v.dump(), INT_MAX);
    return static_cast<int>(v.get<int64_t>());
  };
  auto boolean = [&](const char* key) {
    const nlohmann::json& v = field(key);
    MXDDP_CHECK(v.is_boolean(), "'{}': {} is {}; expected true or false", path, key, v.dump());
    return v.get<bool>();
  };
  auto unsupported = [&](const std::string& what, const std::string& why) {
    MXDDP_FAIL("'{}': {}: {}; mxddp's GPT cannot run this model (docs/hf.md lists what it runs)", path, what, why);
  };

  if (j.contains("model_type") && j["model_type"] != "gpt2")
    unsupported(fmt::format("model_type {}", j["model_type"].dump()), "only gpt2 is GPT-2's architecture");
  if (j.contains("architectures")) {
    MXDDP_CHECK(j["architectures"].is_array(), "'{}': architectures is {}", path, j["architectures"].dump());
    for (const nlohmann::json& a : j["architectures"])
      if (a != "GPT2LMHeadModel" && a != "GPT2Model")
        unsupported(fmt::format("architectures {}", a.dump()), "valid: GPT2LMHeadModel (or GPT2Model, whose head is tied)");
  }
  HfGpt2Config out;
  out.model.vocab_size = integer("vocab_size");
  out.model.num_layers = integer("n_layer");
  out.model.hidden_size = integer("n_embd");
  out.model.num_attention_heads = integer("n_head");
  out.n_positions = integer("n_positions");
  out.model.seq_length = out.n_positions;

  const nlohmann::json& act = field("activation_function");
  MXDDP_CHECK(act.is_string(), "'{}': activation_function is {}", path, act.dump());
  if (!hf::is_tanh_gelu(act.get<std::string>()))
    unsupported(fmt::format("activation_function {}", act.dump()),
                "mxddp's MLP uses GELU's tanh approximation; valid: gelu_new (or gelu_pytorch_tanh, gelu_fast, "
                "gelu_python_tanh, the same function)");
  const nlohmann::json& inner = field("n_inner");
  if (!inner.is_null() &&
      !(inner.is_number_integer() && inner.get<int64_t>() == 4 * int64_t{out.model.hidden_size}))
    unsupported(fmt::format("n_inner {}", inner.dump()),
                fmt::format("mxddp's MLP is 4 x n_embd = {} wide; valid: null or {}", 4 * int64_t{out.model.hidden_size},
                            4 * int64_t{out.model.hidden_size}));
  const nlohmann::json& eps = field("layer_norm_epsilon");
  MXDDP_CHECK(eps.is_number(), "'{}': layer_norm_epsilon is {}", path, eps.dump());
  if (std::fabs(eps.get<double>() - hf::kLayerNormEps) > 1e-6 * hf::kLayerNormEps)
    unsupported(fmt::format("layer_norm_epsilon {}", eps.dump()), "mxddp's LayerNorm epsilon is 1e-05 (fixed)");
  if (!boolean("scale_attn_weights"))
    unsupported("scale_attn_weights false", "mxddp's attention scales the scores by 1/sqrt(head size)");
  if (boolean("scale_attn_by_inverse_layer_idx"))
    unsupported("scale_attn_by_inverse_layer_idx true", "mxddp's attention does not scale by the layer's index");
  if (boolean("add_cross_attention")) unsupported("add_cross_attention true", "mxddp's GPT is a decoder only");
  if (!boolean("tie_word_embeddings"))
    unsupported("tie_word_embeddings false", "mxddp's LM head is the token embedding (tied)");
  if (boolean("reorder_and_upcast_attn"))
    out.notes.push_back("reorder_and_upcast_attn true changes only the precision HF computes attention in; mxddp's "
                        "is f32");
  std::string dropout;
  for (const char* key : {"attn_pdrop", "embd_pdrop", "resid_pdrop"}) {
    const nlohmann::json& p = field(key);
    MXDDP_CHECK(p.is_number() && p.get<double>() >= 0 && p.get<double>() < 1, "'{}': {} is {}; expected [0, 1)", path,
                key, p.dump());
    if (p.get<double>() > 0) dropout += fmt::format("{}{} {}", dropout.empty() ? "" : ", ", key, p.dump());
  }
  if (!dropout.empty())
    out.notes.push_back(fmt::format("{}: mxddp's GPT has no dropout, so training here runs without it (as HF's "
                                    "eval mode computes)", dropout));
  try {
    out.model.validate();
  } catch (const Error& e) {
    MXDDP_FAIL("'{}' (n_layer {}, n_embd {}, n_head {}, n_positions {}, vocab_size {}): {}", path,
               out.model.num_layers, out.model.hidden_size, out.model.num_attention_heads, out.n_positions,
               out.model.vocab_size, e.message());
  }
  return out;
}

}  // namespace mxddp
