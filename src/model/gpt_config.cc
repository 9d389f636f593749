// GptConfig, its presets, the param list and the initialization of the reference GPT.
#include <charconv>
#include <climits>
#include <cmath>
#include <algorithm>
#include <ranges>

#include <fmt/ranges.h>

#include <mxddp/model.h>

#include "random.h"

namespace mxddp {

void GptConfig::validate() const {
  // Any size (--vocab-size padded, or an imported HF model's); the data's token ids are checked
  // against the tokenizer's vocabulary where they are read (train_data.cc).
  MXDDP_CHECK(vocab_size >= 1, "vocab size {} is not valid: at least 1 (--vocab-size, padded by "
              "--make-vocab-size-divisible-by)", vocab_size);
  MXDDP_CHECK(num_layers >= 1, "--num-layers {} is not valid: at least 1", num_layers);
  MXDDP_CHECK(hidden_size >= 1, "--hidden-size {} is not valid: at least 1", hidden_size);
  MXDDP_CHECK(num_attention_heads >= 1 && hidden_size % num_attention_heads == 0,
              "--num-attention-heads {} is not valid for --hidden-size {}: it must divide the hidden size",
              num_attention_heads, hidden_size);
  MXDDP_CHECK(seq_length >= 1, "--seq-length {} is not valid: at least 1", seq_length);
}

int64_t GptConfig::num_params() const {
  // Checked: --hidden-size and --num-layers go up to 2^31 - 1, and 12 c^2 L does not fit in 64 bits.
  constexpr std::string_view what = "the model's param count (--num-layers, --hidden-size, --seq-length)";
  const int64_t c = hidden_size;
  const int64_t c2 = checked_mul(c, c, what);
  // Per layer: two norms (2c each), qkv (3c^2 + 3c), proj (c^2 + c), fc1 (4c^2 + 4c), fc2 (4c^2 + c).
  const int64_t per_layer = checked_add(checked_mul(12, c2, what), 13 * c, what);
  int64_t n = checked_mul(num_layers, per_layer, what);
  n = checked_add(n, checked_mul(int64_t{vocab_size} + seq_length + 2, c, what), what);
  return n;
}

double GptConfig::train_flops_per_token() const {
  const double c = hidden_size, t = seq_length;
  const double linear = num_layers * (3 * c * c + c * c + 8 * c * c) + vocab_size * c;  // multiply-adds
  const double attention = num_layers * 2 * t * c;                                     // q k^T and p v
  return 3.0 * 2.0 * (linear + attention);
}

std::string GptConfig::describe() const {
  return fmt::format("{} layers, hidden {}, {} heads, seq {}, {:.2f}M params", num_layers, hidden_size,
                     num_attention_heads, seq_length, static_cast<double>(num_params()) / 1e6);
}

// A field added to GptConfig must be added to fields() too, or checkpoints stop comparing it.
static_assert(sizeof(GptConfig) == 5 * sizeof(int), "GptConfig changed: list every field in GptConfig::fields()");

std::vector<std::pair<std::string, std::string>> GptConfig::fields() const {
  return {{"vocab_size", std::to_string(vocab_size)},
          {"num_layers", std::to_string(num_layers)},
          {"hidden_size", std::to_string(hidden_size)},
          {"num_attention_heads", std::to_string(num_attention_heads)},
          {"seq_length", std::to_string(seq_length)}};
}

GptConfig GptConfig::from_fields(const std::vector<std::pair<std::string, std::string>>& fields) {
  GptConfig config;
  const std::vector<std::pair<std::string_view, int*>> slots = {
      {"vocab_size", &config.vocab_size}, {"num_layers", &config.num_layers}, {"hidden_size", &config.hidden_size},
      {"num_attention_heads", &config.num_attention_heads}, {"seq_length", &config.seq_length}};
  MXDDP_CHECK(fields.size() == slots.size(), "a GPT config has {} fields ({}); got {}", slots.size(),
              fmt::join(std::views::keys(slots), ", "), fields.size());
  std::vector<bool> seen(slots.size(), false);
  for (const auto& [key, value] : fields) {  // any order: a JSON object's keys come back sorted
    const auto slot = std::ranges::find(slots, std::string_view(key), [](const auto& s) { return s.first; });
    MXDDP_CHECK(slot != slots.end(), "GPT config field '{}' is not one of {}", key,
                fmt::join(std::views::keys(slots), ", "));
    MXDDP_CHECK(!seen[static_cast<size_t>(slot - slots.begin())], "GPT config field '{}' is given twice", key);
    seen[static_cast<size_t>(slot - slots.begin())] = true;
    int parsed = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
    MXDDP_CHECK(ec == std::errc{} && end == value.data() + value.size(),
                "GPT config field '{}' is '{}', not an integer in [{}, {}]", key, value, INT_MIN, INT_MAX);
    *slot->second = parsed;
  }
  config.validate();
  return config;
}

std::vector<std::string> gpt_preset_names() { return {"tiny", "small", "gpt2-124m"}; }

GptConfig gpt_preset(std::string_view name) {
  if (name == "tiny") return GptConfig{.num_layers = 2, .hidden_size = 64, .num_attention_heads = 4, .seq_length = 64};
  if (name == "small") return GptConfig{.num_layers = 6, .hidden_size = 384, .num_attention_heads = 6, .seq_length = 256};
  if (name == "gpt2-124m")
    return GptConfig{.num_layers = 12, .hidden_size = 768, .num_attention_heads = 12, .seq_length = 1024};
  MXDDP_FAIL("model preset '{}' is not known; valid: tiny, small, gpt2-124m", name);
}

std::vector<ParamSpec> gpt_param_specs(const GptConfig& config, bool mxfp8_linear_weights) {
  config.validate();
  const int64_t c = config.hidden_size;
  std::vector<ParamSpec> specs;
  specs.push_back({"embedding.word_embeddings.weight", Shape{config.vocab_size, c}, /*shared_embedding=*/true});
  specs.push_back({"embedding.position_embeddings.weight", Shape{config.seq_length, c}});
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string p = fmt::format("decoder.layers.{}.", l);
    auto linear = [&](const std::string& name, int64_t out, int64_t in) {
      specs.push_back({p + name + ".weight", Shape{out, in}, false, mxfp8_linear_weights});
      specs.push_back({p + name + ".bias", Shape{out}});
    };
    specs.push_back({p + "input_layernorm.weight", Shape{c}});
    specs.push_back({p + "input_layernorm.bias", Shape{c}});
    linear("self_attention.linear_qkv", 3 * c, c);
    linear("self_attention.linear_proj", c, c);
    specs.push_back({p + "pre_mlp_layernorm.weight", Shape{c}});
    specs.push_back({p + "pre_mlp_layernorm.bias", Shape{c}});
    linear("mlp.linear_fc1", 4 * c, c);
    linear("mlp.linear_fc2", c, 4 * c);
  }
  specs.push_back({"decoder.final_layernorm.weight", Shape{c}});
  specs.push_back({"decoder.final_layernorm.bias", Shape{c}});
  return specs;
}

std::vector<std::vector<float>> gpt_init_params(const GptConfig& config, uint64_t seed) {
  const std::vector<ParamSpec> specs = gpt_param_specs(config);
  const GptParamIds ids(config);
  const double residual_std = 0.02 / std::sqrt(2.0 * config.num_layers);
  std::vector<std::vector<float>> values(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float>& v = values[i];
    v.resize(static_cast<size_t>(specs[i].shape.numel()));
    const std::string& name = specs[i].name;
    const bool is_norm_weight = name.ends_with("layernorm.weight");
    if (specs[i].shape.ndim() == 1) {
      std::fill(v.begin(), v.end(), is_norm_weight ? 1.0f : 0.0f);
      continue;
    }
    const bool residual = name.ends_with("linear_proj.weight") || name.ends_with("linear_fc2.weight");
    const double stddev = residual ? residual_std : 0.02;
    model::Rng rng(model::mix_hash(seed, i, 0x6770u));  // one stream per param: order-independent
    for (float& x : v) x = static_cast<float>(stddev * rng.normal());
  }
  MXDDP_ASSERT(static_cast<int64_t>(values.size()) == ids.count());
  return values;
}

std::vector<std::vector<int>> gpt_fsdp_units(const GptConfig& config, bool fine_grained) {
  const GptParamIds ids(config);
  std::vector<std::vector<int>> units;
  for (int l = 0; l < config.num_layers; ++l) {
    if (!fine_grained) {
      units.emplace_back();
      for (int k = 0; k < kLayerParamCount; ++k) units.back().push_back(ids.layer(l, static_cast<LayerParam>(k)));
      continue;
    }
    // LayerParam lists each submodule's weight then its bias, in forward order.
    for (int k = 0; k < kLayerParamCount; k += 2)
      units.push_back({ids.layer(l, static_cast<LayerParam>(k)), ids.layer(l, static_cast<LayerParam>(k + 1))});
  }
  return units;
}

}  // namespace mxddp
