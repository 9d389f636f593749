// megatron_flags.h: Megatron's spellings, applied or noted.
#include "megatron_flags.h"

#include <mxddp/core.h>

#include "cli_checks.h"

namespace mxddp::app {

namespace {

struct NotedFlag {
  const char* name;
  bool takes_value;
  const char* note;  // why it changes nothing here
};

// Always on here, or about machinery mxddp does not have.
constexpr NotedFlag kNotedFlags[] = {
    {"--use-distributed-optimizer", false, "always on: mxddp's optimizer is the distributed one"},
    {"--accumulate-allreduce-grads-in-fp32", false, "always on: gradients accumulate in F32 main_grad and are reduced in F32"},
    {"--use-mcore-models", false, "mxddp's GPT is its own model"},
    {"--no-gradient-accumulation-fusion", false, "nothing to turn off: weight gradients accumulate into main_grad directly"},
    {"--use-flash-attn", false, "attention is flash-style already (block-causal, no T x T probabilities kept)"},
    {"--sequence-parallel", false, "no tensor parallelism, so no sequence parallelism"},
    {"--tensorboard-dir", true, "no TensorBoard: --metrics-file writes JSON lines as training goes, scripts/plot_metrics.py draws them"},
    {"--wandb-project", true, "no Weights & Biases: --metrics-file writes JSON lines as training goes"},
    {"--num-workers", true, "batches are cut from memory in the training thread"},
    {"--distributed-backend", true, "mxddp's backends are local (threads) and mpi, chosen by --backend or by the launcher"},
    {"--transformer-impl", true, "mxddp's GPT runs its own kernels"},
    {"--max-position-embeddings", true, "position embeddings are --seq-length long"},
};

constexpr const char* kParallelSizes[] = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                          "--context-parallel-size", "--expert-model-parallel-size"};

}  // namespace

void add_megatron_flags(CLI::App* cmd, MegatronFlags& flags) {
  auto* group = cmd->add_option_group("Megatron's spellings (applied, or accepted with a note where they change nothing here)");
  group->add_option("--ddp-num-buckets", flags.ddp_num_buckets,
                    "Bucket size = params / N, as Megatron computes it (not with --ddp-bucket-size)")
      ->transform(integer_in(1, int64_t{1} << 40));
  for (const char* name : kParallelSizes)
    group->add_option_function<int64_t>(
             name, [&flags, name](const int64_t& v) { flags.parallel_sizes[name] = v; },
             "Accepted as 1 (mxddp is data-parallel only)")
        ->transform(integer_in(1, int64_t{1} << 30));
  for (const NotedFlag& f : kNotedFlags) {
    const std::string name = f.name;
    if (f.takes_value)
      group->add_option_function<std::string>(
          name, [&flags, name](const std::string& v) { flags.given[name] = v; }, std::string("Ignored: ") + f.note);
    else
      group->add_flag_callback(name, [&flags, name] { flags.given[name] = ""; }, std::string("Ignored: ") + f.note);
  }
}

std::vector<std::string> apply_megatron_flags(const MegatronFlags& flags, int64_t num_params, bool bucket_size_given,
                                              std::optional<int64_t>& bucket_size) {
  for (const auto& [name, size] : flags.parallel_sizes)
    MXDDP_CHECK(size == 1, "{} {}: mxddp is data-parallel only; valid: 1", name, size);
  std::vector<std::string> notes;
  if (flags.ddp_num_buckets) {
    MXDDP_CHECK(!bucket_size_given, "--ddp-num-buckets {} and --ddp-bucket-size both set the bucket size; give one",
                *flags.ddp_num_buckets);
    bucket_size = std::max<int64_t>(1, num_params / *flags.ddp_num_buckets);
    notes.push_back(fmt::format("--ddp-num-buckets {}: bucket size {} elements ({} params / {}, as Megatron)",
                                *flags.ddp_num_buckets, *bucket_size, num_params, *flags.ddp_num_buckets));
  }
  for (const auto& [name, size] : flags.parallel_sizes) notes.push_back(fmt::format("{} {}: the only size mxddp runs", name, size));
  for (const NotedFlag& f : kNotedFlags) {
    const auto it = flags.given.find(f.name);
    if (it != flags.given.end())
      notes.push_back(fmt::format("{}{}{} is accepted and changes nothing here: {}", f.name, it->second.empty() ? "" : " ",
                                  it->second, f.note));
  }
  return notes;
}

}  // namespace mxddp::app
