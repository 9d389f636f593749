// `mxddp data`: see data_cmd.h.
#include "data_cmd.h"

#include <cstdio>
#include <limits>

#include <fmt/ranges.h>

#include <mxddp/data.h>
#include <mxddp/train.h>

#include "cli_checks.h"

namespace mxddp::app {

CLI::App* add_data_command(CLI::App& app, DataArgs& a) {
  auto* cmd = app.add_subcommand("data", "Print the samples mxddp train reads from Megatron indexed datasets");
  cmd->option_defaults()->always_capture_default();
  add_data_flags(cmd, a.data);
  auto* which = cmd->add_option_group("which samples");
  which->add_option("--seq-length", a.seq_length, "Tokens per sample, less one (as train's --seq-length)")
      ->transform(integer_in(1, std::numeric_limits<int>::max()));
  which->add_option("--seed", a.seed, "The run's --seed (it seeds the shuffles)")
      ->transform(unsigned_in(0, std::numeric_limits<uint64_t>::max()));
  which->add_option("--split-name", a.split, "train, valid or test")->check(CLI::IsMember({"train", "valid", "test"}));
  which->add_option("--first", a.first, "First sample number of the split's stream")
      ->transform(integer_in(0, int64_t{1} << 50));
  which->add_option("--count", a.count, "Samples to print")->transform(integer_in(1, int64_t{1} << 20));
  return cmd;
}

void run_data_command(DataArgs& a) {
  TrainConfig c;
  c.model.seq_length = a.seq_length;
  c.seed = a.seed;
  apply_data_flags(a.data, c);
  MXDDP_CHECK(!c.data_blend.empty(), "mxddp data reads Megatron indexed datasets: give --data-path PREFIX (or a blend)");
  // The options train's TrainData gives the blend: the same samples.
  const BlendedGptDataset data(BlendedGptDatasetOptions{.blend = c.data_blend,
                                                        .split = c.split,
                                                        .seq_length = c.model.seq_length,
                                                        .seed = c.seed,
                                                        .vocab_size = c.vocab_size_for_data()});
  const DataSplit split = a.split == "train" ? DataSplit::kTrain : a.split == "valid" ? DataSplit::kValid : DataSplit::kTest;
  std::fprintf(stderr, "mxddp data: %s\n", data.describe().c_str());  // stdout stays JSON
  std::vector<int32_t> tokens(static_cast<size_t>(a.seq_length) + 1);
  std::printf("{\"split\": \"%s\", \"first\": %lld, \"samples\": [\n", a.split.c_str(), static_cast<long long>(a.first));
  for (int64_t s = a.first; s < a.first + a.count; ++s) {
    data.fill(split, s, 1, tokens.data());
    std::printf("[%s]%s\n", fmt::format("{}", fmt::join(tokens, ", ")).c_str(), s + 1 < a.first + a.count ? "," : "");
  }
  std::printf("]}\n");
}

}  // namespace mxddp::app
