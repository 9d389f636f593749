// `mxddp plan`: what each rank of a `mxddp train` run will hold, per category, to the byte, before
// running (plan.h), beside Megatron's and DeepSpeed's closed-form estimates and what the difference
// is made of; or, with --fit BYTES, the smallest data-parallel size and the options that fit a rank
// in that budget, cheapest communication first. It takes every flag `mxddp train` takes.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "train_cmd.h"

namespace mxddp::app {

struct PlanArgs {
  TrainArgs train;            // every flag of mxddp train; --ranks is the data-parallel size
  int64_t dp = 0;             // --dp: the data-parallel size, beyond --ranks' local range (0: --ranks)
  // --num-distributed-optimizer-instances (Megatron's flag): HSDP's replica groups, each a shard
  // group of dp / it ranks (FSDP only; --shapes / --safetensors, since mxddp train has no HSDP).
  int64_t num_distributed_optimizer_instances = 1;
  int64_t ranks_per_node = 0; // --ranks-per-node: ranks sharing a machine's cores (0: all, as the local backend)
  std::string shapes;         // --shapes: a param list instead of the GPT ("95x95,95", as layout takes)
  std::string safetensors;    // --safetensors FILE: the param list of a safetensors file's header
  std::string fit;            // --fit BYTES: "80GiB", "96e9", ...
  // --device: where the DDP's or FSDP's buffers and the optimizer's state live ("cpu" or "cuda": a
  // rank on a GPU, as mxddp.torch and the device communicators put them; --shapes / --safetensors).
  std::string device = "cpu";
  int64_t fit_max_dp = 65536;
  bool json = false;
};

CLI::App* add_plan_command(CLI::App& app, PlanArgs& args);
// Prints the plan (or the fit) to stdout; throws Error on bad arguments.
void run_plan_command(PlanArgs& args);

// "80GiB", "80 GiB", "96GB", "1.5e12", "4096" -> bytes. Throws Error naming the text and what is
// valid (a non-negative number, optionally with B, KB/MB/GB/TB (10^3k), KiB/MiB/GiB/TiB (2^10k)).
int64_t parse_byte_size(const std::string& text, std::string_view what);

}  // namespace mxddp::app
