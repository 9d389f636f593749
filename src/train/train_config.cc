// TrainConfig's own logic (train.h): its checks, the model options and FSDP units it implies, the
// learning-rate schedule and the compute threads per rank. Apart from the training loop, so that the
// memory planner (src/plan), which takes a TrainConfig, needs only this and not the loop.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <thread>

#include <mxddp/train.h>

namespace mxddp {

int ranks_on_this_machine(const Communicator& comm) {
  if (comm.backend_name() == "local") return comm.size();
  if (const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) return std::max(1, std::atoi(s));
  return 1;
}

int rank_compute_threads(const TrainConfig& config, int ranks_on_this_machine) {
  if (config.compute_threads > 0) return config.compute_threads;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_on_this_machine));  // each rank's share of the cores
}

int rank_compute_threads(const TrainConfig& config, const Communicator& comm) {
  return rank_compute_threads(config, ranks_on_this_machine(comm));
}

FineGrainedParamGatherDecision TrainConfig::fine_grained_param_gather() const {
  if (!use_megatron_fsdp) return {.on = false, .required = false, .reason = "off: DDP (no --use-megatron-fsdp)"};
  return decide_fine_grained_param_gather({.policy = fsdp.fine_grained_param_gather_policy,
                                           .flag = fsdp.megatron_fsdp_enable_fine_grained_param_gather,
                                           .mxfp8_param_gather = ddp.fp8_param_gather,
                                           .recompute_granularity = recompute_granularity,
                                           .recompute_modules = recompute_modules});
}

GptModelOptions TrainConfig::model_options() const {
  return {.recompute_granularity = recompute_granularity, .recompute_modules = recompute_modules, .bf16 = bf16,
          .fine_grained_param_gather = fine_grained_param_gather().on};
}

void TrainConfig::validate(int dp) const {
  model.validate();
  model_options().validate();
  MXDDP_CHECK(compute_threads >= 0, "--compute-threads {} is not valid: 0 (cores / ranks on this machine) or more",
              compute_threads);
  // DDP gathers buckets, not modules: the flag would do nothing there.
  MXDDP_CHECK(use_megatron_fsdp || !fsdp.megatron_fsdp_enable_fine_grained_param_gather,
              "--{}megatron-fsdp-enable-fine-grained-param-gather needs --use-megatron-fsdp: it chooses FSDP's units",
              fsdp.megatron_fsdp_enable_fine_grained_param_gather == false ? "no-" : "");
  if (use_megatron_fsdp) {
    // DDP's own knobs mean nothing to FSDP (buckets are per unit): refuse rather than ignore them.
    MXDDP_CHECK(!ddp.reuse_grad_buf_for_mxfp8_param_ag,
                "--reuse-grad-buf-for-mxfp8-param-ag is DDP's (its param buffer is staged in the grad buffer); FSDP "
                "has no param buffer: MXFP8 params under --use-megatron-fsdp gather their row- and column-wise shards");
    MXDDP_CHECK(!ddp.fp8_param_gather || fsdp.data_parallel_sharding_strategy == ShardingStrategy::kOptimGradsParams,
                "--fp8-param-gather with --use-megatron-fsdp needs --data-parallel-sharding-strategy optim_grads_params "
                "(MXFP8 params are sharded as row- and column-wise payloads); got {}",
                sharding_strategy_name(fsdp.data_parallel_sharding_strategy));
    MXDDP_CHECK(!ddp.fp8_param_gather || fsdp.param_dtype == DType::kBF16,
                "--fp8-param-gather with --use-megatron-fsdp quantizes bf16(main params), so the params are bf16; got {}",
                dtype_name(fsdp.param_dtype));
    MXDDP_CHECK(!ddp.bucket_size && ddp.buckets_per_group == 1 && !ddp.pad_buckets_for_high_nccl_busbw,
                "--bucket-size, --buckets-per-group and --pad-buckets-for-high-nccl-busbw are DDP's: FSDP has a bucket "
                "per unit; use --suggested-communication-unit-size");
    MXDDP_CHECK(!ddp.overlap_param_gather_with_optimizer_step && !ddp.force_all_reduce && !ddp.average_in_collective &&
                    !ddp.check_for_nan_in_grad,
                "--overlap-param-gather-with-optimizer-step, --force-all-reduce, --average-in-collective and "
                "--check-for-nan-in-grad are DDP's and not supported with --use-megatron-fsdp");
  }
  MXDDP_CHECK(micro_batch_size >= 1, "--micro-batch-size {} is not valid: at least 1", micro_batch_size);
  MXDDP_CHECK(global_batch_size >= 1 && global_batch_size % (micro_batch_size * dp) == 0,
              "--global-batch-size {} is not valid: it must be a positive multiple of --micro-batch-size x "
              "data-parallel size = {} x {} = {}", global_batch_size, micro_batch_size, dp, micro_batch_size * dp);
  MXDDP_CHECK(train_iters >= 0, "--train-iters {} is not valid: 0 or more", train_iters);
  MXDDP_CHECK(std::isfinite(lr) && lr >= 0, "--lr {} is not valid: finite and >= 0", lr);
  MXDDP_CHECK(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= lr, "--min-lr {} is not valid: in [0, --lr = {}]",
              min_lr, lr);
  MXDDP_CHECK(lr_warmup_iters >= 0, "--lr-warmup-iters {} is not valid: 0 or more", lr_warmup_iters);
  MXDDP_CHECK(lr_decay_iters >= 0, "--lr-decay-iters {} is not valid: 0 (= --train-iters) or more", lr_decay_iters);
  MXDDP_CHECK(lr_decay_style == LrDecayStyle::kCosine || lr_decay_style == LrDecayStyle::kLinear ||
                  lr_decay_style == LrDecayStyle::kConstant,
              "--lr-decay-style {} is not valid: cosine, linear or constant", static_cast<int>(lr_decay_style));
  MXDDP_CHECK(eval_interval >= 0, "--eval-interval {} is not valid: 0 (only at the end) or more", eval_interval);
  MXDDP_CHECK(eval_iters >= 0, "--eval-iters {} is not valid: 0 (no evaluation) or more", eval_iters);
  MXDDP_CHECK(eval_iters == 0 || !data_blend.empty() || valid_fraction > 0,
              "--eval-iters {} needs a validation split: --valid-fraction is 0", eval_iters);
  MXDDP_CHECK(eval_iters == 0 || data_blend.empty() || split[1] > 0,
              "--eval-iters {} needs a validation split: --split gives it 0 documents' weight", eval_iters);
  MXDDP_CHECK(data_path.empty() || data_blend.empty(),
              "a text file ('{}') and indexed datasets (--data-path) are both given; give one", data_path);
  MXDDP_CHECK(tokenizer_vocab_size >= 0 && tokenizer_vocab_size <= model.vocab_size,
              "the tokenizer's vocabulary ({} tokens) is larger than the model's ({}): the model's is the "
              "tokenizer's padded up (--make-vocab-size-divisible-by)", tokenizer_vocab_size, model.vocab_size);
  MXDDP_CHECK(save_interval >= 0, "--save-interval {} is not valid: 0 (only at the end) or more", save_interval);
  MXDDP_CHECK(save_interval == 0 || !save_dir.empty(), "--save-interval {} needs --save DIR", save_interval);
  MXDDP_CHECK(keep_last >= 0, "--keep-last {} is not valid: 0 (keep every save) or more", keep_last);
  MXDDP_CHECK(keep_last == 0 || !save_dir.empty(), "--keep-last {} needs --save DIR", keep_last);
  MXDDP_CHECK(exit_interval >= 0, "--exit-interval {} is not valid: 0 (never) or more", exit_interval);
  MXDDP_CHECK(std::isfinite(exit_duration_in_mins) && exit_duration_in_mins >= 0,
              "--exit-duration-in-mins {} is not valid: 0 (never) or a positive number of minutes", exit_duration_in_mins);
  MXDDP_CHECK(check_weight_hash_across_dp_replicas_interval >= 0,
              "--check-weight-hash-across-dp-replicas-interval {} is not valid: 0 (never) or more",
              check_weight_hash_across_dp_replicas_interval);
  MXDDP_CHECK(corpus_bytes >= 1, "corpus size {} is not valid: at least 1 byte", corpus_bytes);
  MXDDP_CHECK(load_dir.empty() || load_hf_dir.empty(),
              "--load '{}' and --load-hf '{}' both give the starting params; give one", load_dir, load_hf_dir);
  if (skip_train) {
    MXDDP_CHECK(eval_iters > 0, "--skip-train evaluates --eval-iters batches per split, and --eval-iters is 0");
    MXDDP_CHECK(save_dir.empty(), "--skip-train trains nothing, so --save '{}' would save the params it loaded; give "
                "--save only to a run that trains", save_dir);
  }
}

std::string_view lr_decay_style_name(LrDecayStyle style) {
  switch (style) {
    case LrDecayStyle::kCosine: return "cosine";
    case LrDecayStyle::kLinear: return "linear";
    case LrDecayStyle::kConstant: return "constant";
  }
  MXDDP_FAIL("--lr-decay-style {} is not valid: cosine, linear or constant", static_cast<int>(style));
}

LrDecayStyle parse_lr_decay_style(std::string_view name) {
  if (name == "cosine") return LrDecayStyle::kCosine;
  if (name == "linear") return LrDecayStyle::kLinear;
  if (name == "constant") return LrDecayStyle::kConstant;
  MXDDP_FAIL("--lr-decay-style '{}' is not valid: cosine, linear or constant", name);
}

float learning_rate(const TrainConfig& c, int64_t it) {
  // In double: lr x (it + 1) in float overflows to inf for an lr near FLT_MAX (a valid flag value).
  if (c.lr_warmup_iters > 0 && it < c.lr_warmup_iters)
    return static_cast<float>(static_cast<double>(c.lr) * static_cast<double>(it + 1) /
                              static_cast<double>(c.lr_warmup_iters));
  if (c.lr_decay_style == LrDecayStyle::kConstant) return c.lr;
  const int64_t decay_end = c.lr_decay_iters > 0 ? c.lr_decay_iters : c.train_iters;
  const int64_t span = decay_end - c.lr_warmup_iters;
  if (span <= 0 || it >= decay_end) return c.min_lr;
  const double progress = static_cast<double>(it - c.lr_warmup_iters) / static_cast<double>(span);
  const double coeff = c.lr_decay_style == LrDecayStyle::kCosine ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) : 1.0 - progress;
  return static_cast<float>(c.min_lr + coeff * (c.lr - c.min_lr));
}

}  // namespace mxddp
