// train_memory_floor, the memory this process may use (MemAvailable, its cgroups, its address-space
// limit) and the check of a run against them: see memory_floor.h.
#include "memory_floor.h"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
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

// A whole small file (/proc, cgroup files); nullopt when it cannot be read.
std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// v1 reports "no limit" as the largest page-aligned counter (9223372036854771712 with 4 KiB
// pages); anything from 2^62 on is taken as that.
constexpr double kCgroupUnlimitedBytes = 4611686018427387904.0;

// A cgroup file holding one byte count; nullopt when absent, unreadable, "max" or v1's unlimited.
std::optional<double> cgroup_bytes(const std::string& path) {
  const std::optional<std::string> text = read_text(path);
  if (!text) return std::nullopt;
  std::istringstream in(*text);
  std::string word;
  if (!(in >> word) || word.find_first_not_of("0123456789") != std::string::npos || word.size() > 20)
    return std::nullopt;
  const double bytes = std::stod(word);
  if (bytes >= kCgroupUnlimitedBytes) return std::nullopt;
  return bytes;
}

// The value of key in a memory.stat file ("inactive_file 12345" lines); 0 when absent.
double memory_stat_bytes(const std::string& path, std::string_view key) {
  const std::optional<std::string> text = read_text(path);
  if (!text) return 0;
  std::istringstream in(*text);
  std::string name;
  double value = 0;
  while (in >> name >> value)
    if (name == key) return value;
  return 0;
}

std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (size_t i = 0; i <= text.size(); ++i)
    if (i == text.size() || text[i] == separator) {
      parts.push_back(text.substr(start, i - start));
      start = i + 1;
    }
  return parts;
}

// mountinfo escapes space, tab, newline and backslash in paths as \ooo (octal).
std::string unescape_mountinfo(std::string_view field) {
  const auto octal = [](char c) { return c >= '0' && c <= '7'; };
  std::string out;
  for (size_t i = 0; i < field.size(); ++i) {
    if (field[i] == '\\' && i + 3 < field.size() && octal(field[i + 1]) && octal(field[i + 2]) && octal(field[i + 3])) {
      out.push_back(static_cast<char>((field[i + 1] - '0') * 64 + (field[i + 2] - '0') * 8 + (field[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(field[i]);
    }
  }
  return out;
}

// The directory of cgroup `path` under a mount of the hierarchy's `root`; nullopt when the path
// is outside what is mounted there (another namespace's view).
std::optional<std::string> cgroup_dir(const CgroupMount& mount, const std::string& path) {
  if (mount.root == "/") return mount.mount_point + (path == "/" ? "" : path);
  if (path == mount.root) return mount.mount_point;
  if (path.rfind(mount.root + "/", 0) == 0) return mount.mount_point + path.substr(mount.root.size());
  return std::nullopt;
}

// One cgroup directory's headroom: its limit less its usage without the reclaimable page cache;
// nullopt when it sets no limit.
std::optional<MemoryLimit> cgroup_level_limit(const std::string& dir, bool v2) {
  const std::string limit_file = dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes");
  const std::optional<double> limit = cgroup_bytes(limit_file);
  if (!limit) return std::nullopt;
  const double usage = cgroup_bytes(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes")).value_or(0);
  const double cache = memory_stat_bytes(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file");
  const double used = std::max(0.0, usage - cache);
  return MemoryLimit{std::max(0.0, *limit - used),
                     fmt::format("the cgroup memory limit in '{}': {}, of which {} is in use", limit_file,
                                 format_bytes(*limit), format_bytes(used))};
}

// The smaller of two limits; an unknown one (negative) never wins.
void keep_tighter(MemoryLimit& tightest, MemoryLimit candidate) {
  if (candidate.available_bytes < 0) return;
  if (tightest.available_bytes < 0 || candidate.available_bytes < tightest.available_bytes)
    tightest = std::move(candidate);
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

std::vector<CgroupMembership> memory_cgroups_of(std::string_view proc_self_cgroup) {
  std::vector<CgroupMembership> out;
  for (std::string_view line : split(proc_self_cgroup, '\n')) {
    // "hierarchy-id:controllers:path"; the path may itself hold ':'.
    const size_t first = line.find(':');
    const size_t second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, first), controllers = line.substr(first + 1, second - first - 1);
    const std::string path(line.substr(second + 1));
    if (path.empty() || path[0] != '/') continue;
    if (id == "0" && controllers.empty()) {
      out.push_back({.v2 = true, .path = path});
    } else {
      const std::vector<std::string_view> names = split(controllers, ',');
      if (std::find(names.begin(), names.end(), "memory") != names.end()) out.push_back({.v2 = false, .path = path});
    }
  }
  return out;
}

std::vector<CgroupMount> memory_cgroup_mounts(std::string_view mountinfo) {
  std::vector<CgroupMount> out;
  for (std::string_view line : split(mountinfo, '\n')) {
    // "id parent major:minor root mount-point options [optional fields] - type source super-options"
    std::vector<std::string_view> fields;
    for (std::string_view f : split(line, ' '))
      if (!f.empty()) fields.push_back(f);
    const auto dash = std::find(fields.begin(), fields.end(), "-");
    if (fields.size() < 5 || dash == fields.end() || fields.end() - dash < 2 || dash - fields.begin() < 5) continue;
    const std::string_view type = dash[1];
    const std::string_view super_options = fields.end() - dash >= 4 ? dash[3] : std::string_view();
    const std::vector<std::string_view> options = split(super_options, ',');
    const bool v1_memory = type == "cgroup" && std::find(options.begin(), options.end(), "memory") != options.end();
    if (type != "cgroup2" && !v1_memory) continue;
    out.push_back({.v2 = type == "cgroup2", .root = unescape_mountinfo(fields[3]),
                   .mount_point = unescape_mountinfo(fields[4])});
  }
  return out;
}

MemoryLimit cgroup_memory_limit(std::string_view proc_self_cgroup, std::string_view mountinfo) {
  MemoryLimit tightest;
  const std::vector<CgroupMount> mounts = memory_cgroup_mounts(mountinfo);
  for (const CgroupMembership& group : memory_cgroups_of(proc_self_cgroup))
    for (const CgroupMount& mount : mounts) {
      if (mount.v2 != group.v2) continue;
      const std::optional<std::string> own = cgroup_dir(mount, group.path);
      if (!own) continue;
      // From the process's own cgroup up to the mount point: a parent's limit binds its children.
      std::filesystem::path dir(*own);
      const std::filesystem::path top(mount.mount_point);
      for (;;) {
        if (std::optional<MemoryLimit> level = cgroup_level_limit(dir.string(), group.v2))
          keep_tighter(tightest, std::move(*level));
        if (dir == top || !dir.has_relative_path() || dir.parent_path() == dir) break;
        dir = dir.parent_path();
      }
      break;  // one mount of each hierarchy is enough (others are bind mounts of it)
    }
  return tightest;
}

MemoryLimit available_memory() {
  MemoryLimit tightest;
  keep_tighter(tightest, {meminfo_bytes("MemAvailable:"), "MemAvailable in /proc/meminfo"});
  const std::optional<std::string> cgroups = read_text("/proc/self/cgroup");
  const std::optional<std::string> mountinfo = read_text("/proc/self/mountinfo");
  if (cgroups && mountinfo) keep_tighter(tightest, cgroup_memory_limit(*cgroups, *mountinfo));
  return tightest;
}

double available_memory_bytes() { return available_memory().available_bytes; }

namespace {

// What a run is checked against: memory (the machine's, capped by cgroups) or, under a limit, this
// process's address space.
struct Budget {
  std::string what;  // "this machine's memory"
  double available_bytes = 0;
  int ranks = 1;  // the ranks that share it
  std::string source;
};

// The libraries' own memory beside the plan's bytes: oneDNN's compiled kernels (each a few hundred
// KiB) and scratchpads, malloc's overhead. Only an address-space limit needs it counted: oneDNN
// (2.6) writes a kernel into a null buffer when its memory cannot be mapped, a crash, so a run
// without this room is refused up front.
constexpr double kLibraryWorkspaceBytes = 64.0 * 1024 * 1024;

// The stack a new thread maps (glibc's default, from ulimit -s), which libgomp's threads use too.
double default_thread_stack_bytes() {
  pthread_attr_t attr;
  size_t bytes = 8u << 20;
  if (::pthread_getattr_default_np(&attr) == 0) {
    ::pthread_attr_getstacksize(&attr, &bytes);
    ::pthread_attr_destroy(&attr);
  }
  return static_cast<double>(bytes);
}

// Whether an MPI launcher started this process (launcher.h reads the same variables): then it is
// one rank of the job, on the mpi backend; otherwise the local backend's ranks are its threads.
bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
         std::getenv("PMI_SIZE") != nullptr;
}

std::optional<Budget> address_space_budget(const TrainConfig& config, int ranks_here) {
  const std::optional<AddressSpace> space = address_space_limit();
  if (!space) return std::nullopt;
  // The limit is per process.
  const int ranks = launched_by_mpi() ? 1 : ranks_here;
  // Each rank computes on its own thread and rank_compute_threads - 1 more that are not started yet.
  const double stacks = static_cast<double>(rank_compute_threads(config, ranks_here) - 1) * ranks *
                        default_thread_stack_bytes();
  const double reserve = stacks + kLibraryWorkspaceBytes;
  return Budget{"this process's address space", std::max(0.0, space->limit_bytes - space->mapped_bytes - reserve),
                ranks,
                fmt::format("the address-space limit (ulimit -v, RLIMIT_AS) of {}, less the {} this process has "
                            "mapped and {} kept for its compute threads' stacks and the libraries' work; raise "
                            "ulimit -v",
                            format_bytes(space->limit_bytes), format_bytes(space->mapped_bytes), format_bytes(reserve))};
}

// "2 ranks here need", "1 rank here need" (as the messages have always read).
std::string ranks_need(int ranks) { return fmt::format("{} rank{} here need", ranks, ranks == 1 ? "" : "s"); }

void check_floor_fits(const TrainConfig& config, const TrainMemoryFloor& f, const Budget& b) {
  const double needed = f.rank_bytes() * b.ranks;
  MXDDP_CHECK(needed <= b.available_bytes,
              "this run cannot fit in {}: {} at least {} ({} each: {}) and {} is available ({}). Give a smaller "
              "model (--num-layers {}, --hidden-size {}), micro-batch (--micro-batch-size {}) or sequence "
              "(--seq-length {}), or shard more (--use-megatron-fsdp)",
              b.what, ranks_need(b.ranks), format_bytes(needed), format_bytes(f.rank_bytes()), f.describe(),
              format_bytes(b.available_bytes), b.source, config.model.num_layers, config.model.hidden_size,
              config.micro_batch_size, config.model.seq_length);
}

void check_plan_fits(const TrainConfig& config, const MemoryPlan& plan, double data_bytes, const Budget& b) {
  const double build = static_cast<double>(plan.build_live_bytes + plan.build_untracked_bytes);
  const double rank_bytes = std::max(static_cast<double>(plan.overall.total_peak_bytes), build) + data_bytes;
  MXDDP_CHECK(rank_bytes * b.ranks <= b.available_bytes,
              "this run does not fit in {}: {} {} ({} each: a peak of {} by the plan, of which activations and "
              "scratch {}, gathered params {}; {} while the buffers are built; data {}; `mxddp plan` with the same "
              "flags shows every category) and {} is available ({}). Give a smaller micro-batch "
              "(--micro-batch-size {}) or sequence (--seq-length {}), recompute (--recompute-granularity full), fewer "
              "ranks here, or shard more (--use-megatron-fsdp)",
              b.what, ranks_need(b.ranks), format_bytes(rank_bytes * b.ranks), format_bytes(rank_bytes),
              format_bytes(static_cast<double>(plan.overall.total_peak_bytes)),
              format_bytes(static_cast<double>(plan.overall.peak(MemoryCategory::kScratch))),
              format_bytes(static_cast<double>(plan.overall.peak(MemoryCategory::kGathered))), format_bytes(build),
              format_bytes(data_bytes), format_bytes(b.available_bytes), b.source, config.micro_batch_size,
              config.model.seq_length);
}

}  // namespace

void check_train_fits_in_memory(const TrainConfig& config, int dp, int ranks_here, double data_bytes) {
  std::vector<Budget> budgets;
  const MemoryLimit memory = available_memory();
  if (memory.available_bytes >= 0)
    budgets.push_back({"this machine's memory", memory.available_bytes, ranks_here, memory.source});
  if (std::optional<Budget> space = address_space_budget(config, ranks_here)) budgets.push_back(std::move(*space));
  if (budgets.empty()) return;
  const TrainMemoryFloor f = train_memory_floor(config, dp, data_bytes);
  for (const Budget& b : budgets) check_floor_fits(config, f, b);
  // The floor fits, so the model's param list is of a size this machine can hold: plan it exactly.
  const MemoryPlan plan = plan_train_memory(
      config, {.dp = dp, .ranks_on_this_machine = ranks_here, .mpi_backend = launched_by_mpi()});
  for (const Budget& b : budgets) check_plan_fits(config, plan, data_bytes, b);
}

}  // namespace mxddp
