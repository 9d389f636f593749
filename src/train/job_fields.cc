// train_job_fields (train.h): what every rank of an `mxddp train` job must agree on, named as the
// user gives it (the flag), for check_same_job (launch_check.h). The described configs' fields come
// from their descriptions (config_fields.h), so a field added there is checked here too.
#include <algorithm>

#include <mxddp/launch_check.h>
#include <mxddp/train.h>

namespace mxddp {

namespace {

std::string value_text(const FieldValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::nullptr_t>) return "(unset)";
        else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        // A float field widened to double reads as the float it is ("0.001", not 0.0010000000474974513).
        else if constexpr (std::is_same_v<T, double>)
          return static_cast<double>(static_cast<float>(x)) == x ? fmt::format("{}", static_cast<float>(x))
                                                                  : fmt::format("{}", x);
        else if constexpr (std::is_same_v<T, std::string>) return x;
        else return std::to_string(x);
      },
      v);
}

// A described field's name for the user: its first flag ("--bucket-size,--ddp-bucket-size" gives
// "--bucket-size"), or section.name where the command sets it.
template <typename Field>
std::string field_label(const Field& field, std::string_view section) {
  if (!field.has_flag()) return fmt::format("{}.{}", section, field.name);
  std::string_view first = field.flags.substr(0, field.flags.find(','));
  if (first.starts_with('!')) first.remove_prefix(1);
  return std::string(first);
}

template <typename Config>
void add_described(std::vector<JobField>& out, const Config& config, std::string_view section) {
  for_each_field(config, [&](const auto& field, const auto& value) {
    out.push_back({field_label(field, section), value_text(field_value(value))});
  });
}

}  // namespace

std::vector<JobField> train_job_fields(const TrainConfig& c) {
  std::vector<JobField> out;
  add_described(out, c.model, "model");
  auto add = [&](std::string name, FieldValue value) { out.push_back({std::move(name), value_text(value)}); };
  add("--recompute-granularity", std::string(recompute_granularity_name(c.recompute_granularity)));
  add("--recompute-modules", recompute_modules_names(c.recompute_modules));
  add("--bf16", c.bf16);
  add("--micro-batch-size", int64_t{c.micro_batch_size});
  add("--global-batch-size", int64_t{c.global_batch_size});
  add("--train-iters", c.train_iters);
  add("--lr", static_cast<double>(c.lr));
  add("--min-lr", static_cast<double>(c.min_lr));
  add("--lr-warmup-iters", c.lr_warmup_iters);
  add("--lr-decay-iters", c.lr_decay_iters);
  add("--lr-decay-style", std::string(lr_decay_style_name(c.lr_decay_style)));
  add_described(out, c.optimizer, "optimizer");
  add_described(out, c.ddp, "ddp");
  add("--use-megatron-fsdp", c.use_megatron_fsdp);
  if (c.use_megatron_fsdp) add_described(out, c.fsdp, "fsdp");
  add("--check-for-nan-in-loss-and-grad", c.check_for_nan_in_loss_and_grad);
  add("--check-weight-hash-across-dp-replicas-interval", c.check_weight_hash_across_dp_replicas_interval);
  add("--seed", static_cast<int64_t>(c.seed));
  add("--data", c.data_path);
  if (c.data_path.empty() && c.data_blend.empty()) add("--corpus-bytes", c.corpus_bytes);
  add("--valid-fraction", c.valid_fraction);
  std::string blend;
  for (const DataBlendEntry& e : c.data_blend) blend += fmt::format("{}{} {}", blend.empty() ? "" : " ", e.weight, e.prefix);
  add("--data-path", blend);
  if (!c.data_blend.empty()) add("--split", fmt::format("{},{},{}", c.split[0], c.split[1], c.split[2]));
  add("--vocab-size", c.tokenizer_vocab_size);
  add("the tokenizer's end-of-document id", c.eod_id);
  add("--eval-interval", c.eval_interval);
  add("--eval-iters", int64_t{c.eval_iters});
  add("--save", c.save_dir);
  add("--save-interval", c.save_interval);
  add("--keep-last", int64_t{c.keep_last});
  add("--load", c.load_dir);
  add("--load-hf", c.load_hf_dir);
  add("--skip-train", c.skip_train);
  add("--exit-interval", c.exit_interval);
  add("--exit-duration-in-mins", c.exit_duration_in_mins);
  // The fields DDP and FSDP share are one flag each (FSDP's copies of DDP's): list each once.
  std::vector<JobField> unique;
  for (JobField& f : out)
    if (std::none_of(unique.begin(), unique.end(), [&](const JobField& u) { return u.name == f.name; }))
      unique.push_back(std::move(f));
  return unique;
}

}  // namespace mxddp
