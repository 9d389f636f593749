// checked_mul and checked_add: exact results up to the int64 limit, an error naming what was
// computed past it.
#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include <mxddp/core.h>

#include "core/error_of.h"

namespace mxddp {
namespace {

using mxddp::testing::error_of;

TEST(CheckedMath, OverflowIsAnErrorNamingWhat) {
  EXPECT_EQ(checked_mul(3037000499, 3037000499, "x"), int64_t{9'223'372'030'926'249'001});
  EXPECT_EQ(checked_add(std::numeric_limits<int64_t>::max() - 1, 1, "x"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(error_of([] { checked_mul(int64_t{1} << 32, int64_t{1} << 32, "--shape 4294967296x4294967296: elements"); }),
            "--shape 4294967296x4294967296: elements: 4294967296 x 4294967296 does not fit in a signed 64-bit integer");
  EXPECT_EQ(error_of([] { checked_mul(3037000500, 3037000500, "e"); }),
            "e: 3037000500 x 3037000500 does not fit in a signed 64-bit integer");
  EXPECT_EQ(error_of([] { checked_add(std::numeric_limits<int64_t>::max(), 1, "s"); }),
            "s: 9223372036854775807 + 1 does not fit in a signed 64-bit integer");
}

}  // namespace
}  // namespace mxddp
