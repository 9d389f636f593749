// `mxddp ckpt inspect`: see ckpt_cmd.h.
#include "ckpt_cmd.h"

#include <cstdio>

#include <mxddp/checkpoint.h>

namespace mxddp::app {

CLI::App* add_ckpt_command(CLI::App& app, CkptArgs& args) {
  auto* ckpt = app.add_subcommand("ckpt", "Checkpoint tools");
  ckpt->require_subcommand(1);
  auto* inspect = ckpt->add_subcommand("inspect", "Print what a checkpoint holds and verify its files");
  inspect->add_option("dir", args.dir, "Checkpoint directory")->required();
  return inspect;
}

int run_ckpt_inspect(const CkptArgs& args) {
  const CheckpointInfo info = inspect_checkpoint(args.dir);
  std::printf("checkpoint %s: step %lld, saved at dp %d, optimizer %s\n", args.dir.c_str(),
              static_cast<long long>(info.step), info.saved_dp, info.optimizer.c_str());
  for (const auto& [key, value] : info.metadata) std::printf("  metadata %s = %s\n", key.c_str(), value.c_str());
  int64_t numel = 0;
  std::printf("\n%-40s %-20s %8s\n", "param", "shape", "slices");
  for (const CheckpointParamInfo& p : info.params) {
    std::printf("%-40s %-20s %8d\n", p.name.c_str(), p.shape.to_string().c_str(), p.slices);
    numel += p.shape.numel();
  }
  std::printf("%lld params in %zu tensors\n\n%-28s %14s %10s  %s\n", static_cast<long long>(numel), info.params.size(),
              "file", "bytes", "crc32", "status");
  for (const CheckpointFileInfo& f : info.files)
    std::printf("%-28s %14lld   %08x  %s\n", f.name.c_str(), static_cast<long long>(f.size_bytes), f.crc32,
                f.status.c_str());
  std::printf("\n%s\n", info.ok() ? "all files intact" : "DAMAGED: see the file list");
  return info.ok() ? 0 : 1;
}

}  // namespace mxddp::app
