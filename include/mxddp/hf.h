// mxddp hf: the reference GPT to and from a Hugging Face GPT-2 checkpoint directory (docs/hf.md).
//
// A Hugging Face GPT-2 directory holds config.json (a GPT2Config) and model.safetensors (the
// tensors of GPT2LMHeadModel: transformer.wte/wpe, transformer.h.<l>.{ln_1, attn.c_attn,
// attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, transformer.ln_f; the LM head tied to wte). HF's
// Conv1D stores a linear weight as [in, out], the transpose of mxddp's [out, in]; c_attn's columns
// are q | k | v, the order of mxddp's linear_qkv rows, so a transpose is the whole mapping.
//
// The architectures are the same when the config says: activation_function a tanh-approximated
// GELU (gelu_new, as mxddp's), layer_norm_epsilon 1e-5 (mxddp's, fixed), n_inner 4 n_embd (or
// null), scale_attn_weights true (1/sqrt(D)), scale_attn_by_inverse_layer_idx false,
// add_cross_attention false, tie_word_embeddings true, model_type gpt2. Anything else is refused,
// naming the field. Dropout (attn_pdrop, embd_pdrop, resid_pdrop) is not part of mxddp's GPT: it
// is reported, not refused (HF evaluates without it too).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <mxddp/checkpoint.h>
#include <mxddp/model.h>

namespace mxddp {

// What a GPT2Config says, as mxddp's GptConfig (seq_length = n_positions).
struct HfGpt2Config {
  GptConfig model;
  int n_positions = 0;
  // Settings accepted that change nothing in mxddp's GPT, one line each (dropout, a numerics-only
  // attention option): for the run's banner.
  std::vector<std::string> notes;
};

// Reads DIR/config.json: throws Error naming DIR and the field that mxddp's GPT cannot run, a
// missing or malformed file, or a value out of range.
HfGpt2Config read_hf_gpt2_config(const std::string& dir);

struct HfGpt2Params {
  // [param] in gpt_param_specs(model) order, f32, mxddp's layouts ([out, in] linear weights).
  std::vector<std::vector<float>> values;
  uint32_t config_crc32 = 0;       // of config.json's bytes
  uint32_t safetensors_crc32 = 0;  // of model.safetensors' bytes
};

// Reads DIR (read_hf_gpt2_config's checks, then DIR/model.safetensors) into mxddp's params for
// `model`, whose fields must be the HF config's, except seq_length, which may be shorter than
// n_positions: the first seq_length rows of wpe are taken (positions are absolute). F32, BF16 and
// F16 tensors are read (converted to f32 exactly). Every tensor's dtype, shape and byte range is
// checked against the file before use; a tensor that is missing, of another shape, or not part of
// GPT-2 (other than the attention-mask buffers attn.bias / attn.masked_bias older files hold) is
// an error naming it. Names with and without the "transformer." prefix are read.
HfGpt2Params read_hf_gpt2_params(const std::string& dir, const GptConfig& model);

// Which values `mxddp ckpt export --format hf` writes.
enum class HfExportValues : uint8_t {
  kModel,  // the params mxddp's forward reads: the model params (the main params cast to the
           // checkpoint's model dtype, bf16: rounded to nearest even), so HF evaluating in f32
           // reproduces the loss mxddp printed
  kMain,   // the FP32 main params as they are (the optimizer's master copy)
};

struct HfExportOptions {
  HfExportValues values = HfExportValues::kModel;
  // bos_token_id and eos_token_id; unset: 50256 (GPT-2's <|endoftext|>) when the vocabulary holds
  // it, otherwise null (byte-level data has no such token). Must be < vocab_size.
  std::optional<int64_t> eos_token_id;
};

struct HfGpt2Export {
  std::string config_json;         // config.json's text
  std::vector<char> safetensors;   // model.safetensors' bytes (every tensor F32)
  std::string values;              // what the values are, for a person
};

// The checkpoint's params as an HF GPT-2 directory's two files. Throws Error when the checkpoint
// has no model config, when options.eos_token_id is not in the vocabulary, or (kModel) when a
// param was kept as MXFP8, whose dequantized values this export does not compute.
HfGpt2Export encode_hf_gpt2(const CheckpointParams& params, const HfExportOptions& options = {});

// Writes DIR/config.json and DIR/model.safetensors as one step: into DIR.partial (fsynced), then
// renamed to DIR. DIR must not exist, be an empty directory, or hold a previous export exactly as
// write_hf_gpt2 wrote it: config.json and model.safetensors only, model.safetensors marked
// (`mxddp_export: hf` in its __metadata__, with `mxddp_export_config_crc32`, the CRC-32 of the
// config.json written beside it) and config.json unchanged; anything else is refused, naming the
// file, before anything is written. Whether a previous export is replaced (--overwrite) is the
// caller's choice. Any failure removes DIR.partial and leaves a previous export in place.
void check_hf_output_dir(const std::string& dir);
void write_hf_gpt2(const std::string& dir, const HfGpt2Export& files);

}  // namespace mxddp
