// `mxddp train --load-hf` and `--skip-train`: see hf_train_flags.h.
#include "hf_train_flags.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include <mxddp/hf.h>

#include "cli_checks.h"

namespace mxddp::app {

void add_hf_train_flags(CLI::App* group, TrainArgs& a) {
  group->add_option("--load-hf", a.config.load_hf_dir,
                    "Start from a Hugging Face GPT-2 directory (save_pretrained: config.json, model.safetensors) at "
                    "iteration 0; the model is its config (docs/hf.md)")
      ->transform(non_empty_path());
  group->add_flag("--skip-train", a.config.skip_train,
                  "Train nothing: evaluate the --load'ed (or --load-hf'ed) params on the validation split (and the test split of indexed data), "
                  "--eval-iters global batches, and report the losses (Megatron's flag)");
}

std::vector<std::string> apply_load_hf(TrainArgs& a) {
  if (a.config.load_hf_dir.empty()) return {};
  const HfGpt2Config hf = read_hf_gpt2_config(a.config.load_hf_dir);
  MXDDP_CHECK(a.model_option == nullptr || a.model_option->count() == 0,
              "--model {} and --load-hf '{}' both give the model; --load-hf's config.json is the model ({})", a.model,
              a.config.load_hf_dir, hf.model.describe());
  // The flags applied over the HF config: what they change must be only a shorter sequence.
  GptConfig m = hf.model;
  for (const auto& override_field : a.model_overrides) override_field(m);
  const auto hf_fields = hf.model.fields(), run_fields = m.fields();
  for (size_t i = 0; i < hf_fields.size(); ++i) {
    if (hf_fields[i].second == run_fields[i].second) continue;
    if (hf_fields[i].first == "seq_length") {
      MXDDP_CHECK(m.seq_length <= hf.n_positions, "--seq-length {} is longer than --load-hf '{}''s n_positions {}: "
                  "there are no position embeddings past it", m.seq_length, a.config.load_hf_dir, hf.n_positions);
      continue;
    }
    MXDDP_FAIL("a model flag sets {} to {}, but --load-hf '{}' is a model with {} {}: its config.json is the model "
               "(only --seq-length may be shorter than n_positions)", hf_fields[i].first, run_fields[i].second,
               a.config.load_hf_dir, hf_fields[i].first, hf_fields[i].second);
  }
  a.config.model = m;
  std::vector<std::string> notes;
  for (const std::string& note : hf.notes) notes.push_back(fmt::format("--load-hf: {}", note));
  return notes;
}

void print_skip_train_summary(const TrainConfig& c, const TrainResult& r) {
  const std::string what = !c.load_dir.empty()      ? fmt::format("the checkpoint --load '{}'", c.load_dir)
                           : !c.load_hf_dir.empty() ? fmt::format("the HF model --load-hf '{}'", c.load_hf_dir)
                                                    : fmt::format("the initialization (--seed {}; no --load or --load-hf)", c.seed);
  std::printf("evaluation only (--skip-train): %s at iteration %lld, %d global batches of %d per split\n", what.c_str(),
              static_cast<long long>(r.start_iteration), c.eval_iters, c.global_batch_size);
  for (const EvalRecord& e : r.evals)
    std::printf(" %s loss at iteration %lld on %s set | lm loss value: %.6E | lm loss PPL: %.6E |\n", e.split.c_str(),
                static_cast<long long>(e.iteration), e.split.c_str(), e.loss, std::exp(std::min(e.loss, 20.0)));
}

}  // namespace mxddp::app
