// The least memory a training run can need, computed from its config alone, so that a run that
// cannot fit is refused with the figure before anything is allocated (a --num-layers in the
// billions used to grow until the kernel killed it). A floor, not a plan: it counts what every
// mode must hold (the padding, buckets and transient gathers are left out), so it never refuses
// a run that fits; `mxddp train --report` measures the real figures.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <mxddp/train.h>

namespace mxddp {

// Bytes, as doubles: a hostile config's figures exceed int64 and only their size matters here.
struct TrainMemoryFloor {
  double init_bytes = 0;       // the f32 initial values, alive while the buffers are built
  double params_bytes = 0;     // model params (bf16, f32 or MXFP8 payloads), this rank's share
  double grads_bytes = 0;      // this rank's share of the grad buffer
  double main_params_bytes = 0;
  double optimizer_state_bytes = 0;
  double activations_bytes = 0;  // one micro-batch: each layer's input and the logits, f32
  double data_bytes = 0;         // the corpus each rank holds
  // One rank's floor: the larger of the build phase (initial values beside the buffers) and the
  // steady state, plus the data.
  double rank_bytes() const;
  std::string describe() const;  // "initial values 1.2 GiB, params 640 MiB, ..."
};

// data_bytes: the corpus size (the built-in corpus, or the --data file's size).
TrainMemoryFloor train_memory_floor(const TrainConfig& config, int dp, double data_bytes);

// A bound on the memory this process can still use, and where it comes from, for messages.
struct MemoryLimit {
  double available_bytes = -1;  // negative when unknown
  std::string source;  // "MemAvailable in /proc/meminfo", "the cgroup memory limit in '.../memory.max': 1 GiB, ..."
};

// ---- cgroups (v1 and v2), from the text of /proc/self/cgroup and /proc/self/mountinfo ----

// One of the process's cgroups that may limit its memory: the unified (v2) one, or v1's memory
// controller's. path is as /proc/self/cgroup gives it ("/user.slice/x.scope").
struct CgroupMembership {
  bool v2 = false;
  std::string path;
};
// The v2 line ("0::/path") and the v1 lines whose controllers include memory ("4:memory:/path",
// "5:cpu,memory:/path") of /proc/self/cgroup's text. Malformed lines are skipped.
std::vector<CgroupMembership> memory_cgroups_of(std::string_view proc_self_cgroup);

// A mounted cgroup hierarchy that holds memory files: cgroup2, or cgroup (v1) with the memory
// controller. root is the directory of the hierarchy mounted there (mountinfo's fourth field).
struct CgroupMount {
  bool v2 = false;
  std::string root;
  std::string mount_point;
};
std::vector<CgroupMount> memory_cgroup_mounts(std::string_view mountinfo);

// The tightest cgroup memory limit on the process: the directories from each of its memory
// cgroups up to its hierarchy's mount point, each one's limit less its usage (v2: memory.max and
// memory.current; v1: memory.limit_in_bytes and memory.usage_in_bytes), where usage leaves out
// the reclaimable page cache (memory.stat's inactive_file). "max", v1's near-2^63 "unlimited",
// and missing or unreadable files set no limit. Negative available_bytes when nothing limits.
MemoryLimit cgroup_memory_limit(std::string_view proc_self_cgroup, std::string_view mountinfo);

// What this machine can still give this process: MemAvailable, capped by its cgroups' limits
// (the process's own cgroups, walked up to the root). Negative available_bytes if nothing can be
// read.
MemoryLimit available_memory();
double available_memory_bytes();  // available_memory().available_bytes

// Throws Error when ranks_here ranks of this config need more than the machine has available,
// naming the figures, the limit's source and what to change. Does nothing when the available
// memory is unknown. The floor is checked first (it costs nothing, whatever the config), then the
// exact plan (plan.h): each rank's peak, or the build phase with the initial values, plus the
// data. Under an address-space limit the ranks of this process are checked against it too, less
// what is mapped already and a reserve for the compute threads' stacks and the libraries' work
// (oneDNN's compiled kernels and scratchpads), which the plan does not count.
void check_train_fits_in_memory(const TrainConfig& config, int dp, int ranks_here, double data_bytes);

}  // namespace mxddp
