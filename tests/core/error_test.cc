// The check macros carry file:line and a formatted message naming the bad value.
#include <gtest/gtest.h>

#include <mxddp/core.h>

namespace mxddp {
namespace {

void check_positive(int dp) { MXDDP_CHECK(dp > 0, "dp must be positive; got {}", dp); }

TEST(Error, CheckCarriesLocationAndMessage) {
  try {
    check_positive(-3);
    FAIL() << "MXDDP_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "dp must be positive; got -3");
    EXPECT_EQ(e.where().rfind("error_test.cc:", 0), 0u) << e.where();
    EXPECT_EQ(std::string(e.what()), e.where() + ": " + e.message());
  }
  EXPECT_NO_THROW(check_positive(1));
}

TEST(Error, AssertNamesTheInvariant) {
  try {
    const int live = 1;
    MXDDP_ASSERT(live == 2);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("internal invariant violated: live == 2"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace mxddp
