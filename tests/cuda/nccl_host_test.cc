// The NCCL communicator's parts that need no GPU (include/mxddp/nccl.h), in every build that has
// it, CI included: the library's version, fresh unique ids, the arguments refused (each named)
// before any device is touched, and the reason given where no device is usable.
#include <algorithm>
#include <string>

#include <gtest/gtest.h>

#include <mxddp/nccl.h>

namespace mxddp::testing {
namespace {

// What make_nccl_communicator said, or "" if it made one. The id is never used (the arguments are
// checked before it is), so none is made: each would open a bootstrap socket.
std::string refusal(int rank, int size, const NcclOptions& options = {}) {
  try {
    make_nccl_communicator(NcclUniqueId{}, rank, size, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The backend needs ncclCommSplit (NCCL 2.18), the nonblocking communicator and its finalize
// (2.14), and PreMulSum (2.11).
TEST(NcclHost, TheLibraryIsRecentEnough) {
  const int version = nccl_version();
  std::printf("NCCL version code %d\n", version);
  EXPECT_GE(version, 21800);
}

TEST(NcclHost, UniqueIdsAreFreshEachTime) {
  const NcclUniqueId a = nccl_unique_id(), b = nccl_unique_id();
  EXPECT_NE(a, b);
  EXPECT_TRUE(std::any_of(a.bytes.begin(), a.bytes.end(), [](char c) { return c != 0; }));
}

TEST(NcclHost, RefusesRanksSizesDevicesAndTimeoutsOutOfRange) {
  EXPECT_NE(refusal(0, 0).find("size 0 must be at least 1"), std::string::npos) << refusal(0, 0);
  EXPECT_NE(refusal(-1, 2).find("rank -1 is not in 0..1 (size 2)"), std::string::npos) << refusal(-1, 2);
  EXPECT_NE(refusal(2, 2).find("rank 2 is not in 0..1 (size 2)"), std::string::npos) << refusal(2, 2);
  EXPECT_NE(refusal(0, 1, {.device = -2}).find("NcclOptions::device -2"), std::string::npos) << refusal(0, 1, {.device = -2});
  EXPECT_NE(refusal(0, 1, {.timeout_ms = 0}).find("NcclOptions::timeout_ms 0 must be positive"), std::string::npos);
}

// Without a device, joining is refused with CUDA's reason (CI, this VM); with one, a device index
// beyond the last is refused naming it.
TEST(NcclHost, SaysWhyNoCommunicatorCanBeMadeHere) {
  std::string why;
  const int devices = cuda_device_count(&why);
  if (devices == 0) {
    const std::string said = refusal(0, 1);
    EXPECT_NE(said.find("make_nccl_communicator (rank 0 of 1): " + why), std::string::npos) << said;
  } else {
    const std::string said = refusal(0, 1, {.device = devices});
    EXPECT_NE(said.find(fmt::format("NcclOptions::device {} does not exist", devices)), std::string::npos) << said;
  }
}

}  // namespace
}  // namespace mxddp::testing
