// agreed(): a step that can fail on one rank, after which every rank knows whether any failed.
// Shared by save/load (checkpoint.cc) and the history (history.cc), so ranks never split into some
// that committed and some that did not, and never wait in a collective for a rank that has thrown.
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include <mxddp/comm.h>

#include "../comm/host_collectives.h"

namespace mxddp::ckpt {

// Runs fn on every rank; if it threw on any rank, every rank throws (the failing one its own
// error, the others an error quoting it), having done nothing further. The failing rank's message
// travels to every rank: whichever rank's error a launcher shows, the root cause is in it.
template <typename Fn>
void agreed(Communicator& comm, std::string_view what, Fn&& fn) {
  std::exception_ptr failure;
  std::string message;
  try {
    fn();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    message = e.what();
  } catch (...) {
    failure = std::current_exception();
    message = "unknown exception";
  }
  float failed_rank_plus_one = failure ? static_cast<float>(comm.rank() + 1) : 0.0f;
  all_reduce_host(comm, TensorView{&failed_rank_plus_one, DType::kF32, Shape{1}, Device::cpu()}, {.op = ReduceOp::kMax});
  if (failed_rank_plus_one == 0.0f) return;
  const int root = static_cast<int>(failed_rank_plus_one) - 1;
  constexpr size_t kMessageBytesMax = 4096;
  std::array<char, kMessageBytesMax> text{};  // the root's message, NUL-padded
  if (comm.rank() == root) std::memcpy(text.data(), message.data(), std::min(message.size(), kMessageBytesMax - 1));
  broadcast_host(comm, TensorView{text.data(), DType::kU8, Shape{static_cast<int64_t>(text.size())}, Device::cpu()},
                 {.root = root});
  if (failure) std::rethrow_exception(failure);
  MXDDP_FAIL("{} failed on rank {}: {}; nothing was changed", what, root, text.data());
}

}  // namespace mxddp::ckpt
