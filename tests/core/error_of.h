// error_of: the message of the mxddp::Error a callable throws, or "(no error)", for tests that
// assert what an error says.
#pragma once

#include <functional>
#include <string>

#include <mxddp/core.h>

namespace mxddp::testing {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no error)";
}

}  // namespace mxddp::testing
