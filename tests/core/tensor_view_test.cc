// Shapes, views and alignment math: the checked arithmetic everything above is laid out with.
#include <limits>

#include <gtest/gtest.h>

#include <mxddp/core.h>

namespace mxddp {
namespace {

TEST(Shape, NumelAndPrinting) {
  EXPECT_EQ(Shape({}).numel(), 1);  // a scalar
  EXPECT_EQ(Shape({95, 95}).numel(), 9025);
  EXPECT_EQ(Shape({3, 0, 7}).numel(), 0);
  EXPECT_EQ(Shape({95, 95}).to_string(), "[95, 95]");
  EXPECT_EQ(Shape({2, 3}), Shape({2, 3}));
  EXPECT_FALSE(Shape({2, 3}) == Shape({3, 2}));
  EXPECT_THROW(Shape({1, 2, 3, 4, 5, 6, 7}), Error);
  EXPECT_THROW(Shape({-1}), Error);
  const int64_t big = int64_t{1} << 40;
  EXPECT_THROW(Shape({big, big}).numel(), Error);
}

TEST(TensorView, SliceAndBytes) {
  float data[12] = {};
  TensorView v{data, DType::kF32, Shape{3, 4}, Device::cpu()};
  EXPECT_EQ(v.nbytes(), 48u);
  TensorView s = v.slice(4, 4);
  EXPECT_EQ(s.data, data + 4);
  EXPECT_EQ(s.numel(), 4);
  EXPECT_EQ(v.flat().shape, Shape{12});
  EXPECT_EQ(v.to_string(), "f32[3, 4] on cpu");
  EXPECT_EQ(to_string(Device::cuda(1)), "cuda:1");
  EXPECT_NO_THROW(v.slice(12, 0));
  try {
    v.slice(10, 3);
    FAIL() << "out-of-range slice accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("slice [10, 13) is outside the 12 elements"), std::string::npos) << e.what();
  }
}

TEST(Alignment, RoundUpAndLcm) {
  EXPECT_EQ(round_up(0, 64), 0);
  EXPECT_EQ(round_up(1, 64), 64);
  EXPECT_EQ(round_up(64, 64), 64);
  EXPECT_EQ(round_up(65, 64), 128);
  EXPECT_EQ(lcm(3, 128), 384);
  EXPECT_EQ(lcm(8, 128), 128);
  EXPECT_EQ(lcm(lcm(6, 128), 65536), 196608);
  EXPECT_THROW(round_up(5, 0), Error);
  EXPECT_THROW(round_up(std::numeric_limits<int64_t>::max(), 64), Error);
  EXPECT_THROW(lcm(0, 4), Error);
  EXPECT_THROW(lcm(std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 1), Error);
  alignas(64) char buf[128];
  EXPECT_TRUE(is_aligned(buf, 64));
  EXPECT_FALSE(is_aligned(buf + 1, 64));
}

}  // namespace
}  // namespace mxddp
