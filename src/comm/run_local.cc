// run_local: the usual way to use the local backend: one thread per rank, joined, with the first
// failure (the root cause, not the peers' "group aborted" echoes) rethrown to the caller.
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <mxddp/comm.h>

namespace mxddp {

void run_local(int size, const std::function<void(Communicator&)>& rank_fn, const LocalOptions& options) {
  LocalGroup group(size, options);
  std::mutex mutex;
  std::exception_ptr first_failure;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          rank_fn(group.communicator(r));
        } catch (...) {
          std::string what = "unknown exception";
          try {
            throw;
          } catch (const std::exception& e) {
            what = e.what();
          } catch (...) {
          }
          {
            std::lock_guard lock(mutex);
            if (!first_failure) first_failure = std::current_exception();
          }
          group.abort(fmt::format("rank {} failed: {}", r, what));
        }
      });
    } catch (...) {
      // A rank whose thread cannot start (no memory left for its stack) ends the ranks already
      // running, which would wait for it forever; a joinable std::thread destroyed would terminate.
      group.abort(fmt::format("rank {} could not be started", r));
      for (auto& t : threads) t.join();
      throw;
    }
  }
  for (auto& t : threads) t.join();
  if (first_failure) std::rethrow_exception(first_failure);
}

}  // namespace mxddp
