// Every collective, every dtype, 1, 2, 3, 4 and 8 ranks on the local backend, against the serial
// reference of collective_checks.h.
#include "comm/collective_checks.h"

namespace mxddp::testing {
namespace {

struct Case {
  int ranks;
  DType dtype;
};

class LocalCollectives : public ::testing::TestWithParam<Case> {};

TEST_P(LocalCollectives, EveryCollectiveMatchesSerialReference) {
  const Case c = GetParam();
  run_local(c.ranks, [&](Communicator& comm) { check_every_collective(comm, c.dtype); }, {.timeout_ms = 120'000});
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int ranks : {1, 2, 3, 4, 8})
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kU8}) cases.push_back({ranks, dtype});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(RanksByDType, LocalCollectives, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return fmt::format("ranks{}_{}", info.param.ranks, dtype_name(info.param.dtype));
                         });

class LocalAsync : public ::testing::TestWithParam<int> {};

TEST_P(LocalAsync, AsyncCollectiveProgressesWhileCallerComputes) {
  run_local(GetParam(), check_async_progress_without_wait);
}

TEST_P(LocalAsync, MismatchedCountsAndDTypesAreErrorsOnEveryRank) {
  run_local(GetParam(), check_mismatch_is_an_error);
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalAsync, ::testing::Values(1, 2, 3, 4, 8));

}  // namespace
}  // namespace mxddp::testing
