// `mxddp plan`: see plan_cmd.h. The figures are plan.h's; this file reads the inputs (train's
// flags, a shape list, a safetensors header), prints them, compares them with the closed forms,
// and searches the options for --fit.
#include "plan_cmd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>
#include <mxddp/input_file.h>
#include <mxddp/plan.h>

#include "cli_checks.h"

namespace mxddp::app {

namespace {

constexpr int64_t kDpMax = int64_t{1} << 20;
// A safetensors header is JSON naming each tensor; real ones are kilobytes to a few megabytes.
constexpr int64_t kSafetensorsHeaderBytesMax = int64_t{100} << 20;

// The param list of a safetensors file, from its header alone (the data may be any size and dtype),
// in the header's order, which the layout takes as registration order.
std::vector<ParamSpec> safetensors_param_specs(const std::string& path) {
  InputFile file(path, "--safetensors");
  MXDDP_CHECK(file.size_bytes() >= 8, "--safetensors '{}' has {} bytes; a safetensors file starts with an 8-byte header length",
              path, file.size_bytes());
  unsigned char length_le[8];
  file.read_exact(length_le, 8);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | length_le[i];
  MXDDP_CHECK(header_bytes >= 2 && header_bytes <= static_cast<uint64_t>(std::min(kSafetensorsHeaderBytesMax, file.size_bytes() - 8)),
              "--safetensors '{}': header length {} is not valid: 2..{} bytes (the file's size less 8, at most 100 MiB)",
              path, header_bytes, std::min(kSafetensorsHeaderBytesMax, file.size_bytes() - 8));
  std::string text(header_bytes, '\0');
  file.read_exact(text.data(), header_bytes);
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text);
  } catch (const std::exception& e) {
    MXDDP_FAIL("--safetensors '{}': the header is not JSON: {}", path, e.what());
  }
  MXDDP_CHECK(header.is_object(), "--safetensors '{}': the header is not a JSON object", path);
  std::vector<ParamSpec> specs;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    MXDDP_CHECK(entry.is_object() && entry.contains("shape") && entry["shape"].is_array(),
                "--safetensors '{}': tensor '{}' has no shape array", path, name);
    std::string dims;  // "AxB", as --shapes spells it (a 0-d tensor is one element)
    for (const auto& d : entry["shape"]) {
      MXDDP_CHECK(d.is_number_integer() && d.get<int64_t>() >= 1,
                  "--safetensors '{}': tensor '{}' has dimension {}; valid: integers >= 1 (a tensor with no elements is "
                  "not a param)", path, name, d.dump());
      dims += fmt::format("{}{}", dims.empty() ? "" : "x", d.get<int64_t>());
    }
    try {
      specs.push_back({name, parse_shape_list(dims.empty() ? "1" : dims).front(), false});
    } catch (const Error& e) {
      MXDDP_FAIL("--safetensors '{}': tensor '{}': {}", path, name, e.what());
    }
  }
  MXDDP_CHECK(!specs.empty(), "--safetensors '{}' names no tensors", path);
  return specs;
}

// With fp8_param_gather, the params a Megatron model keeps as MXFP8: 2-D weights that are not
// embeddings (the GPT's rule, by name for a foreign list).
void mark_mxfp8(std::vector<ParamSpec>& specs) {
  for (ParamSpec& s : specs) {
    const bool embedding = s.name.find("embed") != std::string::npos || s.name.find("wte") != std::string::npos ||
                           s.name.find("wpe") != std::string::npos;
    s.mxfp8 = s.shape.ndim() == 2 && !embedding;
  }
}

// What a plan is of, for the headings.
std::string describe_mode(const TrainConfig& c) {
  std::string mode = c.use_megatron_fsdp
                         ? fmt::format("FSDP {}{}", sharding_strategy_name(c.fsdp.data_parallel_sharding_strategy),
                                       c.fine_grained_param_gather().on ? ", fine-grained gather" : "")
                         : "DDP with the distributed optimizer";
  if (c.ddp.fp8_param_gather) mode += c.ddp.reuse_grad_buf_for_mxfp8_param_ag ? ", MXFP8 params (gather staged in the grad buffer)" : ", MXFP8 params";
  if (c.recompute_granularity == RecomputeGranularity::kFull) mode += ", full recompute";
  if (c.recompute_granularity == RecomputeGranularity::kSelective)
    mode += fmt::format(", selective recompute ({})", recompute_modules_names(c.recompute_modules));
  return mode;
}

// The closed form a user of this mode would reach for, and its name.
std::pair<std::string, double> matching_closed_form(const TrainConfig& c, const ClosedFormMemory& f, int64_t n) {
  if (!c.use_megatron_fsdp) return {"Megatron theoretical_memory_usage (distributed optimizer)", f.megatron_bytes};
  switch (c.fsdp.data_parallel_sharding_strategy) {
    case ShardingStrategy::kNoShard: return {"Megatron theoretical_memory_usage (no distributed optimizer)", 18.0 * static_cast<double>(n)};
    case ShardingStrategy::kOptim: return {"Megatron theoretical_memory_usage (distributed optimizer)", f.megatron_bytes};
    case ShardingStrategy::kOptimGrads: return {"DeepSpeed estimate_zero2_model_states_mem_needs", f.deepspeed_zero2_bytes};
    case ShardingStrategy::kOptimGradsParams: return {"DeepSpeed estimate_zero3_model_states_mem_needs", f.deepspeed_zero3_bytes};
  }
  return {"", 0};
}

struct Explained {
  ClosedFormMemory closed_forms;  // all three, for the same params, largest layer and dp
  std::string formula_name;       // the one this mode compares with
  double formula_bytes = 0;
  double padding_bytes = 0;      // the buffer's alignment and bucket-end padding, in every category
  double reuse_bytes = 0;        // MXFP8 reuse: the BF16 param buffer the formula counts is not there
  double mxfp8_bytes = 0;        // MXFP8 payloads and scales, and DDP's BF16 copies of the other params
  double transient_bytes = 0;    // peak less what stays: FSDP gathers and unsharded grads, staging
  double activations_bytes = 0;  // activations and scratch (the formulas count model states only)
  double other_bytes = 0;        // the rest: dtypes and sharding the formula assumes otherwise
};

Explained explain(const TrainConfig& c, const MemoryPlan& p, int64_t largest_layer_numel) {
  Explained e;
  // HSDP: a rank's model states are sharded over its shard group, not over dp.
  const int shard_dp = p.dp / p.num_distributed_optimizer_instances;
  e.closed_forms = closed_form_memory(p.layout.params_numel, largest_layer_numel, shard_dp);
  std::tie(e.formula_name, e.formula_bytes) = matching_closed_form(c, e.closed_forms, p.layout.params_numel);
  const double padding_numel = static_cast<double>(p.layout.buffer_numel - p.layout.params_numel);
  e.padding_bytes = padding_numel * model_state_bytes_per_element(c, shard_dp);
  e.mxfp8_bytes = static_cast<double>(p.steady.live(MemoryCategory::kMxfp8));
  if (!c.use_megatron_fsdp) {
    const bool reuse = c.ddp.reuse_grad_buf_for_mxfp8_param_ag;
    const double param_buffer = reuse ? 0.0 : 2.0 * static_cast<double>(p.layout.buffer_numel);
    e.mxfp8_bytes += static_cast<double>(p.steady.live(MemoryCategory::kParams)) - param_buffer;
    if (reuse) e.reuse_bytes = -2.0 * static_cast<double>(p.layout.params_numel);
  }
  e.transient_bytes = static_cast<double>(p.overall.total_peak_bytes - p.steady.total_live_bytes);
  e.activations_bytes = static_cast<double>(p.steady.live(MemoryCategory::kScratch));
  e.other_bytes = static_cast<double>(p.overall.total_peak_bytes) - e.formula_bytes - e.padding_bytes - e.reuse_bytes -
                  e.mxfp8_bytes - e.transient_bytes - e.activations_bytes;
  return e;
}

int64_t largest_layer_numel(const std::vector<ParamSpec>& specs) {
  // DeepSpeed's largest_layer_params: the largest module's own params; here the largest param.
  int64_t largest = 0;
  for (const ParamSpec& s : specs) largest = std::max(largest, s.shape.numel());
  return largest;
}

// [{numel, end_padding}] per bucket, in buffer order.
nlohmann::ordered_json bucket_json(const MemoryPlanLayout& layout) {
  nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
  for (const auto& [numel, padding] : layout.bucket_numel_and_end_padding)
    buckets.push_back({{"numel", numel}, {"end_padding_numel", padding}});
  return buckets;
}

nlohmann::ordered_json plan_json(const TrainConfig& c, const MemoryPlan& p, const Explained& e, const std::string& of) {
  nlohmann::ordered_json categories = nlohmann::ordered_json::object();
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    const auto cat = static_cast<MemoryCategory>(k);
    categories[std::string(memory_category_name(cat))] = {{"live_bytes", p.steady.live(cat)},
                                                          {"steady_peak_bytes", p.steady.peak(cat)},
                                                          {"overall_peak_bytes", p.overall.peak(cat)}};
  }
  categories["total"] = {{"live_bytes", p.steady.total_live_bytes},
                         {"steady_peak_bytes", p.steady.total_peak_bytes},
                         {"overall_peak_bytes", p.overall.total_peak_bytes}};
  // Each place's own figures (--device cuda puts the data-parallel state on the device).
  nlohmann::ordered_json places = nlohmann::ordered_json::object();
  for (const MemoryPlace place : {MemoryPlace::kDevice, MemoryPlace::kHost}) {
    const MemoryAmounts& steady = p.steady.at(place);
    const MemoryAmounts& overall = p.overall.at(place);
    places[std::string(memory_place_name(place))] = {{"live_bytes", steady.total_live_bytes},
                                                     {"steady_peak_bytes", steady.total_peak_bytes},
                                                     {"overall_peak_bytes", overall.total_peak_bytes}};
  }
  return {{"of", of},
          {"mode", describe_mode(c)},
          {"dp", p.dp},
          {"num_distributed_optimizer_instances", p.num_distributed_optimizer_instances},
          {"every_rank", true},
          {"compute_threads_per_rank", p.layout.compute_threads},
          {"per_rank", categories},
          {"per_rank_by_place", places},
          {"peak_gathered_bytes_by_slot",
           {{"values", p.peak_gathered_bytes_by_slot[0]}, {"rowwise", p.peak_gathered_bytes_by_slot[1]},
            {"colwise", p.peak_gathered_bytes_by_slot[2]}}},
          {"layout",
           {{"params_numel", p.layout.params_numel}, {"buffer_numel", p.layout.buffer_numel},
            {"buckets", p.layout.num_buckets}, {"param_start_padding_numel", p.layout.param_start_padding_numel},
            {"bucket_end_padding_numel", p.layout.bucket_end_padding_numel},
            {"largest_unit_numel", p.layout.largest_unit_numel},
            {"buckets", bucket_json(p.layout)}}},
          {"closed_form",
           {{"name", e.formula_name}, {"bytes", e.formula_bytes},
            {"difference",
             {{"padding_bytes", e.padding_bytes}, {"mxfp8_reuse_bytes", e.reuse_bytes}, {"mxfp8_bytes", e.mxfp8_bytes},
              {"transient_bytes", e.transient_bytes}, {"activations_and_scratch_bytes", e.activations_bytes},
              {"other_bytes", e.other_bytes}}}}}};
}

void print_plan(const TrainConfig& c, const MemoryPlan& p, const Explained& e, const std::string& of) {
  std::printf("mxddp plan: %s at dp %d, %s\n", of.c_str(), p.dp, describe_mode(c).c_str());
  if (p.num_distributed_optimizer_instances > 1)
    std::printf("hybrid sharding: %d replica groups, each a shard group of %d ranks\n",
                p.num_distributed_optimizer_instances, p.dp / p.num_distributed_optimizer_instances);
  std::printf("every rank holds the same (buckets split into equal shards); per rank:\n\n");
  std::printf("%-26s %16s %16s %16s\n", "category", "steady peak", "overall peak", "live at the end");
  auto row = [](const char* name, int64_t steady, int64_t overall, int64_t live) {
    std::printf("%-26s %16lld %16lld %16lld   %s\n", name, static_cast<long long>(steady), static_cast<long long>(overall),
                static_cast<long long>(live), format_bytes(static_cast<double>(overall)).c_str());
  };
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    const auto cat = static_cast<MemoryCategory>(k);
    const std::string name = cat == MemoryCategory::kScratch ? "activations and scratch" : std::string(memory_category_name(cat));
    row(name.c_str(), p.steady.peak(cat), p.overall.peak(cat), p.steady.live(cat));
  }
  row("total (peak of the sum)", p.steady.total_peak_bytes, p.overall.total_peak_bytes, p.steady.total_live_bytes);
  const MemoryAmounts& on_device = p.overall.at(MemoryPlace::kDevice);
  if (on_device.total_peak_bytes > 0) {
    const MemoryAmounts& on_host = p.overall.at(MemoryPlace::kHost);
    std::printf("of which on the device (the data-parallel buffers and optimizer state): %lld at the overall peak (%s); "
                "on the host: %lld (%s)\n",
                static_cast<long long>(on_device.total_peak_bytes), format_bytes(static_cast<double>(on_device.total_peak_bytes)).c_str(),
                static_cast<long long>(on_host.total_peak_bytes), format_bytes(static_cast<double>(on_host.total_peak_bytes)).c_str());
  }
  std::printf("\nlayout: %lld params in a %lld-element buffer, %lld bucket(s): %lld elements of padding (%lld at param "
              "starts, %lld at bucket ends)\n",
              static_cast<long long>(p.layout.params_numel), static_cast<long long>(p.layout.buffer_numel),
              static_cast<long long>(p.layout.num_buckets),
              static_cast<long long>(p.layout.buffer_numel - p.layout.params_numel),
              static_cast<long long>(p.layout.param_start_padding_numel),
              static_cast<long long>(p.layout.bucket_end_padding_numel));
  if (p.layout.compute_threads > 0) std::printf("activations sized for %d compute thread(s) per rank\n", p.layout.compute_threads);
  const ClosedFormMemory& f = e.closed_forms;
  std::printf("\nclosed forms (model states only, per rank):\n");
  std::printf("  %-58s %s\n", "Megatron theoretical_memory_usage, distributed optimizer", format_bytes(f.megatron_bytes).c_str());
  std::printf("  %-58s %s\n", "DeepSpeed estimate_zero2_model_states_mem_needs", format_bytes(f.deepspeed_zero2_bytes).c_str());
  std::printf("  %-58s %s\n", "DeepSpeed estimate_zero3_model_states_mem_needs", format_bytes(f.deepspeed_zero3_bytes).c_str());
  std::printf("\nthis plan's peak %s against %s's %s; the difference %s is:\n",
              format_bytes(static_cast<double>(p.overall.total_peak_bytes)).c_str(), e.formula_name.c_str(),
              format_bytes(e.formula_bytes).c_str(),
              format_bytes(std::abs(static_cast<double>(p.overall.total_peak_bytes) - e.formula_bytes)).c_str());
  auto part = [](const char* what, double bytes) {
    std::printf("  %-68s %s%s\n", what, bytes < 0 ? "-" : "+", format_bytes(std::abs(bytes)).c_str());
  };
  part("padding (param starts to 64 elements, bucket ends to lcm(dp,128))", e.padding_bytes);
  part("MXFP8 reuse: no BF16 param buffer (the formula has one)", e.reuse_bytes);
  part("MXFP8 payloads and scales (DDP: and BF16 copies of the rest)", e.mxfp8_bytes);
  part("transient: gathered params, unsharded grads, MXFP8 staging", e.transient_bytes);
  part("activations and scratch (not in the formulas)", e.activations_bytes);
  part("the formula's own terms (16-bit grads, ZeRO-3's 4 x largest layer)", e.other_bytes);
}

// The iteration a --load resumes at (its checkpoint's), 0 without one: the plan's steady state
// depends on how many iterations are left.
int64_t load_start_iteration(const std::string& load_dir) {
  if (load_dir.empty()) return 0;
  const std::string dir = resolve_checkpoint_dir(load_dir);
  const CheckpointInfo info = inspect_checkpoint(dir);
  const auto it = info.metadata.find("iteration");
  MXDDP_CHECK(it != info.metadata.end(), "--load '{}': checkpoint '{}' was not written by mxddp train: its metadata has "
              "no iteration", load_dir, dir);
  return parse_integer(it->second, fmt::format("--load '{}': the checkpoint's iteration", load_dir), 0,
                       std::numeric_limits<int64_t>::max());
}

// ---- --fit ----

struct Candidate {
  std::string options;  // the flags that set it
  TrainConfig config;
  double comm_bytes = 0;
  int recompute_rank = 0;  // 0 none, 1 selective, 2 full: compute given for memory
  MemoryPlan plan;
};

// Bytes each rank sends per iteration in ring collectives: (dp - 1) / dp of the buffer per
// collective; optim_grads_params reduces each micro-batch and gathers for forward and backward.
double comm_bytes_per_iteration(const TrainConfig& c, const MemoryPlan& p) {
  const double ring = p.dp > 1 ? static_cast<double>(p.dp - 1) / p.dp : 0.0;
  const double numel = static_cast<double>(p.layout.buffer_numel);
  const int accum = c.accumulation_steps(p.dp);
  if (!c.use_megatron_fsdp) return ring * numel * (4 + 2);
  switch (c.fsdp.data_parallel_sharding_strategy) {
    case ShardingStrategy::kNoShard: return ring * numel * 8;
    case ShardingStrategy::kOptim:
    case ShardingStrategy::kOptimGrads: return ring * numel * (4 + 2);
    case ShardingStrategy::kOptimGradsParams: {
      // A gather moves 2 bytes per BF16 element, 1 + 1/32 per MXFP8 one (one orientation's payload
      // and scales per pass).
      double mxfp8_numel = 0;
      if (c.ddp.fp8_param_gather)
        for (const ParamSpec& s : gpt_param_specs(c.model, true)) mxfp8_numel += s.mxfp8 ? static_cast<double>(s.shape.numel()) : 0;
      const double gather_bytes_per_element =
          2.0 - (1.0 - 1.0 / kMxBlockSize) * mxfp8_numel / static_cast<double>(p.layout.params_numel);
      return ring * numel * accum * (4 + 2 * gather_bytes_per_element);
    }
  }
  return 0;
}

std::vector<Candidate> fit_candidates(const TrainConfig& base) {
  struct Mode {
    const char* flags;
    bool fsdp;
    ShardingStrategy strategy;
    bool fp8, reuse, fine_grained;
  };
  const Mode modes[] = {
      {"", false, ShardingStrategy::kOptim, false, false, false},
      {"--fp8-param-gather", false, ShardingStrategy::kOptim, true, false, false},
      {"--fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag", false, ShardingStrategy::kOptim, true, true, false},
      {"--use-megatron-fsdp --data-parallel-sharding-strategy optim", true, ShardingStrategy::kOptim, false, false, false},
      {"--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads", true, ShardingStrategy::kOptimGrads, false, false, false},
      {"--use-megatron-fsdp", true, ShardingStrategy::kOptimGradsParams, false, false, false},
      {"--use-megatron-fsdp --megatron-fsdp-enable-fine-grained-param-gather", true, ShardingStrategy::kOptimGradsParams, false, false, true},
      {"--use-megatron-fsdp --fp8-param-gather", true, ShardingStrategy::kOptimGradsParams, true, false, false},
      {"--use-megatron-fsdp --fp8-param-gather --megatron-fsdp-enable-fine-grained-param-gather", true,
       ShardingStrategy::kOptimGradsParams, true, false, true},
  };
  std::vector<Candidate> out;
  for (const Mode& m : modes)
    for (int r = 0; r < 3; ++r) {
      Candidate cand;
      TrainConfig& c = cand.config;
      c = base;
      c.use_megatron_fsdp = m.fsdp;
      c.fsdp.data_parallel_sharding_strategy = m.strategy;
      c.ddp.fp8_param_gather = m.fp8;
      c.ddp.reuse_grad_buf_for_mxfp8_param_ag = m.reuse;
      if (m.reuse) c.ddp.overlap_param_gather_with_optimizer_step = false;
      c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = m.fine_grained ? std::optional<bool>(true) : std::nullopt;
      c.recompute_granularity = r == 0 ? RecomputeGranularity::kNone
                                : r == 1 ? RecomputeGranularity::kSelective : RecomputeGranularity::kFull;
      c.recompute_modules = r == 1 ? RecomputeModules{RecomputeModule::kCoreAttn} : RecomputeModules{};
      cand.options = m.flags;
      if (r == 1) cand.options += std::string(cand.options.empty() ? "" : " ") + "--recompute-granularity selective";
      if (r == 2) cand.options += std::string(cand.options.empty() ? "" : " ") + "--recompute-granularity full";
      cand.recompute_rank = r;
      out.push_back(std::move(cand));
    }
  return out;
}

void run_fit(const PlanArgs& a, int64_t budget_bytes) {
  const TrainConfig& base = a.train.config;
  const int mb = base.micro_batch_size;
  std::vector<int64_t> tried;
  for (int64_t dp = 1; dp <= a.fit_max_dp; ++dp) {
    if (base.global_batch_size % (int64_t{mb} * dp) != 0) continue;
    tried.push_back(dp);
    std::vector<Candidate> fits;
    for (Candidate& cand : fit_candidates(base)) {
      try {
        cand.plan = plan_train_memory(cand.config, {.dp = static_cast<int>(dp)});
      } catch (const Error&) {
        continue;  // a combination the trainer refuses (say, MXFP8 with a hidden size it cannot block)
      }
      if (cand.plan.overall.total_peak_bytes > budget_bytes) continue;
      cand.comm_bytes = comm_bytes_per_iteration(cand.config, cand.plan);
      fits.push_back(std::move(cand));
    }
    if (fits.empty()) continue;
    std::sort(fits.begin(), fits.end(), [](const Candidate& x, const Candidate& y) {
      if (x.comm_bytes != y.comm_bytes) return x.comm_bytes < y.comm_bytes;
      if (x.recompute_rank != y.recompute_rank) return x.recompute_rank < y.recompute_rank;
      return x.plan.overall.total_peak_bytes < y.plan.overall.total_peak_bytes;
    });
    if (a.json) {
      nlohmann::ordered_json j = {{"budget_bytes", budget_bytes}, {"dp", dp}, {"fits", nlohmann::ordered_json::array()}};
      for (const Candidate& c : fits)
        j["fits"].push_back({{"options", c.options}, {"peak_bytes", c.plan.overall.total_peak_bytes},
                             {"comm_bytes_per_iteration", c.comm_bytes}});
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    std::printf("mxddp plan --fit %s: the smallest dp that fits is %lld (of the dp that split global batch %d into "
                "micro-batches of %d)\n",
                format_bytes(static_cast<double>(budget_bytes)).c_str(), static_cast<long long>(dp),
                base.global_batch_size, mb);
    std::printf("options that fit a rank, least communication first (ring bytes per rank per iteration):\n\n");
    std::printf("%14s %14s  %s\n", "peak/rank", "comm/iter", "options");
    for (const Candidate& c : fits)
      std::printf("%14s %14s  %s\n", format_bytes(static_cast<double>(c.plan.overall.total_peak_bytes)).c_str(),
                  format_bytes(c.comm_bytes).c_str(), c.options.empty() ? "(the defaults: DDP)" : c.options.c_str());
    return;
  }
  MXDDP_FAIL("--fit {}: no dp up to --fit-max-dp {} fits ({} tried: those dividing global batch {} into micro-batches "
             "of {}); give a larger budget, a larger --global-batch-size, or a smaller model or micro-batch",
             format_bytes(static_cast<double>(budget_bytes)), a.fit_max_dp, tried.size(), base.global_batch_size, mb);
}

}  // namespace

int64_t parse_byte_size(const std::string& text, std::string_view what) {
  struct Unit {
    const char* suffix;
    double bytes;
  };
  static const Unit kUnits[] = {{"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
                                {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1.0}};
  std::string number = text;
  double scale = 1;
  for (const Unit& u : kUnits)
    if (number.size() > std::strlen(u.suffix) && number.ends_with(u.suffix)) {
      number.resize(number.size() - std::strlen(u.suffix));
      scale = u.bytes;
      break;
    }
  while (!number.empty() && number.back() == ' ') number.pop_back();
  double value = -1;
  size_t used = 0;
  try {
    value = std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const double bytes = value * scale;
  MXDDP_CHECK(used > 0 && used == number.size() && std::isfinite(bytes) && bytes >= 0 && bytes < 9.2e18,
              "{} '{}' is not valid: a byte count below 8 EiB, optionally with a unit: B, KB, MB, GB, TB (powers of "
              "1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 80GiB",
              what, text);
  return static_cast<int64_t>(bytes);
}

CLI::App* add_plan_command(CLI::App& app, PlanArgs& a) {
  auto* cmd = app.add_subcommand(
      "plan", "Every rank's memory to the byte before running: the figures mxddp train --report will measure, per "
              "category, beside Megatron's and DeepSpeed's formulas; or --fit a budget. Takes every train flag "
              "(--ranks or --dp is the data-parallel size; --load is read for its iteration; the data and "
              "output files a run names, --data --save --report --metrics-file, are neither opened nor needed)");
  add_train_flags(cmd, a.train);
  auto* plan = cmd->add_option_group("plan");
  plan->add_option("--dp", a.dp, "Data-parallel size to plan for (any size; default: --ranks)")
      ->transform(integer_in(1, kDpMax));
  plan->add_option("--num-distributed-optimizer-instances", a.num_distributed_optimizer_instances,
                   "Hybrid sharding (HSDP, with --use-megatron-fsdp and --shapes or --safetensors): the dp ranks form "
                   "this many replica groups, each a shard group of dp / it ranks; a rank holds FSDP's bytes at that "
                   "size (default 1: plain FSDP)")
      ->transform(integer_in(1, kDpMax));
  plan->add_option("--ranks-per-node", a.ranks_per_node,
                   "Ranks sharing one machine's cores, as mpirun places them: with --compute-threads 0 each rank "
                   "computes with cores / this many threads, which sizes attention's backward scratch (default: all "
                   "dp ranks, as the local backend runs them)")
      ->transform(integer_in(1, kDpMax));
  auto* shapes = plan->add_option("--shapes", a.shapes,
                                  "Plan a param list instead of the GPT (buffers and optimizer only), shapes in "
                                  "registration order as layout takes them, e.g. 4096x4096,4096");
  auto* st = plan->add_option("--safetensors", a.safetensors,
                              "Plan the params named in this safetensors file's header (only the header is read), in "
                              "its order; FSDP units: the layer index in the names")
                 ->transform(non_empty_path());
  shapes->excludes(st);
  auto* fit = plan->add_option("--fit", a.fit,
                               "Memory per rank, e.g. 80GiB: print the smallest dp and the options (distributed "
                               "optimizer, FSDP strategy, MXFP8 reuse, fine-grained gather, recompute) that fit, "
                               "least communication first");
  fit->excludes(shapes)->excludes(st);
  plan->add_option("--fit-max-dp", a.fit_max_dp, "Largest dp --fit tries")->transform(integer_in(1, kDpMax));
  auto* device = plan->add_option("--device", a.device,
                                  "Where each rank's data-parallel buffers and optimizer state live (with --shapes or "
                                  "--safetensors): cpu, or cuda (a GPU per rank: those bytes are planned as device "
                                  "memory, the rest as host memory)")
                     ->check(CLI::IsMember({"cpu", "cuda"}));
  device->excludes(fit);
  plan->add_flag("--json", a.json, "Print JSON instead of the table");
  return cmd;
}

void run_plan_command(PlanArgs& a) {
  finish_train_config(a.train);
  TrainConfig& c = a.train.config;
  // The model flags are checked whatever is planned: a --shapes plan ignores them, but a bad one is
  // still a mistake to name, and --fit would otherwise report "nothing fits" for a model that is
  // not valid.
  c.model.validate();
  c.model_options().validate();
  if (!a.fit.empty()) {
    run_fit(a, parse_byte_size(a.fit, "--fit"));
    return;
  }
  const int dp = static_cast<int>(a.dp > 0 ? a.dp : a.train.ranks);
  MemoryPlan plan;
  std::string of;
  int64_t largest = 0;
  if (!a.shapes.empty() || !a.safetensors.empty()) {
    std::vector<ParamSpec> specs;
    if (!a.shapes.empty()) {
      for (const Shape& shape : parse_shape_list(a.shapes)) specs.push_back({fmt::format("p{}", specs.size()), shape, false});
      of = fmt::format("{} params from --shapes", specs.size());
    } else {
      specs = safetensors_param_specs(a.safetensors);
      of = fmt::format("{} params of {}", specs.size(), a.safetensors);
    }
    if (c.ddp.fp8_param_gather) mark_mxfp8(specs);
    plan = plan_param_memory(specs, c, {.dp = dp, .num_distributed_optimizer_instances =
                                                     static_cast<int>(a.num_distributed_optimizer_instances),
                                        .data_parallel_place = a.device == "cuda" ? MemoryPlace::kDevice
                                                                                  : MemoryPlace::kHost});
    largest = largest_layer_numel(specs);
  } else {
    MXDDP_CHECK(a.num_distributed_optimizer_instances == 1,
                "--num-distributed-optimizer-instances {} needs --shapes or --safetensors: mxddp train does not run "
                "hybrid sharding, so its plan has none", a.num_distributed_optimizer_instances);
    MXDDP_CHECK(a.device == "cpu",
                "--device {} needs --shapes or --safetensors: mxddp train keeps every buffer in host memory; valid "
                "here: cpu", a.device);
    plan = plan_train_memory(c, {.dp = dp, .ranks_on_this_machine = static_cast<int>(a.ranks_per_node),
                                 .start_iteration = load_start_iteration(c.load_dir),
                                 .mpi_backend = a.train.backend == "mpi"});
    of = c.model.describe();
    largest = largest_layer_numel(gpt_param_specs(c.model));
  }
  const Explained e = explain(c, plan, largest);
  if (a.json) std::printf("%s\n", plan_json(c, plan, e, of).dump(2).c_str());
  else print_plan(c, plan, e, of);
}

}  // namespace mxddp::app
