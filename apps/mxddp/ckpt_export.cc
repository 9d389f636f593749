// `mxddp ckpt export`: see ckpt_export.h.
#include "ckpt_export.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <mxddp/checkpoint.h>
#include <mxddp/checkpoint_history.h>
#include <mxddp/hf.h>
#include <mxddp/output_file.h>
#include <mxddp/train.h>

namespace mxddp::app {

const char* const kQkvLayout =
    "decoder.layers.<l>.self_attention.linear_qkv.weight is [3C, C] (C = hidden_size; linear weights are "
    "[out, in], y = x W^T + b). Its rows are three blocks, q | k | v: rows [0, C) give the query, [C, 2C) the "
    "key, [2C, 3C) the value. Within each block head h (of H = num_attention_heads, D = C / H) owns D "
    "consecutive rows, so head h's query, key and value rows are [h*D, h*D+D), [C+h*D, C+h*D+D) and "
    "[2C+h*D, 2C+h*D+D). linear_qkv.bias [3C] is split the same way. This is GPT-2's c_attn order (Hugging "
    "Face stores that weight transposed, [C, 3C]); it is not Megatron-core's linear_qkv order, which "
    "interleaves the three by head (query group): q_0, k_0, v_0, q_1, k_1, v_1 and so on";

namespace {

namespace fs = std::filesystem;

constexpr const char* kHelp =
    "Writes one safetensors file with every model param whole and shaped, under the checkpoint's param names "
    "(embedding.word_embeddings.weight, decoder.layers.0.self_attention.linear_qkv.weight, ...). DIR is one "
    "checkpoint or a `mxddp train --save` directory, whose newest checkpoint is read (as --load reads it). The "
    "values are its FP32 main params (the optimizer's master copy, from which the model params are cast), "
    "assembled from every data-parallel rank's shard as a load at dp 1 would, after every check `mxddp ckpt "
    "inspect` runs: a damaged checkpoint is refused, never exported in part. Runs trained with --fp8-param-gather "
    "(MXFP8 params) have FP32 main params too and are exported the same way: the export holds those, not the "
    "MXFP8 payloads and scales. --dtype bf16 rounds them to nearest even. The file's __metadata__ (string "
    "values) holds mxddp_model_config (the model config as one JSON object), mxddp_iteration, mxddp_step, "
    "mxddp_checkpoint_metadata, mxddp_dtype, mxddp_source, mxddp_qkv_layout and mxddp_export (the mark of a file "
    "this command wrote). --out is written atomically (a temporary name, then a rename); it may not be inside any "
    "checkpoint history or checkpoint, and an existing --out is replaced only when it is a previous export and "
    "--overwrite is given.\n\n"
    "Layout: the LM head is tied to embedding.word_embeddings.weight [V, C] (no separate output weight); "
    "embedding.position_embeddings.weight is [T, C]. The fused attention weight: ";

// Refuses an --out that is, or lies inside, a checkpoint history or checkpoint (any, not only the
// one exported; links and '..' resolved): saves replace a checkpoint directory as a whole and prune
// a history's iter_ directories (deleting the export), `mxddp train --save` refuses a history that
// holds other files, and a checkpoint file's name (manifest.json, a rank file, the tracker) would
// replace that file.
void check_out_outside_checkpoints(const std::string& out) {
  const auto place = checkpoint_history::checkpoint_place_of(out);
  if (!place) return;
  std::error_code ec;
  const bool is_it = fs::equivalent(out, place->dir, ec);
  // Say so when the path reaches the checkpoint through a link or '..' rather than by its name.
  const std::string lexical = fs::absolute(out, ec).lexically_normal().string();
  const bool by_name = lexical == place->dir || lexical.starts_with(place->dir + "/");
  MXDDP_FAIL("--out '{}' {} the {} '{}'{}: saves there replace and prune what it holds (deleting the export), and an "
             "export there would replace a checkpoint's own files (manifest.json, rank files, the tracker). Give a "
             "path outside every checkpoint and checkpoint history", out, is_it ? "is" : "is inside", place->kind, place->dir,
             by_name ? "" : " (links and '..' resolved)");
}

// An existing --out is replaced only when it is a previous export (it carries the export's mark)
// and --overwrite asks for it; a file or directory the export did not write is never replaced.
void check_out_replaceable(const CkptExportArgs& a) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(a.out, ec))) return;
  if (a.format == "hf") {
    check_hf_output_dir(a.out);  // new, empty, or a previous export as it wrote it
    if (fs::is_empty(a.out, ec)) return;
  } else {
    check_output_file_path(a.out, "--out");  // a regular file, not a link or a directory
    MXDDP_CHECK(is_marked_export(a.out, "safetensors"),
                "--out '{}' exists and is not a file `mxddp ckpt export` wrote (it lacks the mark {} = safetensors "
                "in a safetensors __metadata__): an export never replaces a file it did not write. Give a new name "
                "or move the file away", a.out, kExportMarkerKey);
  }
  MXDDP_CHECK(a.overwrite, "--out '{}' holds a previous export (`mxddp ckpt export` wrote it): pass --overwrite to "
              "replace it, or give a new name", a.out);
}

// Paragraphs wrapped at `width` columns (CLI11 prints a footer as it is).
std::string wrap(const std::string& text, size_t width) {
  std::string out, line;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find_first_of(" \n", start), text.size());
    const std::string word = text.substr(start, end - start);
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    if (end < text.size() && text[end] == '\n') {
      out += line + "\n";
      line.clear();
    }
    start = end + 1;
  }
  return out + line;
}

// --format hf: the two files of a Hugging Face GPT-2 directory, written as one step.
void export_hf(const CkptExportArgs& a, const CheckpointParams& params) {
  const HfGpt2Export files = encode_hf_gpt2(
      params, {.values = a.dtype == "model" ? HfExportValues::kModel : HfExportValues::kMain, .eos_token_id = a.eos_token_id});
  write_hf_gpt2(a.out, files);
  const CheckpointInfo& info = params.info;
  const auto iteration = info.metadata.find("iteration");
  std::printf("exported checkpoint %s (%sstep %lld) to %s as a Hugging Face GPT-2 directory (config.json, "
              "model.safetensors: %zu bytes): %s\n",
              info.dir.c_str(),
              iteration != info.metadata.end() ? fmt::format("iteration {}, ", iteration->second).c_str() : "",
              static_cast<long long>(info.step), a.out.c_str(), files.safetensors.size(), files.values.c_str());
}

}  // namespace

std::string checkpoint_dir_to_read(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "latest_checkpointed_iteration.txt", ec)) return resolve_checkpoint_dir(dir);
  // A history whose first save was interrupted has neither the tracker nor a manifest: say so,
  // naming the iter_NNNNNNN.partial it left, rather than that manifest.json is missing.
  if (!fs::exists(fs::path(dir) / "manifest.json", ec) && fs::is_directory(dir, ec))
    for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec))
      if (entry.path().filename().string().ends_with(".partial")) return resolve_checkpoint_dir(dir);
  return dir;
}

CLI::App* add_ckpt_export_command(CLI::App& ckpt, CkptExportArgs& args) {
  auto* cmd = ckpt.add_subcommand("export", "Write a checkpoint's params, whole and shaped, to one safetensors file");
  cmd->footer(wrap(std::string(kHelp) + kQkvLayout + ".", 100));
  cmd->add_option("dir", args.dir, "Checkpoint directory (or a --save directory: its newest checkpoint)")->required();
  cmd->add_option("--out", args.out, "The safetensors file to write (a regular file or a new name)")->required();
  cmd->add_option("--dtype", args.dtype,
                  "--format safetensors: f32 (default; the main params as they are) or bf16 (rounded to nearest "
                  "even). --format hf: model (default; the values mxddp evaluates with: the bf16 model params, "
                  "stored as F32) or f32 (the main params)");
  cmd->add_option("--format", args.format,
                  "safetensors (one file, mxddp's names) or hf (--out is a directory that Hugging Face's "
                  "GPT2LMHeadModel.from_pretrained loads: config.json, model.safetensors; docs/hf.md)")
      ->check(CLI::IsMember({"safetensors", "hf"}))
      ->capture_default_str();
  cmd->add_flag("--overwrite", args.overwrite,
               "Replace --out when it holds a previous export (a file or directory `mxddp ckpt export` wrote, which "
               "carries its mark); anything else at --out is never replaced");
  cmd->add_option("--eos-token-id", args.eos_token_id,
                  "--format hf: bos_token_id and eos_token_id in config.json (default: 50256, GPT-2's <|endoftext|>, "
                  "when the vocabulary holds it; otherwise null)");
  return cmd;
}

void run_ckpt_export(const CkptExportArgs& args) {
  CkptExportArgs a = args;
  const bool hf = a.format == "hf";
  if (a.dtype.empty()) a.dtype = hf ? "model" : "f32";
  // The flags and the output path first: a bad one fails before the checkpoint is read.
  if (hf) {
    MXDDP_CHECK(a.dtype == "model" || a.dtype == "f32", "--dtype '{}' is not valid with --format hf: give model (the "
                "values mxddp evaluates with) or f32 (the main params)", a.dtype);
  } else {
    MXDDP_CHECK(a.dtype == "f32" || a.dtype == "bf16", "--dtype '{}' is not valid: give f32 or bf16", a.dtype);
    MXDDP_CHECK(!a.eos_token_id, "--eos-token-id is for --format hf (config.json)");
  }
  check_out_outside_checkpoints(a.out);
  if (hf) check_hf_output_dir(a.out);
  else check_output_file_path(a.out, "--out");
  const DType dtype = a.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  {
    std::error_code ec;
    const bool any = fs::exists(fs::symlink_status(a.dir, ec)) || fs::exists(a.dir + ".partial", ec) ||
                     fs::exists(a.dir + ".old", ec);
    MXDDP_CHECK(any, "checkpoint directory '{}' does not exist", a.dir);
  }
  check_out_replaceable(a);

  // The checkpoint layer's checks while reading, then the GPT's (the param list its saved model
  // config implies): what `mxddp ckpt inspect` runs, read again when a save changed the history.
  CheckpointParams params;
  checkpoint_history::read_while_unchanged(a.dir, [&] {
    params = read_checkpoint_params(checkpoint_dir_to_read(a.dir));
    const std::vector<std::string> gpt_problems = gpt_checkpoint_problems(params.info);
    MXDDP_CHECK(gpt_problems.empty(), "checkpoint '{}' is damaged: {}", params.info.dir, fmt::join(gpt_problems, "; "));
    return true;
  });

  check_out_replaceable(a);  // again: the read takes a while, and --out may have appeared meanwhile
  if (hf) return export_hf(a, params);
  std::map<std::string, std::string> extra;
  if (!params.info.model_config.empty()) extra["mxddp_qkv_layout"] = kQkvLayout;
  std::vector<char> bytes = encode_checkpoint_params_safetensors(params, dtype, extra);
  int64_t numel = 0;
  for (const CheckpointParamInfo& p : params.info.params) numel += p.shape.numel();
  const CheckpointInfo& info = params.info;
  const auto iteration = info.metadata.find("iteration");
  const std::string when = (iteration != info.metadata.end() ? fmt::format("iteration {}, ", iteration->second) : "") +
                           fmt::format("step {}, saved at dp {}", info.step, info.saved_dp);
  params.values = {};  // the encoded file is all that is needed now
  write_output_file(a.out, std::string_view(bytes.data(), bytes.size()), "--out");
  std::printf("exported %zu params (%lld values, %s) of checkpoint %s (%s) to %s: %zu bytes\n", info.params.size(),
              static_cast<long long>(numel), a.dtype.c_str(), info.dir.c_str(), when.c_str(), a.out.c_str(),
              bytes.size());
}

}  // namespace mxddp::app
