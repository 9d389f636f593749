// encode_hf_gpt2 and write_hf_gpt2 (hf.h): a checkpoint's params as a Hugging Face GPT-2 directory
// that GPT2LMHeadModel.from_pretrained loads as it is.
#include <filesystem>

#include <nlohmann/json.hpp>

#include <mxddp/hf.h>

#include "../checkpoint/file_io.h"
#include "../checkpoint/safetensors.h"
#include "hf_gpt2_names.h"
#include "hf_safetensors.h"

namespace mxddp {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kGpt2EndOfText = 50256;  // GPT-2's <|endoftext|>, Megatron's GPT2BPETokenizer eod

// The files an export writes: what may be replaced in an existing --out.
bool is_export_file(const std::string& name) { return name == "config.json" || name == "model.safetensors"; }

// model.safetensors' __metadata__ key holding the CRC-32 of the config.json written beside it, so
// that a config.json replaced after the export is not taken for the export's own.
constexpr const char* kConfigCrcKey = "mxddp_export_config_crc32";

// Throws Error unless the non-empty directory dir holds a previous export exactly as an export
// wrote it: config.json and model.safetensors only, the latter marked (kExportMarkerKey "hf"), the
// former the one the mark's CRC-32 names.
void check_previous_export(const std::string& dir) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
    MXDDP_CHECK(is_export_file(e.path().filename().string()) && e.is_regular_file(ec),
                "--out '{}' holds '{}', which an export does not write: give a new directory, an empty one or a "
                "previous export (config.json and model.safetensors only, as `mxddp ckpt export` wrote them), which "
                "--overwrite replaces", dir, e.path().filename().string());
  const std::string model = (fs::path(dir) / "model.safetensors").string();
  const auto metadata = ckpt::read_safetensors_metadata(model);
  const bool marked = metadata && metadata->count(kExportMarkerKey) && metadata->at(kExportMarkerKey) == "hf";
  MXDDP_CHECK(marked, "--out '{}' is not a previous export of `mxddp ckpt export --format hf`: {}; an export "
              "replaces only a directory it wrote (with --overwrite). Give a new directory or an empty one", dir,
              !fs::exists(model, ec) ? "it holds config.json but no model.safetensors"
                                     : "its model.safetensors does not carry the export's mark (mxddp_export: hf in "
                                       "its __metadata__)");
  const std::string config = (fs::path(dir) / "config.json").string();
  if (!fs::exists(config, ec)) return;  // the export's model.safetensors alone: nothing of anyone else's
  const auto recorded = metadata->find(kConfigCrcKey);
  const std::string crc = fmt::format("{:08x}", ckpt::crc32_of(ckpt::read_file(config)));
  MXDDP_CHECK(recorded != metadata->end() && recorded->second == crc,
              "--out '{}': its config.json is not the one the export wrote (CRC-32 {}; the export recorded {}): it "
              "was edited or replaced since, so --overwrite would lose it. Move it away or give a new directory",
              dir, crc, recorded == metadata->end() ? "none" : recorded->second);
}

}  // namespace

HfGpt2Export encode_hf_gpt2(const CheckpointParams& params, const HfExportOptions& options) {
  const CheckpointInfo& info = params.info;
  MXDDP_CHECK(!info.model_config.empty(), "checkpoint '{}' records no model config, so its GPT-2 sizes are unknown: "
              "export it with --format safetensors", info.dir);
  const GptConfig model = GptConfig::from_fields(info.model_config);
  const std::vector<ParamSpec> specs = gpt_param_specs(model);
  MXDDP_ASSERT(specs.size() == info.params.size() && params.values.size() == specs.size());

  const std::vector<hf::Gpt2Tensor> names = hf::gpt2_tensors(model);
  HfGpt2Export out;
  std::vector<std::vector<float>> values(specs.size());  // HF's layout
  std::string model_dtypes;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> v = params.values[i];
    const std::string& dtype = info.params[i].dtype;
    if (options.values == HfExportValues::kModel) {
      MXDDP_CHECK(dtype == "bf16" || dtype == "f32",
                  "checkpoint '{}': param {} was kept as {}, whose dequantized values the HF export does not compute; "
                  "export --dtype f32 (the FP32 main params: HF's loss then differs from mxddp's by the MXFP8 "
                  "rounding)", info.dir, info.params[i].name, dtype);
      if (dtype == "bf16")
        for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));  // what the model params are: nearest even
      if (model_dtypes.find(dtype) == std::string::npos) model_dtypes += (model_dtypes.empty() ? "" : ", ") + dtype;
    }
    if (names[i].transposed) v = hf::transpose(v, specs[i].shape[0], specs[i].shape[1]);
    values[i] = std::move(v);
  }
  out.values = options.values == HfExportValues::kModel
                   ? fmt::format("the model params mxddp evaluates with ({}: the FP32 main params rounded to nearest "
                                 "even{}), stored as F32",
                                 model_dtypes, model_dtypes == "f32" ? ", here not rounded" : "")
                   : "the FP32 main params (the optimizer's master copy), as they are";

  std::vector<hf::StTensorToWrite> tensors;
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<int64_t> shape;
    for (int d = 0; d < specs[i].shape.ndim(); ++d) shape.push_back(specs[i].shape[d]);
    if (names[i].transposed) std::swap(shape[0], shape[1]);
    tensors.push_back({std::string(hf::kPrefix) + names[i].name, shape, values[i].data()});
  }
  nlohmann::ordered_json eos = nullptr;
  if (options.eos_token_id) {
    MXDDP_CHECK(*options.eos_token_id >= 0 && *options.eos_token_id < model.vocab_size,
                "--eos-token-id {} is not in the model's vocabulary of {}: valid 0..{}", *options.eos_token_id,
                model.vocab_size, model.vocab_size - 1);
    eos = *options.eos_token_id;
  } else if (model.vocab_size > kGpt2EndOfText) {
    eos = kGpt2EndOfText;
  }
  const int64_t c = model.hidden_size;
  const nlohmann::ordered_json config = {
      {"architectures", {"GPT2LMHeadModel"}},
      {"model_type", "gpt2"},
      {"vocab_size", model.vocab_size},
      {"n_positions", model.seq_length},
      {"n_embd", c},
      {"n_layer", model.num_layers},
      {"n_head", model.num_attention_heads},
      {"n_inner", 4 * c},
      {"activation_function", "gelu_new"},
      {"layer_norm_epsilon", hf::kLayerNormEps},
      {"scale_attn_weights", true},
      {"scale_attn_by_inverse_layer_idx", false},
      {"reorder_and_upcast_attn", false},
      {"add_cross_attention", false},
      {"tie_word_embeddings", true},
      // mxddp trains without dropout: a run continued in HF behaves as it did here.
      {"attn_pdrop", 0.0},
      {"embd_pdrop", 0.0},
      {"resid_pdrop", 0.0},
      {"initializer_range", 0.02},
      {"bos_token_id", eos},
      {"eos_token_id", eos},
      {"use_cache", true},
      // F32 tensors, computed in f32 by from_pretrained (whose default reads this).
      {"dtype", "float32"}};
  out.config_json = config.dump(2) + "\n";

  std::map<std::string, std::string> metadata = {
      {"format", "pt"},  // transformers refuses a file without it
      {"mxddp_model_config", nlohmann::json(info.model_config).dump()},
      {"mxddp_step", std::to_string(info.step)},
      {"mxddp_values", out.values},
      {kExportMarkerKey, "hf"},
      {kConfigCrcKey, fmt::format("{:08x}", ckpt::crc32_of(out.config_json))}};
  if (const auto it = info.metadata.find("iteration"); it != info.metadata.end()) metadata["mxddp_iteration"] = it->second;
  out.safetensors = hf::encode_f32_safetensors(tensors, metadata);
  return out;
}

void check_hf_output_dir(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (!fs::exists(st)) {
    const fs::path parent = fs::absolute(dir, ec).parent_path();
    MXDDP_CHECK(fs::is_directory(parent, ec), "--out '{}': its parent {} is not a directory", dir, parent.string());
    return;
  }
  MXDDP_CHECK(fs::is_directory(st), "--out '{}' exists and is not a directory: --format hf writes a directory "
              "(config.json, model.safetensors)", dir);
  const bool empty = fs::is_empty(dir, ec);
  MXDDP_CHECK(!ec, "--out '{}' cannot be listed: {}", dir, ec.message());
  if (!empty) check_previous_export(dir);
}

void write_hf_gpt2(const std::string& dir, const HfGpt2Export& files) {
  check_hf_output_dir(dir);
  const std::string partial = dir + ".partial", old = dir + ".old";
  std::error_code ec;
  // What an interrupted export left: only its own files (checked), so nothing else is lost.
  for (const std::string& leftover : {partial, old})
    if (fs::exists(fs::symlink_status(leftover, ec))) {
      MXDDP_CHECK(fs::is_directory(fs::symlink_status(leftover, ec)), "'{}' is in the way of --out '{}' and is not "
                  "a directory left by an interrupted export: move it away", leftover, dir);
      for (const fs::directory_entry& e : fs::directory_iterator(leftover, ec)) {
        const std::string name = e.path().filename().string();
        MXDDP_CHECK(is_export_file(name) || name.starts_with("."), "'{}' (left by an interrupted export of --out '{}') "
                    "holds '{}': move it away", leftover, dir, name);
      }
      fs::remove_all(leftover, ec);
      MXDDP_CHECK(!ec, "cannot remove '{}' (left by an interrupted export): {}", leftover, ec.message());
    }
  fs::create_directories(partial, ec);
  MXDDP_CHECK(!ec, "--out '{}': cannot create '{}': {}", dir, partial, ec.message());
  // Whatever fails from here (a full disk, a file-size limit, memory) removes what this export
  // wrote and leaves a previous export in place, as before the export.
  bool swapped_out = false;
  try {
    ckpt::write_file_atomic((fs::path(partial) / "model.safetensors").string(), files.safetensors);
    ckpt::write_file_atomic((fs::path(partial) / "config.json").string(),
                            std::vector<char>(files.config_json.begin(), files.config_json.end()));
    // The new directory complete on disk, then in place; a previous export is swapped out first.
    const bool replace = fs::exists(dir, ec);
    if (replace) fs::rename(dir, old);
    swapped_out = replace;
    fs::rename(partial, dir);
    swapped_out = false;
    if (replace) fs::remove_all(old);
    ckpt::fsync_directory(fs::absolute(dir).parent_path().string());
  } catch (...) {
    if (swapped_out) fs::rename(old, dir, ec);
    fs::remove_all(partial, ec);
    try {
      throw;
    } catch (const fs::filesystem_error& e) {
      MXDDP_FAIL("--out '{}': {}", dir, e.what());
    }
  }
}

}  // namespace mxddp
