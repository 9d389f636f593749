// f64, i64, i32 and bool collectives on the local backend (ranks as threads) at 2, 3 and 4 ranks:
// every collective and reduce op against the serial reference (dtype_checks.h), and the ops these
// dtypes refuse.
#include <tuple>

#include "comm/dtype_checks.h"

namespace mxddp::testing {
namespace {

class LocalDTypes : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(LocalDTypes, EveryCollectiveAndOpMatchesSerialReference) {
  const auto [size, dtype] = GetParam();
  run_local(size, [dtype](Communicator& comm) {
    switch (dtype) {
      case DType::kF64: return check_dtype_collectives<DType::kF64>(comm);
      case DType::kI64: return check_dtype_collectives<DType::kI64>(comm);
      case DType::kI32: return check_dtype_collectives<DType::kI32>(comm);
      case DType::kBool: return check_dtype_collectives<DType::kBool>(comm);
      default: FAIL() << "no check for " << dtype_name(dtype);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(RanksAndDTypes, LocalDTypes,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(DType::kF64, DType::kI64, DType::kI32, DType::kBool)),
                         [](const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
                           return fmt::format("np{}_{}", std::get<0>(info.param), dtype_name(std::get<1>(info.param)));
                         });

TEST(LocalDTypes, AvgAndPrescaleOfIntegersAndBoolAreRefused) {
  LocalGroup group(1);
  check_integer_ops_refused(group.communicator(0));
}

TEST(LocalDTypes, NamesRoundTrip) {
  for (const DType d : {DType::kF64, DType::kI64, DType::kI32, DType::kBool}) EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  EXPECT_EQ(dtype_size_bytes(DType::kF64), 8u);
  EXPECT_EQ(dtype_size_bytes(DType::kI64), 8u);
  EXPECT_EQ(dtype_size_bytes(DType::kI32), 4u);
  EXPECT_EQ(dtype_size_bytes(DType::kBool), 1u);
}

}  // namespace
}  // namespace mxddp::testing
