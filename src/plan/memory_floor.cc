// train_memory_floor and the check against the machine's memory: see memory_floor.h.
#include "memory_floor.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <mxddp/plan.h>

#include "../fsdp/fsdp_storage_plan.h"

namespace mxddp {

namespace {

double dtype_bytes(DType t) { return static_cast<double>(dtype_size_bytes(t)); }

// GptConfig::num_params in doubles: the hostile configs this guards against overflow int64.
double gpt_params(const GptConfig& m) {
  const double c = m.hidden_size;
  const double per_layer = 12 * c * c + 13 * c;
  return static_cast<double>(m.vocab_size) * c + static_cast<double>(m.seq_length) * c + m.num_layers * per_layer + 2 * c;
}

// The first number on the line of /proc/meminfo that starts with key, in bytes; -1 if absent.
double meminfo_bytes(const std::string& key) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) {
      std::istringstream fields(line.substr(key.size()));
      double kib = -1;
      fields >> kib;
      return kib < 0 ? -1 : kib * 1024.0;
    }
  return -1;
}

// A cgroup v2 file holding one number ("max" when unlimited); -1 if absent or unlimited.
double cgroup_bytes(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stod(text);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

double TrainMemoryFloor::rank_bytes() const {
  const double buffers = params_bytes + grads_bytes;
  const double build = init_bytes + buffers;
  const double steady = buffers + main_params_bytes + optimizer_state_bytes + activations_bytes;
  return std::max(build, steady) + data_bytes;
}

std::string TrainMemoryFloor::describe() const {
  return fmt::format("initial values {}, params {}, grads {}, main params {}, optimizer state {}, activations {}, data {}",
                     format_bytes(init_bytes), format_bytes(params_bytes), format_bytes(grads_bytes),
                     format_bytes(main_params_bytes), format_bytes(optimizer_state_bytes), format_bytes(activations_bytes),
                     format_bytes(data_bytes));
}

TrainMemoryFloor train_memory_floor(const TrainConfig& c, int dp, double data_bytes) {
  const double n = gpt_params(c.model), ranks = dp;
  TrainMemoryFloor f;
  f.init_bytes = 4 * n;
  // Which of params, grads and optimizer state this rank keeps a 1/dp share of (FSDP: the
  // per-strategy table of fsdp_storage_plan.h; DDP always runs the distributed optimizer). MXFP8 params hold a 1-byte payload per orientation.
  bool shard_params = false, shard_grads = false, shard_optimizer = true;
  double param_elem = c.ddp.fp8_param_gather ? 2 : dtype_bytes(c.ddp.param_dtype);
  DType param_dtype = c.ddp.param_dtype;
  double grad_elem = c.ddp.grad_reduce_in_fp32 ? 4 : dtype_bytes(c.ddp.param_dtype);
  if (c.use_megatron_fsdp) {
    const FsdpStrategyStorage& st = fsdp_strategy_storage(c.fsdp.data_parallel_sharding_strategy);
    shard_params = st.params_sharded;
    shard_grads = st.grads_sharded;
    shard_optimizer = st.optimizer_sharded;
    param_elem = dtype_bytes(c.fsdp.param_dtype);
    param_dtype = c.fsdp.param_dtype;
    grad_elem = c.fsdp.grad_reduce_in_fp32 ? 4 : param_elem;
  }
  f.params_bytes = param_elem * n / (shard_params ? ranks : 1);
  f.grads_bytes = grad_elem * n / (shard_grads ? ranks : 1);
  // An f32 param shard is its own main param (optim.h).
  f.main_params_bytes = main_params_alias_param_shard(param_dtype) ? 0 : 4 * n / (shard_optimizer ? ranks : 1);
  const auto state_elems = static_cast<double>(optimizer_state_names(c.optimizer.optimizer).size());
  f.optimizer_state_bytes = 4 * state_elems * n / (shard_optimizer ? ranks : 1);
  const double rows = static_cast<double>(c.micro_batch_size) * c.model.seq_length;
  f.activations_bytes = 4 * rows * (static_cast<double>(c.model.num_layers) * c.model.hidden_size + c.model.vocab_size);
  f.data_bytes = data_bytes;
  return f;
}

double available_memory_bytes() {
  double available = meminfo_bytes("MemAvailable:");
  const double limit = cgroup_bytes("/sys/fs/cgroup/memory.max");
  const double used = cgroup_bytes("/sys/fs/cgroup/memory.current");
  if (limit >= 0) {
    const double headroom = std::max(0.0, limit - std::max(0.0, used));
    available = available < 0 ? headroom : std::min(available, headroom);
  }
  return available;
}

void check_train_fits_in_memory(const TrainConfig& config, int dp, int ranks_here, double data_bytes) {
  const double available = available_memory_bytes();
  if (available < 0) return;
  const TrainMemoryFloor f = train_memory_floor(config, dp, data_bytes);
  const double needed = f.rank_bytes() * ranks_here;
  MXDDP_CHECK(needed <= available,
              "this run cannot fit in this machine's memory: {} rank{} here need at least {} ({} each: {}) and {} is "
              "available. Give a smaller model (--num-layers {}, --hidden-size {}), micro-batch "
              "(--micro-batch-size {}) or sequence (--seq-length {}), or shard more (--use-megatron-fsdp)",
              ranks_here, ranks_here == 1 ? "" : "s", format_bytes(needed), format_bytes(f.rank_bytes()), f.describe(),
              format_bytes(available), config.model.num_layers, config.model.hidden_size, config.micro_batch_size,
              config.model.seq_length);
  // The floor fits, so the model's param list is of a size this machine can hold: plan it exactly.
  const MemoryPlan plan = plan_train_memory(config, {.dp = dp, .ranks_on_this_machine = ranks_here});
  const double build = static_cast<double>(plan.build_live_bytes + plan.build_untracked_bytes);
  const double rank_bytes = std::max(static_cast<double>(plan.overall.total_peak_bytes), build) + data_bytes;
  MXDDP_CHECK(rank_bytes * ranks_here <= available,
              "this run does not fit in this machine's memory: {} rank{} here need {} ({} each: a peak of {} by the "
              "plan, of which activations and scratch {}, gathered params {}; {} while the buffers are built; data {}; "
              "`mxddp plan` with the same flags shows every category) and {} is available. Give a smaller micro-batch "
              "(--micro-batch-size {}) or sequence (--seq-length {}), recompute (--recompute-granularity full), fewer "
              "ranks here, or shard more (--use-megatron-fsdp)",
              ranks_here, ranks_here == 1 ? "" : "s", format_bytes(rank_bytes * ranks_here), format_bytes(rank_bytes),
              format_bytes(static_cast<double>(plan.overall.total_peak_bytes)),
              format_bytes(static_cast<double>(plan.overall.peak(MemoryCategory::kScratch))),
              format_bytes(static_cast<double>(plan.overall.peak(MemoryCategory::kGathered))), format_bytes(build),
              format_bytes(data_bytes), format_bytes(available), config.micro_batch_size, config.model.seq_length);
}

}  // namespace mxddp
