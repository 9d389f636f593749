// Overflow-checked size arithmetic (see core.h): the one place where a product or sum computed
// from user input is checked, so a huge shape is an error and never a wrapped, wrong size.
#include <mxddp/core.h>

namespace mxddp {

int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t product = 0;
  MXDDP_CHECK(!__builtin_mul_overflow(a, b, &product), "{}: {} x {} does not fit in a signed 64-bit integer", what,
              a, b);
  return product;
}

int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t sum = 0;
  MXDDP_CHECK(!__builtin_add_overflow(a, b, &sum), "{}: {} + {} does not fit in a signed 64-bit integer", what, a, b);
  return sum;
}

}  // namespace mxddp
