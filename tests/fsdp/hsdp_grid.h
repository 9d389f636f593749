// The shard x replica grid of in-process ranks the HSDP tests run on: one LocalGroup per shard
// group and one per replica group, each rank taking its communicator from both.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>

namespace mxddp::testing {

// Runs fn(shard comm, replica comm, global rank) on shard x replicas threads. Global rank
// r * shard + s is rank s of shard group r (the shard groups are contiguous, as a host's ranks
// are) and rank r of replica group s. A failure on any rank aborts every group and is rethrown.
// options: every group's (an injected delay: each group's seed offset by its index).
// computes: empty (host memory), or one per global rank, which both of its groups then move its
// bytes with (LocalOptions::computes; a rank's shard and replica buffers are in the same memory).
inline void run_grid(int shard, int replicas,
                     const std::function<void(Communicator& shard_comm, Communicator& replica_comm, int rank)>& fn,
                     const LocalOptions& options = {}, const std::vector<Compute*>& computes = {}) {
  MXDDP_CHECK(computes.empty() || computes.size() == static_cast<size_t>(shard * replicas),
              "run_grid: {} computes for a {} x {} grid; pass one per rank or none", computes.size(), shard, replicas);
  std::vector<std::unique_ptr<LocalGroup>> shard_groups, replica_groups;
  // Group `index`'s options, its ranks' computes being computes[global_rank(i)] for its rank i.
  auto group_options = [&](uint64_t index, int ranks, const std::function<int(int)>& global_rank) {
    LocalOptions o = options;
    o.injected_delay.seed += index;
    if (!computes.empty()) {
      o.computes.clear();
      for (int i = 0; i < ranks; ++i) o.computes.push_back(computes[static_cast<size_t>(global_rank(i))]);
    }
    return o;
  };
  for (int r = 0; r < replicas; ++r)
    shard_groups.push_back(std::make_unique<LocalGroup>(
        shard, group_options(static_cast<uint64_t>(r), shard, [&](int s) { return r * shard + s; })));
  for (int s = 0; s < shard; ++s)
    replica_groups.push_back(std::make_unique<LocalGroup>(
        replicas, group_options(100 + static_cast<uint64_t>(s), replicas, [&](int r) { return r * shard + s; })));
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  for (int r = 0; r < replicas; ++r)
    for (int s = 0; s < shard; ++s)
      threads.emplace_back([&, r, s] {
        try {
          fn(shard_groups[static_cast<size_t>(r)]->communicator(s), replica_groups[static_cast<size_t>(s)]->communicator(r),
             r * shard + s);
        } catch (...) {
          std::lock_guard lock(mutex);
          if (!first) first = std::current_exception();
          for (auto& g : shard_groups) g->abort("a peer failed");
          for (auto& g : replica_groups) g->abort("a peer failed");
        }
      });
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace mxddp::testing
