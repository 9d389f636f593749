// mxddp::Error and the out-of-line half of the check macros: formatting "file:line: message" once,
// here, keeps the macro expansion at each check site small.
#include <mxddp/core.h>

namespace mxddp {

namespace {
std::string basename_of(const char* path) {
  std::string_view p(path);
  size_t slash = p.rfind('/');
  return std::string(slash == std::string_view::npos ? p : p.substr(slash + 1));
}
}  // namespace

Error::Error(std::string message, std::string where)
    : std::runtime_error(where.empty() ? message : where + ": " + message),
      message_(std::move(message)),
      where_(std::move(where)) {}

namespace detail {
void throw_error(const char* file, int line, std::string message) {
  throw Error(std::move(message), fmt::format("{}:{}", basename_of(file), line));
}
}  // namespace detail

}  // namespace mxddp
