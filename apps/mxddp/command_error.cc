// The mxddp command's error text: see command_error.h.
#include "command_error.h"

#include <new>

#include <fmt/core.h>

namespace mxddp::app {

std::string command_error_text(const std::exception& e, std::string_view subcommand) {
  // Sizes come from flags and files, so an allocation can fail anywhere; "std::bad_alloc" alone
  // would name nothing the user can change.
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr)
    return fmt::format("mxddp: error: {} ran out of memory (std::bad_alloc): the sizes its flags and input files ask "
                       "for need more memory than this machine could allocate; give smaller ones",
                       subcommand);
  return fmt::format("mxddp: error: {}", e.what());
}

}  // namespace mxddp::app
