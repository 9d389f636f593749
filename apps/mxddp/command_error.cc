// The mxddp command's error text: see command_error.h.
#include "command_error.h"

#include <new>
#include <system_error>

#include <fmt/core.h>

#include <mxddp/memory.h>

namespace mxddp::app {

std::string command_error_text(const std::exception& e, std::string_view subcommand) {
  // Sizes come from flags and files, so an allocation can fail anywhere; "std::bad_alloc" alone
  // would name nothing the user can change.
  // mxddp's own allocations throw OutOfMemory, which names the request.
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    const auto* request = dynamic_cast<const OutOfMemory*>(&e);
    return fmt::format("mxddp: error: {} ran out of memory (std::bad_alloc): the sizes its flags and input files ask "
                       "for need more memory than this machine could allocate{}; give smaller ones",
                       subcommand, request != nullptr ? fmt::format(" ({})", request->what()) : "");
  }
  // std::thread's EAGAIN: no memory (or address space) left for the new thread's stack, or the
  // limit on processes reached.
  const auto* system = dynamic_cast<const std::system_error*>(&e);
  if (system != nullptr && system->code() == std::errc::resource_unavailable_try_again)
    return fmt::format("mxddp: error: {} could not start a thread ({}): out of memory for its stack, or at the "
                       "limit on processes (ulimit -u)",
                       subcommand, e.what());
  return fmt::format("mxddp: error: {}", e.what());
}

}  // namespace mxddp::app
