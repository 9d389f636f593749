// `mxddp ckpt export DIR --out FILE [--dtype f32|bf16]`: one safetensors file holding every model
// param whole and shaped (of DIR's newest checkpoint when DIR is a `mxddp train --save` history), under the checkpoint's (Megatron-style) param names, with the model
// config as JSON in its "__metadata__". The values are the checkpoint's FP32 main params (the
// optimizer's master copy; MXFP8 runs have them too), assembled from every data-parallel rank's
// slices as a load at dp 1 would, after every check `mxddp ckpt inspect` runs
// (read_checkpoint_params, then gpt_checkpoint_problems). --dtype bf16 rounds them to nearest
// even. --out is checked before any work and written atomically (temporary name, rename): never
// inside a checkpoint history or checkpoint, and an existing one only when it is a previous export
// (its mark: mxddp_export in the safetensors __metadata__) and --overwrite is given.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

namespace mxddp::app {

struct CkptExportArgs {
  std::string dir;
  std::string out;
  std::string dtype;  // "" : the format's default (safetensors: f32; hf: model)
  std::string format = "safetensors";  // or "hf": a Hugging Face GPT-2 directory (docs/hf.md)
  std::optional<int64_t> eos_token_id;  // --format hf: bos/eos in config.json
  bool overwrite = false;               // replace an existing --out that is a previous export
};

// Adds `export` under the `ckpt` command.
CLI::App* add_ckpt_export_command(CLI::App& ckpt, CkptExportArgs& args);
// Throws Error naming the bad value (the directory, the damaged file, --dtype, --out); prints one
// summary line on success.
void run_ckpt_export(const CkptExportArgs& args);

// The checkpoint that `mxddp ckpt inspect DIR` and `ckpt export DIR` read: a --save history's
// newest (DIR holds latest_checkpointed_iteration.txt: resolve_checkpoint_dir), otherwise DIR
// itself, which the checkpoint layer reads as one checkpoint (or its .partial / .old copy after an
// interrupted save) and names in its errors when it is none.
std::string checkpoint_dir_to_read(const std::string& dir);

// The fused attention weight's row order, as the help and the file's metadata state it.
extern const char* const kQkvLayout;

}  // namespace mxddp::app
