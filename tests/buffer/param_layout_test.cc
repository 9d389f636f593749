// The layout rule on hand-computed cases, and its invariants on many generated param lists.
#include <random>

#include <gtest/gtest.h>

#include <mxddp/buffer.h>

namespace mxddp {
namespace {

// Params named p0.. with the given element counts (1-D), in registration order.
std::vector<ParamSpec> vec_params(const std::vector<int64_t>& numels) {
  std::vector<ParamSpec> specs;
  for (int64_t n : numels) specs.push_back({fmt::format("p{}", specs.size()), Shape{n}, false});
  return specs;
}

LayoutOptions dist_opt(int dp, std::optional<int64_t> bucket_size = std::nullopt) {
  return LayoutOptions{.dp = dp, .bucket_size = bucket_size, .use_distributed_optimizer = true};
}

TEST(ParamLayout, ParamStartsRoundUpTo64WithDistributedOptimizer) {
  // The layout-first param (registered last) has x elements; the next one starts at round_up(x, 64).
  for (auto [x, want] : std::vector<std::pair<int64_t, int64_t>>{{1, 64}, {63, 64}, {64, 64}, {65, 128}, {128, 128}}) {
    const ParamLayout l = compute_param_layout(vec_params({10, x}), dist_opt(1));
    EXPECT_EQ(l.params[1].range, (Range{0, x}));
    EXPECT_EQ(l.params[0].range.start, want) << "x = " << x;
  }
}

TEST(ParamLayout, ReverseRegistrationOrder) {
  const ParamLayout l = compute_param_layout(vec_params({3, 5, 7}), {.dp = 1});
  EXPECT_EQ(l.params[2].range, (Range{0, 7}));
  EXPECT_EQ(l.params[1].range, (Range{7, 12}));
  EXPECT_EQ(l.params[0].range, (Range{12, 15}));
  ASSERT_EQ(l.buckets.size(), 1u);
  EXPECT_EQ(l.buckets[0].params, (std::vector<int>{2, 1, 0}));
}

TEST(ParamLayout, NoPaddingWithoutDistributedOptimizer) {
  const ParamLayout l = compute_param_layout(vec_params({65, 1, 63}), {.dp = 8, .bucket_size = 64});
  EXPECT_EQ(l.params[2].range, (Range{0, 63}));
  EXPECT_EQ(l.params[1].range, (Range{63, 64}));  // bucket 0 closes at 64 >= 64, unpadded
  EXPECT_EQ(l.params[0].range, (Range{64, 129}));
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.buckets[0].range, (Range{0, 64}));
  EXPECT_EQ(l.buckets[1].range, (Range{64, 129}));
  EXPECT_EQ(l.numel, 129);
  EXPECT_TRUE(l.shards.empty());
}

TEST(ParamLayout, BucketClosesAtAndAroundTheThreshold) {
  // Layout order is reversed registration: numels 50, 49, 1, 30 (registered 30, 1, 49, 50).
  const ParamLayout l = compute_param_layout(vec_params({30, 1, 49, 50}), {.dp = 1, .bucket_size = 100});
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.buckets[0].range, (Range{0, 100})) << "50+49 = 99 < 100 stays open; +1 reaches 100 and closes";
  EXPECT_EQ(l.buckets[1].range, (Range{100, 130}));
  EXPECT_EQ(l.params[0].bucket, 1);
  EXPECT_EQ(l.params[1].bucket, 0);
  // One element past the threshold closes too; one below does not.
  EXPECT_EQ(compute_param_layout(vec_params({1, 101}), {.dp = 1, .bucket_size = 100}).buckets.size(), 2u);
  EXPECT_EQ(compute_param_layout(vec_params({1, 99}), {.dp = 1, .bucket_size = 100}).buckets.size(), 1u);
  EXPECT_EQ(compute_param_layout(vec_params({1, 99}), {.dp = 1, .bucket_size = 100}).buckets[0].range, (Range{0, 100}));
}

TEST(ParamLayout, BucketEndsPadToLcmOfDpAnd128) {
  // dp 3: bucket ends on multiples of lcm(3, 128) = 384.
  const ParamLayout l = compute_param_layout(vec_params({10, 300, 100}), dist_opt(3, 100));
  ASSERT_EQ(l.buckets.size(), 3u);
  EXPECT_EQ(l.buckets[0].range, (Range{0, 384}));
  EXPECT_EQ(l.buckets[0].numel_unpadded, 100);
  EXPECT_EQ(l.params[1].range, (Range{384, 684}));
  EXPECT_EQ(l.buckets[1].range, (Range{384, 768}));
  EXPECT_EQ(l.params[0].range, (Range{768, 778}));
  EXPECT_EQ(l.buckets[2].range, (Range{768, 1152}));
  EXPECT_EQ(l.numel, 1152);
}

TEST(ParamLayout, HighBusbwPaddingUsesLcmWith65536) {
  const ParamLayout l = compute_param_layout(
      vec_params({10}), {.dp = 3, .use_distributed_optimizer = true, .pad_buckets_for_high_nccl_busbw = true});
  EXPECT_EQ(l.buckets[0].range, (Range{0, 196608}));  // lcm(3, 128, 65536)
  const ParamLayout l8 = compute_param_layout(
      vec_params({10}), {.dp = 8, .use_distributed_optimizer = true, .pad_buckets_for_high_nccl_busbw = true});
  EXPECT_EQ(l8.buckets[0].range, (Range{0, 65536}));
}

TEST(ParamLayout, SharedEmbeddingGetsItsOwnBucket) {
  // Registration order [emb?, a, b, c]; layout order reversed; one bucket otherwise.
  auto with_shared = [](int index) {
    auto specs = vec_params({100, 20, 30, 40});
    specs[static_cast<size_t>(index)].shared_embedding = true;
    return compute_param_layout(specs, dist_opt(2));
  };
  {  // first registered (the usual word embedding): laid out last, after closing the others' bucket
    const ParamLayout l = with_shared(0);
    ASSERT_EQ(l.buckets.size(), 2u);
    EXPECT_EQ(l.buckets[0].params, (std::vector<int>{3, 2, 1}));
    EXPECT_EQ(l.buckets[1].params, (std::vector<int>{0}));
    EXPECT_EQ(l.buckets[0].range, (Range{0, 256}));
    EXPECT_EQ(l.params[0].range, (Range{256, 356}));
  }
  {  // in the middle: three buckets
    const ParamLayout l = with_shared(2);
    ASSERT_EQ(l.buckets.size(), 3u);
    EXPECT_EQ(l.buckets[0].params, (std::vector<int>{3}));
    EXPECT_EQ(l.buckets[1].params, (std::vector<int>{2}));
    EXPECT_EQ(l.buckets[2].params, (std::vector<int>{1, 0}));
  }
  {  // registered last: laid out first, alone, then the rest
    const ParamLayout l = with_shared(3);
    ASSERT_EQ(l.buckets.size(), 2u);
    EXPECT_EQ(l.buckets[0].params, (std::vector<int>{3}));
    EXPECT_EQ(l.buckets[1].params, (std::vector<int>{2, 1, 0}));
  }
}

// Megatron's metadata around a shared embedding (issue 15, point 2), on its own example: shapes
// 95x95, 95x95, 95x95, 95 at dp 4 with param 2 shared. With the distributed optimizer the bucket
// closed before the shared param counts up to that param's padded start (128), not to the last
// param's end (95). Without it, the shared param has no bucket of its own: one bucket of every
// param unpadded, 3 x 9025 + 95 = 27170 elements.
TEST(ParamLayout, SharedEmbeddingMetadataAsMegatron) {
  std::vector<ParamSpec> specs = {{"a", Shape{95, 95}}, {"b", Shape{95, 95}}, {"c", Shape{95, 95}}, {"d", Shape{95}}};
  specs[2].shared_embedding = true;
  const ParamLayout dist = compute_param_layout(specs, dist_opt(4));
  ASSERT_EQ(dist.buckets.size(), 3u);
  EXPECT_EQ(dist.buckets[0].params, (std::vector<int>{3}));
  EXPECT_EQ(dist.buckets[0].numel_unpadded, 128);
  EXPECT_EQ(dist.buckets[0].range, (Range{0, 128}));
  EXPECT_EQ(dist.buckets[1].params, (std::vector<int>{2}));
  EXPECT_EQ(dist.buckets[1].numel_unpadded, 9025);
  const ParamLayout plain = compute_param_layout(specs, {.dp = 4});
  ASSERT_EQ(plain.buckets.size(), 1u);
  EXPECT_EQ(plain.buckets[0].range, (Range{0, 27170}));
  EXPECT_EQ(plain.buckets[0].numel_unpadded, 27170);
  EXPECT_EQ(plain.buckets[0].params, (std::vector<int>{3, 2, 1, 0}));
}

// The buffer's numel_unpadded is Megatron's _ParamAndGradBuffer.numel_unpadded: the buckets'
// numel_unpadded summed, so padding before a param's start inside a bucket counts (issue 30 point
// 4 v). Megatron-core's own buffer gives 9184 here: bucket 0 holds p2 [0, 1) and p1 [64, 159), so
// it counts 159, not 96; bucket 1, the shared p0, counts 9025. The params alone are 9121.
TEST(ParamLayout, BufferNumelUnpaddedIsTheBucketsSumAsMegatron) {
  std::vector<ParamSpec> specs = {{"p0", Shape{95, 95}}, {"p1", Shape{95}}, {"p2", Shape{1}}};
  specs[0].shared_embedding = true;
  const ParamLayout l = compute_param_layout(specs, dist_opt(4, 100));
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.buckets[0].numel_unpadded, 159);
  EXPECT_EQ(l.buckets[1].numel_unpadded, 9025);
  EXPECT_EQ(l.numel_unpadded(), 9184);
  EXPECT_EQ(l.params_numel(), 9121);
  EXPECT_EQ(l.numel, 9344);
  // Without the distributed optimizer nothing is padded: all three figures agree (Megatron asserts
  // numel == numel_unpadded there).
  const ParamLayout plain = compute_param_layout(specs, {.dp = 4, .bucket_size = 100});
  EXPECT_EQ(plain.numel_unpadded(), 9121);
  EXPECT_EQ(plain.params_numel(), 9121);
  EXPECT_EQ(plain.numel, 9121);
}

TEST(ParamLayout, DefaultBucketSize) {
  EXPECT_EQ(default_bucket_size(1, true), 40'000'000);
  EXPECT_EQ(default_bucket_size(40, true), 40'000'000);
  EXPECT_EQ(default_bucket_size(64, true), 64'000'000);
  EXPECT_EQ(default_bucket_size(8, false), std::nullopt);
}

TEST(ParamLayout, ErrorsNameTheBadValue) {
  auto expect_error = [](auto&& fn, std::string_view needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([] { compute_param_layout({}, {.dp = 1}); }, "empty list");
  expect_error([] { compute_param_layout(vec_params({4}), {.dp = 0}); }, "dp must be >= 1; got 0");
  expect_error([] { compute_param_layout(vec_params({4}), {.dp = 1, .bucket_size = 0}); }, "bucket_size must be >= 1");
  expect_error([] { compute_param_layout({{"w", Shape{2}}, {"w", Shape{3}}}, {.dp = 1}); }, "'w' appears twice");
  expect_error([] { compute_param_layout({{"w", Shape{0, 3}}}, {.dp = 1}); }, "no elements");
}

// Invariants over generated lists: buckets tile the buffer, params are disjoint and inside their
// bucket, padding rules hold, and the shards of all ranks cover every param element exactly once.
TEST(ParamLayout, InvariantsAndShardCoverageOnGeneratedLists) {
  std::mt19937 rng(42);
  for (int trial = 0; trial < 200; ++trial) {
    const int dp = 1 + static_cast<int>(rng() % 8);
    std::vector<int64_t> numels(1 + rng() % 12);
    for (auto& n : numels) n = 1 + static_cast<int64_t>(rng() % 3000);
    auto specs = vec_params(numels);
    if (rng() % 3 == 0) specs[rng() % specs.size()].shared_embedding = true;
    const std::optional<int64_t> bucket = rng() % 4 == 0 ? std::nullopt : std::optional<int64_t>(1 + rng() % 5000);
    const ParamLayout l = compute_param_layout(specs, dist_opt(dp, bucket));
    const int64_t end_align = lcm(dp, 128);
    int64_t expect_start = 0;
    for (size_t b = 0; b < l.buckets.size(); ++b) {
      const BucketPlacement& k = l.buckets[b];
      EXPECT_EQ(k.range.start, expect_start);
      EXPECT_EQ(k.range.end % end_align, 0);
      EXPECT_EQ(k.range.size() % dp, 0);
      expect_start = k.range.end;
      for (int p : k.params) {
        const ParamPlacement& pp = l.params[static_cast<size_t>(p)];
        EXPECT_EQ(pp.bucket, static_cast<int>(b));
        EXPECT_EQ(pp.range.start % 64, 0);
        EXPECT_GE(pp.range.start, k.range.start);
        EXPECT_LE(pp.range.end, k.range.start + k.numel_unpadded);
      }
    }
    EXPECT_EQ(l.numel, expect_start);
    int64_t buckets_unpadded = 0, params = 0;
    for (const BucketPlacement& k : l.buckets) buckets_unpadded += k.numel_unpadded;
    for (const ParamSpec& s : specs) params += s.shape.numel();
    EXPECT_EQ(l.numel_unpadded(), buckets_unpadded);
    EXPECT_EQ(l.params_numel(), params);
    EXPECT_LE(l.params_numel(), l.numel_unpadded());
    EXPECT_LE(l.numel_unpadded(), l.numel);
    // Shard coverage: count how often each element of each param is covered.
    std::vector<std::vector<int>> covered(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) covered[i].assign(static_cast<size_t>(specs[i].shape.numel()), 0);
    ASSERT_EQ(l.shards.size(), static_cast<size_t>(dp));
    for (int r = 0; r < dp; ++r)
      for (size_t b = 0; b < l.buckets.size(); ++b) {
        const BucketShard& s = l.shards[static_cast<size_t>(r)][b];
        EXPECT_EQ(s.range.size(), l.buckets[b].range.size() / dp);
        EXPECT_EQ(s.range.start, l.buckets[b].range.start + r * s.range.size());
        for (const ShardParamRange& sp : s.params) {
          EXPECT_EQ(sp.in_buffer.size(), sp.in_param.size());
          EXPECT_EQ(sp.in_buffer.start - s.range.start, sp.in_shard.start);
          EXPECT_EQ(l.params[static_cast<size_t>(sp.param)].range.start + sp.in_param.start, sp.in_buffer.start);
          for (int64_t e = sp.in_param.start; e < sp.in_param.end; ++e) ++covered[static_cast<size_t>(sp.param)][static_cast<size_t>(e)];
        }
      }
    for (size_t i = 0; i < specs.size(); ++i)
      for (int c : covered[i]) ASSERT_EQ(c, 1) << "trial " << trial << " param " << i;
  }
}

}  // namespace
}  // namespace mxddp
