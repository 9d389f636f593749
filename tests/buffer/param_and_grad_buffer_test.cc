// ParamAndGradBuffer: views land where the layout says, initial values are rounded in, padding is
// zero, dtypes follow the options, bucket groups are formed, and every byte is tracked.
#include <gtest/gtest.h>

#include <mxddp/buffer.h>

namespace mxddp {
namespace {

std::vector<ParamSpec> three_params() { return {{"w", Shape{4, 5}}, {"b", Shape{5}}, {"e", Shape{70}}}; }

TEST(ParamAndGradBuffer, ViewsFollowTheLayoutAndInitialValuesAreRounded) {
  MemoryTracker tracker;
  std::vector<float> w(20), b(5, 1.0f), e(70, -2.0f);
  for (int i = 0; i < 20; ++i) w[static_cast<size_t>(i)] = 1.0f + static_cast<float>(i) * 1e-3f;
  std::vector<TensorView> init = {{w.data(), DType::kF32, Shape{4, 5}}, {b.data(), DType::kF32, Shape{5}},
                                  {e.data(), DType::kF32, Shape{70}}};
  ParamAndGradBuffer buf(three_params(), {.dp = 2, .use_distributed_optimizer = true}, {}, tracker, init);
  const ParamLayout& l = buf.layout();
  // e (registered last) first at 0, b at 128, w at 192; one bucket padded to 256.
  EXPECT_EQ(l.params[2].range, (Range{0, 70}));
  EXPECT_EQ(l.params[1].range, (Range{128, 133}));
  EXPECT_EQ(l.params[0].range, (Range{192, 212}));
  EXPECT_EQ(l.numel, 256);
  TensorView wv = buf.param_data(0);
  EXPECT_EQ(wv.shape, Shape({4, 5}));
  EXPECT_EQ(wv.dtype, DType::kBF16);
  EXPECT_EQ(wv.data, static_cast<char*>(buf.param_buffer().data) + 192 * 2);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(wv.data_as<bf16_bits>()[i], f32_to_bf16(w[static_cast<size_t>(i)]));
  TensorView g = buf.main_grad(1);
  EXPECT_EQ(g.dtype, DType::kF32);
  EXPECT_EQ(g.data, static_cast<char*>(buf.grad_buffer().data) + 128 * 4);
  // Padding (e.g. [70, 128) and [212, 256)) is zero in both buffers.
  for (int64_t i = 70; i < 128; ++i) EXPECT_EQ(buf.param_buffer().data_as<bf16_bits>()[i], 0);
  for (int64_t i = 212; i < 256; ++i) EXPECT_EQ(buf.grad_buffer().data_as<float>()[i], 0.0f);
  // Shards: rank 1's half of the single bucket.
  EXPECT_EQ(buf.grad_shard(0, 1).data, static_cast<char*>(buf.grad_buffer().data) + 128 * 4);
  EXPECT_EQ(buf.param_shard(0, 1).numel(), 128);
  EXPECT_EQ(buf.param_index("b"), 1);
  EXPECT_THROW(buf.param_index("nope"), Error);
}

TEST(ParamAndGradBuffer, MemoryIsTrackedByCategory) {
  MemoryTracker tracker;
  {
    ParamAndGradBuffer buf(three_params(), {.dp = 2, .use_distributed_optimizer = true}, {}, tracker);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kParams), 256 * 2);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 256 * 4);
  }
  {
    ParamAndGradBuffer buf(three_params(), {.dp = 2}, {.grad_reduce_in_fp32 = false}, tracker);
    EXPECT_EQ(buf.grad_buffer().dtype, DType::kBF16);
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kParams), 95 * 2);  // no padding without the dist opt
    EXPECT_EQ(tracker.usage().live(MemoryCategory::kGrads), 95 * 2);
  }
  EXPECT_EQ(tracker.usage().total_live_bytes, 0);
}

TEST(ParamAndGradBuffer, BucketGroups) {
  MemoryTracker tracker;
  std::vector<ParamSpec> specs;
  for (int i = 0; i < 5; ++i) specs.push_back({fmt::format("p{}", i), Shape{100}});
  ParamAndGradBuffer one(specs, {.dp = 1, .bucket_size = 100}, {}, tracker);
  EXPECT_EQ(one.bucket_groups(), (std::vector<std::vector<int>>{{0}, {1}, {2}, {3}, {4}}));
  ParamAndGradBuffer two(specs, {.dp = 1, .bucket_size = 100}, {.buckets_per_group = 2}, tracker);
  EXPECT_EQ(two.bucket_groups(), (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4}}));
}

TEST(ParamAndGradBuffer, RejectsBadInitialValuesAndOptions) {
  MemoryTracker tracker;
  std::vector<float> wrong(3);
  std::vector<TensorView> init = {{wrong.data(), DType::kF32, Shape{3}}, {wrong.data(), DType::kF32, Shape{5}},
                                  {wrong.data(), DType::kF32, Shape{70}}};
  try {
    ParamAndGradBuffer buf(three_params(), {.dp = 1}, {}, tracker, init);
    FAIL() << "a 3-element initial value for a [4, 5] param was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("initial value of 'w' has 3 elements"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tracker.usage().total_live_bytes, 0) << "a failed construction must release what it allocated";
  EXPECT_THROW(ParamAndGradBuffer(three_params(), {.dp = 1}, {.param_dtype = DType::kU8}, tracker), Error);
  EXPECT_THROW(ParamAndGradBuffer(three_params(), {.dp = 1}, {.buckets_per_group = 0}, tracker), Error);
}

}  // namespace
}  // namespace mxddp
