// `mxddp train --report`: see train_report.h.
#include "train_report.h"

#include <algorithm>
#include <cstdio>
#include <variant>

#include <nlohmann/json.hpp>

#include <mxddp/output_file.h>

namespace mxddp::app {

namespace {

nlohmann::json fine_grained_json(const TrainConfig& c) {
  const FineGrainedParamGatherDecision d = c.fine_grained_param_gather();
  return {{"on", d.on}, {"required", d.required}, {"reason", d.reason}};
}

nlohmann::json recompute_module_list(const RecomputeModules& modules) {
  nlohmann::json list = nlohmann::json::array();
  for (RecomputeModule m : modules) list.push_back(std::string(recompute_module_name(m)));
  return list;
}

// A described config (config_fields.h) as a JSON object: every field under its name, as the
// checkpoint manifest writes it.
template <typename Config>
nlohmann::json fields_json(const Config& config) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, value] : field_values(config))
    std::visit([&j, key = std::string(name)](const auto& v) { j[key] = v; }, value);
  return j;
}

// "builtin", the text file's path, or the indexed datasets with their (given) weights.
nlohmann::json data_json(const TrainConfig& c) {
  if (c.data_blend.empty()) return c.data_path.empty() ? nlohmann::json("builtin") : nlohmann::json(c.data_path);
  nlohmann::json blend = nlohmann::json::array();
  for (const DataBlendEntry& e : c.data_blend) blend.push_back({{"weight", e.weight}, {"prefix", e.prefix}});
  return blend;
}

nlohmann::json config_json(const TrainConfig& c, int dp, const std::string& backend) {
  nlohmann::json model = fields_json(c.model);
  model["num_params"] = c.model.num_params();
  model["train_flops_per_token"] = c.model.train_flops_per_token();
  // What train() runs with: the schedule's peak lr (the optimizer's changes every iteration) and
  // the distributed optimizer, always on.
  OptimizerConfig optimizer = c.optimizer;
  optimizer.lr = c.lr;
  DdpConfig ddp = c.ddp;
  ddp.use_distributed_optimizer = true;
  nlohmann::json fsdp = fields_json(c.fsdp);
  // What the policy decided, and why (the flag alone does not say: the policy may force it).
  fsdp["fine_grained_param_gather"] = fine_grained_json(c);
  return {
      {"backend", backend},
      {"dp", dp},
      {"model", std::move(model)},
      // Megatron's names and values: null granularity = no recompute.
      {"recompute_granularity", c.recompute_granularity == RecomputeGranularity::kNone
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(std::string(recompute_granularity_name(c.recompute_granularity)))},
      {"recompute_modules", recompute_module_list(c.recompute_modules)},
      {"bf16", c.bf16},
      {"check_for_nan_in_loss_and_grad", c.check_for_nan_in_loss_and_grad},
      {"check_weight_hash_across_dp_replicas_interval", c.check_weight_hash_across_dp_replicas_interval},
      {"compute_threads", c.compute_threads},
      {"micro_batch_size", c.micro_batch_size},
      {"global_batch_size", c.global_batch_size},
      {"accumulation_steps", c.accumulation_steps(dp)},
      {"train_iters", c.train_iters},
      {"lr", c.lr},
      {"min_lr", c.min_lr},
      {"lr_warmup_iters", c.lr_warmup_iters},
      {"lr_decay_iters", c.lr_decay_iters},
      {"lr_decay_style", std::string(lr_decay_style_name(c.lr_decay_style))},
      {"optimizer", fields_json(optimizer)},
      {"ddp", fields_json(ddp)},
      {"use_megatron_fsdp", c.use_megatron_fsdp},
      {"fsdp", std::move(fsdp)},
      {"seed", c.seed},
      {"data", data_json(c)},
      {"split", c.data_blend.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.split)},
      {"tokenizer_vocab_size", c.vocab_size_for_data()},
      {"eod_id", c.eod_id},
      {"corpus_bytes", c.corpus_bytes},
      {"valid_fraction", c.valid_fraction},
      {"eval_interval", c.eval_interval},
      {"eval_iters", c.eval_iters},
      {"save", c.save_dir},
      {"save_interval", c.save_interval},
      {"load", c.load_dir},
      {"load_hf", c.load_hf_dir},
      {"skip_train", c.skip_train},
  };
}

}  // namespace

nlohmann::json memory_usage_json(const MemoryUsage& u) {
  nlohmann::json j;
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    const auto c = static_cast<MemoryCategory>(k);
    j[std::string(memory_category_name(c))] = {{"live_bytes", u.live(c)}, {"peak_bytes", u.peak(c)}};
  }
  j["total"] = {{"live_bytes", u.total_live_bytes}, {"peak_bytes", u.total_peak_bytes}};
  return j;
}

void write_train_report(const std::string& path, const TrainConfig& config, const TrainResult& r, int dp,
                        const std::string& backend) {
  nlohmann::json j;
  j["config"] = config_json(config, dp, backend);
  // What the products ran on; written from rank 0's thread after training, so threads is what
  // that rank computed with.
  const ComputeInfo compute = compute_info();
  j["compute"] = {{"library", compute.library},
                  {"cpu", compute.cpu},
                  {"isa", compute.isa},
                  {"f32_kernel", compute.f32_kernel},
                  {"bf16_kernel", compute.bf16_kernel},
                  {"bf16_supported", compute.bf16_supported},
                  {"bf16", config.bf16},
                  {"products_in_bf16", config.bf16 && compute.bf16_supported},
                  {"threads_per_rank", compute.threads},
                  {"summary", compute.describe(config.bf16)}};
  j["start_iteration"] = r.start_iteration;
  j["start_consumed_samples"] = r.start_consumed_samples;
  j["unigram_entropy_nats"] = r.unigram_entropy;
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRecord& s : r.steps)
    steps.push_back({{"iteration", s.iteration},
                     {"consumed_samples", s.consumed_samples},
                     {"loss", s.loss},
                     {"lr", s.lr},
                     {"grad_norm", s.grad_norm},
                     {"skipped", s.skipped},
                     {"forward_ms", s.forward_ms},
                     {"backward_ms", s.backward_ms},
                     {"exposed_comm_ms", s.comm_ms},
                     {"optimizer_ms", s.optimizer_ms},
                     {"step_ms", s.step_ms}});
  j["steps"] = std::move(steps);
  j["skipped_steps"] = std::count_if(r.steps.begin(), r.steps.end(), [](const StepRecord& s) { return s.skipped; });
  // One array per split evaluated: "validation" always (maybe empty), others (--skip-train's) when evaluated.
  j["validation"] = nlohmann::json::array();
  for (const EvalRecord& e : r.evals) j[e.split].push_back({{"iteration", e.iteration}, {"loss", e.loss}});
  j["throughput"] = {{"tokens_per_iteration", r.tokens_per_iteration},
                     {"tokens_per_second", r.tokens_per_second},
                     {"model_flops_per_second", r.tokens_per_second * config.model.train_flops_per_token()},
                     {"train_seconds", r.train_seconds}};
  nlohmann::json memory = nlohmann::json::array();
  for (size_t rank = 0; rank < r.memory_by_rank.size(); ++rank) {
    const RankMemory& m = r.memory_by_rank[rank];
    memory.push_back({{"rank", rank},
                      // FSDP's gathered params at their peak (optim_grads_params; fine-grained lowers it).
                      {"peak_gathered_bytes", m.overall.peak(MemoryCategory::kGathered)},
                      // ... and each slot's own peak: BF16 values, MXFP8 row-wise (forward, recompute)
                      // and column-wise (backward).
                      {"peak_gathered_bytes_by_orientation",
                       {{"values", m.peak_gathered_bytes_by_slot[0]},
                        {"rowwise", m.peak_gathered_bytes_by_slot[1]},
                        {"colwise", m.peak_gathered_bytes_by_slot[2]}}},
                      {"overall", memory_usage_json(m.overall)},
                      {"steady_state", memory_usage_json(m.steady)},
                      {"scratch_allocations_after_warmup", m.scratch_allocations_after_warmup}});
  }
  j["memory"] = std::move(memory);

  write_output_file(path, j.dump(2) + "\n", "--report");
}

}  // namespace mxddp::app
