// plan_train_memory and plan_param_memory (plan.h): train()'s allocations replayed against a
// MemoryTracker, in train()'s order, with nothing allocated.
//
// What each step charges, and where the real allocation is:
//   DDP:       grad buffer, then param buffer (none with MXFP8 reuse)    ParamAndGradBuffer
//              with fp8_param_gather, per param: bf16 copy, or MXFP8 row
//              and column payloads and scales                            ModelParamStore
//   FSDP:      per bucket, by strategy; transients in the iterations     FsdpMemorySim (fsdp_memory_sim.h)
//   optimizer: per bucket, its main params then each state               DistributedOptimizer
//   scratch:   every named request, grown as the pool grows              GlobalMemoryBuffer::get_tensor
//              (the names and sizes come from trace_gpt_micro_batch)
//   comm:      with the mpi backend, the f32 staging of the largest      MpiBackend::staging_f32
//              bucket's gradient reduction, from where the first runs
#include <mxddp/plan.h>

#include <algorithm>
#include <map>
#include <memory>
#include <limits>
#include <regex>
#include <set>

#include <mxddp/quant.h>

#include "../fsdp/fsdp_storage_plan.h"
#include "data_parallel_sim.h"
#include "ddp_memory_sim.h"

namespace mxddp {

namespace {

int64_t dtype_bytes(DType t) { return static_cast<int64_t>(dtype_size_bytes(t)); }

// The last iteration train() runs when it starts at `start`: train_iters, or the first multiple of
// --exit-interval after start.
int64_t last_iteration(const TrainConfig& c, int64_t start) {
  if (c.exit_interval <= 0) return c.train_iters;
  return std::min(c.train_iters, (start / c.exit_interval + 1) * c.exit_interval);
}

// Whether train() evaluates after any iteration in (start, last]: after the last of the schedule,
// and every eval_interval.
bool evaluates(const TrainConfig& c, int64_t start, int64_t last) {
  if (c.eval_iters <= 0 || last <= start) return false;
  if (last == c.train_iters) return true;
  return c.eval_interval > 0 && last / c.eval_interval > start / c.eval_interval;
}

// The largest model the plan describes: its param list and trace are O(layers), and every byte count
// must fit in int64 with room to add categories. Beyond these no machine could run it anyway.
constexpr int kPlanLayersMax = 10'000;  // (the deepest published decoders have a few hundred)
constexpr int64_t kPlanBytesPerParamMax = 64;  // the most any mode keeps per param, all categories

// Throws Error when a model's sizes exceed what the plan (and the GPT's int row index) can count.
void check_plannable(const GptConfig& m, int micro_batch) {
  MXDDP_CHECK(m.num_layers <= kPlanLayersMax, "--num-layers {} is more than mxddp plans: at most {} layers", m.num_layers,
              kPlanLayersMax);
  const int64_t n = m.num_params();
  MXDDP_CHECK(n <= std::numeric_limits<int64_t>::max() / kPlanBytesPerParamMax,
              "the model's {} params are more than mxddp plans: their bytes would not fit in a 64-bit count", n);
  const std::string_view what = "one micro-batch's activations (--micro-batch-size, --seq-length, --hidden-size, heads)";
  const int64_t rows = checked_mul(micro_batch, m.seq_length, what);
  MXDDP_CHECK(rows <= std::numeric_limits<int>::max(),
              "--micro-batch-size {} x --seq-length {} = {} rows is not valid: the GPT indexes a micro-batch's rows "
              "with 32 bits, so at most {}", micro_batch, m.seq_length, rows, std::numeric_limits<int>::max());
  // The largest activations, in bytes: the attention probabilities [B, H, T, T] and the MLP's [N, 4C].
  checked_mul(checked_mul(checked_mul(rows, m.num_attention_heads, what), m.seq_length, what), 4 * 4, what);
  checked_mul(checked_mul(rows, m.hidden_size, what), 4 * 4 * 4 * kPlanBytesPerParamMax, what);
}

}  // namespace

double model_state_bytes_per_element(const TrainConfig& c, int dp) {
  const int states = static_cast<int>(optimizer_state_names(c.optimizer.optimizer).size());
  if (!c.use_megatron_fsdp) return (c.ddp.reuse_grad_buf_for_mxfp8_param_ag ? 0 : 2) + 4 + 4.0 * (1 + states) / dp;
  return fsdp_element_bytes(c.fsdp.data_parallel_sharding_strategy, c.fsdp.param_dtype, fsdp_grad_dtype(c.fsdp), dp,
                            states)
      .total();
}

MemoryPlan plan_train_memory(const TrainConfig& config, const MemoryPlanOptions& opts) {
  const int dp = opts.dp;
  config.validate(dp);
  MXDDP_CHECK(opts.num_distributed_optimizer_instances == 1,
              "num_distributed_optimizer_instances {} is not valid for mxddp train's plan: train() does not run "
              "hybrid sharding (HSDP); plan a param list (--shapes, --safetensors) or mxddp.torch's FSDP instead; valid: 1",
              opts.num_distributed_optimizer_instances);
  MXDDP_CHECK(opts.data_parallel_place == MemoryPlace::kHost,
              "data_parallel_place device is not valid for mxddp train's plan: train() keeps every buffer in host "
              "memory; plan a param list (--shapes, --safetensors), a DDP or an FSDP on a device instead; valid: host");
  check_plannable(config.model, config.micro_batch_size);
  const GptConfig& mc = config.model;
  const GptModelOptions model_options = config.model_options();
  const std::vector<ParamSpec> specs = gpt_param_specs(mc, config.ddp.fp8_param_gather);
  MemoryTracker tracker;
  ScratchSim scratch(tracker);
  DataParallelSim dpsim(tracker, &scratch);
  // train(): the DataParallel, then the optimizer; the model allocates nothing until it runs.
  if (config.use_megatron_fsdp) {
    FsdpConfig fc = config.fsdp;
    fc.mxfp8_elem = config.ddp.mxfp8_elem;
    fc.mxfp8_scale_mode = config.ddp.mxfp8_scale_mode;
    dpsim.build_fsdp(specs, gpt_fsdp_units(mc, model_options.fine_grained_param_gather), fc, dp, opts.mpi_backend);
  } else {
    dpsim.build_ddp(specs, config.ddp, dp, opts.mpi_backend);
  }
  const int64_t build_live_bytes = tracker.usage().total_live_bytes;
  int64_t largest_bucket_bytes = 0;  // FSDP's constructor stages one bucket's initial values at a time
  if (config.use_megatron_fsdp)
    for (const BucketPlacement& b : dpsim.layout().buckets)
      largest_bucket_bytes = std::max(largest_bucket_bytes, b.range.size() * dtype_bytes(config.fsdp.param_dtype));
  dpsim.build_optimizer(config.optimizer.optimizer);

  GptTraceOptions trace{.micro_batch = config.micro_batch_size, .backward = true,
                        .compute_threads = effective_compute_threads(rank_compute_threads(
                            config, opts.ranks_on_this_machine > 0 ? opts.ranks_on_this_machine : dp))};
  for (const ParamSpec& s : specs) trace.mxfp8.push_back(s.mxfp8);
  // The model reads BF16 params in place under --bf16; F32 ones (FSDP's param_dtype f32) it copies.
  trace.bf16_params = (config.use_megatron_fsdp ? config.fsdp.param_dtype : config.ddp.param_dtype) == DType::kBF16;
  // Micro-batches under no_sync repeat the second one's allocations (each starts where the one
  // before it left the reductions in flight, and from the second on that is the same place): up to
  // three of them and the last, synced one give an iteration's peaks, however many it has.
  const int accum = config.accumulation_steps(dp);
  const int micro_batches = std::min(accum, 4);
  auto iteration = [&] {
    dpsim.start_iteration();
    for (int m = 0; m < micro_batches; ++m) {
      dpsim.set_no_sync(m + 1 < micro_batches);
      trace_gpt_micro_batch(mc, model_options, trace, dpsim);
      dpsim.set_no_sync(false);
    }
    dpsim.finish_grad_sync();
    dpsim.step();
  };
  if (!config.load_dir.empty()) dpsim.force_param_sync();  // load_checkpoint's
  // Every iteration after the first repeats the second's allocations, and every evaluation the
  // first's, from the same state (nothing gathered, no transient grads, no staging): one of each
  // gives the run's peaks.
  MXDDP_CHECK(opts.start_iteration >= 0, "start iteration {} is not valid: at least 0", opts.start_iteration);
  const int64_t last = last_iteration(config, opts.start_iteration);
  const int64_t iterations = std::max<int64_t>(0, last - opts.start_iteration);
  MemoryUsage warmup;
  for (int64_t it = 0; it < std::min<int64_t>(iterations, 2); ++it) {
    iteration();
    if (it == 0) {
      warmup = tracker.usage();
      tracker.reset_peaks();
    }
  }
  if (evaluates(config, opts.start_iteration, last)) {
    // Each evaluation micro-batch is a forward from nothing gathered back to nothing gathered: one
    // gives the peaks of all eval_iters x accumulation of them.
    dpsim.force_param_sync();
    GptTraceOptions eval = trace;
    eval.backward = false;
    trace_gpt_micro_batch(mc, model_options, eval, dpsim);
    dpsim.release_gathered_params();
  }
  dpsim.force_param_sync();  // the end of training (and any save or replica check before it)

  const MemoryUsage steady = tracker.usage();
  MemoryPlan plan = data_parallel_plan(dpsim, dp, steady, iterations > 0 ? warmup : steady);
  plan.layout.compute_threads = trace.compute_threads;
  plan.build_live_bytes = build_live_bytes;
  plan.build_untracked_bytes = 4 * plan.layout.params_numel + largest_bucket_bytes;
  return plan;
}

MemoryPlan plan_param_memory(const std::vector<ParamSpec>& params, const TrainConfig& config,
                             const MemoryPlanOptions& opts) {
  const int dp = opts.dp;
  MXDDP_CHECK(dp >= 1, "dp {} is not valid: at least 1", dp);
  int64_t n = 0;
  for (const ParamSpec& p : params) n = checked_add(n, p.shape.numel(), "the param list's elements");
  MXDDP_CHECK(n <= std::numeric_limits<int64_t>::max() / kPlanBytesPerParamMax,
              "the param list's {} elements are more than mxddp plans: their bytes would not fit in a 64-bit count", n);
  MemoryTracker tracker;
  place_data_parallel_state(tracker, opts.data_parallel_place);
  DataParallelSim dpsim(tracker, nullptr);
  if (config.use_megatron_fsdp) {
    // A unit per layer index in the names ("...layers.3.", "...h.3."), in order of appearance;
    // without any, a unit per param.
    static const std::regex kLayer(R"((^|\.)(layers|layer|h|blocks)\.(\d+)\.)");
    std::map<std::string, int> unit_of_layer;
    std::vector<std::vector<int>> units;
    std::smatch m;
    for (size_t p = 0; p < params.size(); ++p)
      if (std::regex_search(params[p].name, m, kLayer)) {
        const auto [it, added] = unit_of_layer.emplace(m[3].str(), static_cast<int>(units.size()));
        if (added) units.emplace_back();
        units[static_cast<size_t>(it->second)].push_back(static_cast<int>(p));
      }
    if (units.empty())
      for (size_t p = 0; p < params.size(); ++p) units.push_back({static_cast<int>(p)});
    FsdpConfig fc = config.fsdp;
    fc.mxfp8_elem = config.ddp.mxfp8_elem;
    fc.mxfp8_scale_mode = config.ddp.mxfp8_scale_mode;
    // HSDP: FSDP's bytes at the shard group's size (fsdp.h; no iterations, so no staging).
    const int shard = fsdp_shard_group_size({.dp = dp, .num_distributed_optimizer_instances =
                                                     opts.num_distributed_optimizer_instances},
                                            fc);
    dpsim.build_fsdp(params, units, fc, shard, false, dp / shard);  // no iterations: no reductions to stage
  } else {
    MXDDP_CHECK(opts.num_distributed_optimizer_instances == 1,
                "num_distributed_optimizer_instances {} is not valid without --use-megatron-fsdp: hybrid sharding "
                "is FSDP's; valid: 1", opts.num_distributed_optimizer_instances);
    dpsim.build_ddp(params, config.ddp, dp, false);
  }
  dpsim.build_optimizer(config.optimizer.optimizer);
  // No model: the iterations' only allocations are FSDP's, which follow the model's calls; the
  // plan holds what construction and a step allocate, and a forced sync's staging.
  const MemoryUsage built = tracker.usage();
  tracker.reset_peaks();
  dpsim.start_iteration();
  dpsim.step();
  dpsim.force_param_sync();
  MemoryPlan plan = data_parallel_plan(dpsim, dp, tracker.usage(), built);
  plan.num_distributed_optimizer_instances = opts.num_distributed_optimizer_instances;
  return plan;
}

ClosedFormMemory closed_form_memory(int64_t params_numel, int64_t largest_layer_numel, int dp) {
  const double n = static_cast<double>(params_numel), d = dp;
  return {.megatron_bytes = n * (6.0 + 12.0 / d),
          .deepspeed_zero2_bytes = 4.0 * n + 16.0 * n / d,
          .deepspeed_zero3_bytes = 4.0 * static_cast<double>(largest_layer_numel) + 18.0 * n / d};
}

}  // namespace mxddp
