// `mxddp ckpt inspect` and the dispatch of `mxddp ckpt`: see ckpt_cmd.h.
#include "ckpt_cmd.h"

#include <algorithm>
#include <cstdio>
#include <string_view>

#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>
#include <mxddp/checkpoint_history.h>
#include <mxddp/train.h>

namespace mxddp::app {

CLI::App* add_ckpt_command(CLI::App& app, CkptArgs& args) {
  auto* ckpt = app.add_subcommand("ckpt", "Checkpoint tools");
  ckpt->require_subcommand(1);
  auto* inspect = ckpt->add_subcommand("inspect", "Print what a checkpoint holds and verify all of it");
  inspect->add_option("dir", args.dir, "Checkpoint directory (or a --save directory: its newest checkpoint)")->required();
  inspect->add_flag("--json", args.json, "Print one JSON object (the same content and problems) instead of text");
  args.export_cmd = add_ckpt_export_command(*ckpt, args.export_args);
  return ckpt;
}

int run_ckpt_command(const CkptArgs& args) {
  if (args.export_cmd->parsed()) {
    run_ckpt_export(args.export_args);
    return 0;
  }
  return run_ckpt_inspect(args);
}

namespace {

// The checkpoint layer's checks and the GPT's (the param list its saved model config implies),
// read again when another run's save changed the history meanwhile (a file it removed is not damage).
CheckpointInfo inspect(const std::string& dir) {
  CheckpointInfo info;
  checkpoint_history::read_while_unchanged(dir, [&] {
    info = inspect_checkpoint(checkpoint_dir_to_read(dir));
    for (std::string& problem : gpt_checkpoint_problems(info)) info.problems.push_back(std::move(problem));
    return info.ok();
  });
  return info;
}

int print_json(const CkptArgs& args) {
  try {
    const CheckpointInfo info = inspect(args.dir);
    std::printf("%s\n", checkpoint_info_json(info).c_str());
    return info.ok() ? 0 : 1;
  } catch (const Error& e) {
    // The manifest itself cannot be trusted: still one JSON object, with the reason.
    const nlohmann::json j = {{"dir", args.dir}, {"ok", false}, {"problems", {e.message()}}};
    std::printf("%s\n", j.dump(1).c_str());
    return 1;
  }
}

}  // namespace

int run_ckpt_inspect(const CkptArgs& args) {
  if (args.json) return print_json(args);
  const CheckpointInfo info = inspect(args.dir);
  std::printf("checkpoint %s: step %lld, saved at dp %d, optimizer %s, model params %s\n", info.dir.c_str(),
              static_cast<long long>(info.step), info.saved_dp, info.optimizer.c_str(), info.param_dtype.c_str());
  for (const auto& [key, value] : info.metadata) std::printf("  metadata %s = %s\n", key.c_str(), value.c_str());
  for (const auto& [key, value] : info.model_config) std::printf("  model %s = %s\n", key.c_str(), value.c_str());
  // Column widths from the longest entry: GPT names such as
  // decoder.layers.11.self_attention.linear_proj.weight (51 characters) outgrow any fixed width.
  size_t name_w = std::string_view("param").size(), shape_w = std::string_view("shape").size();
  size_t dtype_w = std::string_view("dtype").size();
  for (const CheckpointParamInfo& p : info.params) {
    name_w = std::max(name_w, p.name.size());
    shape_w = std::max(shape_w, p.shape.to_string().size());
    dtype_w = std::max(dtype_w, p.dtype.size());
  }
  const int nw = static_cast<int>(name_w), sw = static_cast<int>(shape_w), dw = static_cast<int>(dtype_w);
  int64_t numel = 0;
  std::printf("\n%-*s  %-*s  %-*s  %6s\n", nw, "param", sw, "shape", dw, "dtype", "slices");
  for (const CheckpointParamInfo& p : info.params) {
    std::printf("%-*s  %-*s  %-*s  %6d\n", nw, p.name.c_str(), sw, p.shape.to_string().c_str(), dw, p.dtype.c_str(),
                p.slices);
    numel += p.shape.numel();
  }
  size_t file_w = std::string_view("file").size(), bytes_w = std::string_view("bytes").size();
  for (const CheckpointFileInfo& f : info.files) {
    file_w = std::max(file_w, f.name.size());
    bytes_w = std::max(bytes_w, std::to_string(f.size_bytes).size());
  }
  const int fw = static_cast<int>(file_w), bw = static_cast<int>(bytes_w);
  std::printf("%lld params in %zu tensors\n\n%-*s  %*s  %-8s  %s\n", static_cast<long long>(numel), info.params.size(),
              fw, "file", bw, "bytes", "crc32", "status");
  for (const CheckpointFileInfo& f : info.files)
    std::printf("%-*s  %*lld  %08x  %s\n", fw, f.name.c_str(), bw, static_cast<long long>(f.size_bytes), f.crc32,
                f.status == "ok" ? "ok" : "DAMAGED (see below)");
  if (info.ok()) {
    std::printf("\nall files intact: manifest checksum, file sizes and CRC-32s, tensor dtypes and sizes, and the "
                "coverage of every param verified%s\n",
                info.model_config.empty() ? "" : "; the param list is the one the saved model config implies");
    return 0;
  }
  std::printf("\nDAMAGED: %zu problem(s):\n", info.problems.size());
  for (const std::string& p : info.problems) std::printf("  - %s\n", p.c_str());
  return 1;
}

}  // namespace mxddp::app
