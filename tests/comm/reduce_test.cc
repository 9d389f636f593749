// The reduction kernel against a scalar reference, including aliasing (out == an input) and
// lengths around the tile size.
#include <random>

#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "compute/reduce.h"

namespace mxddp {
namespace {

TEST(ReduceArrays, MatchesScalarReferenceAcrossTileBoundaries) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-4, 4);
  for (int64_t n : {int64_t{1}, int64_t{2047}, int64_t{2048}, int64_t{2049}, int64_t{5000}}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      std::vector<std::vector<float>> in(3, std::vector<float>(static_cast<size_t>(n)));
      for (auto& v : in) for (float& x : v) x = dist(rng);
      std::vector<bf16_bits> bf(static_cast<size_t>(n) * 3);
      for (size_t k = 0; k < 3; ++k)
        for (size_t i = 0; i < static_cast<size_t>(n); ++i) bf[k * n + i] = f32_to_bf16(in[k][i]);
      std::vector<float> out_f(static_cast<size_t>(n));
      const void* fin[3] = {in[0].data(), in[1].data(), in[2].data()};
      reduce_arrays(DType::kF32, op, fin, 3, n, out_f.data());
      // bf16, reduced in place into input 1 (aliasing)
      const void* bin[3] = {bf.data(), bf.data() + n, bf.data() + 2 * n};
      std::vector<bf16_bits> bf_in(bf.begin(), bf.end());
      reduce_arrays(DType::kBF16, op, bin, 3, n, bf.data() + n);
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        float want = in[0][i], want_b = bf16_to_f32(bf_in[i]);
        for (size_t k = 1; k < 3; ++k) {
          const float b = bf16_to_f32(bf_in[k * n + i]);
          want = op == ReduceOp::kMax ? std::max(want, in[k][i]) : want + in[k][i];
          want_b = op == ReduceOp::kMax ? std::max(want_b, b) : want_b + b;
        }
        if (op == ReduceOp::kAvg) { want /= 3.0f; want_b /= 3.0f; }
        ASSERT_EQ(out_f[i], want) << "f32 n=" << n << " i=" << i;
        ASSERT_EQ(bf[static_cast<size_t>(n) + i], f32_to_bf16(want_b)) << "bf16 n=" << n << " i=" << i;
      }
    }
  }
}

TEST(ReduceArrays, PrescaleMultipliesEachInputBeforeSumming) {
  const float a[3] = {1.0f, 0.1f, -7.0f}, b[3] = {2.0f, 0.2f, 7.0f}, c[3] = {4.0f, 0.3f, 1.0f};
  const void* in[3] = {a, b, c};
  float out[3];
  const float s = 0.1f;
  reduce_arrays(DType::kF32, ReduceOp::kSum, in, 3, 3, out, s);
  for (int i = 0; i < 3; ++i) {
    float want = a[i] * s;
    want += b[i] * s;
    want += c[i] * s;
    EXPECT_EQ(out[i], want) << i;
  }
  reduce_arrays(DType::kF32, ReduceOp::kAvg, in, 3, 3, out, s);
  for (int i = 0; i < 3; ++i) {
    float want = a[i] * s;
    want += b[i] * s;
    want += c[i] * s;
    EXPECT_EQ(out[i], want / 3.0f) << i;
  }
}

TEST(ReduceArrays, U8SumWrapsAndMaxIsUnsigned) {
  uint8_t a[3] = {250, 0, 128}, b[3] = {10, 255, 129};
  const void* in[2] = {a, b};
  uint8_t sum[3], mx[3];
  reduce_arrays(DType::kU8, ReduceOp::kSum, in, 2, 3, sum);
  reduce_arrays(DType::kU8, ReduceOp::kMax, in, 2, 3, mx);
  EXPECT_EQ(sum[0], 4);
  EXPECT_EQ(sum[1], 255);
  EXPECT_EQ(sum[2], 1);
  EXPECT_EQ(mx[0], 250);
  EXPECT_EQ(mx[1], 255);
  EXPECT_EQ(mx[2], 129);
}


TEST(ReduceArrays, OneInputInPlaceUnscaledTouchesNothing) {
  // A group of one (the gradient reduce-scatter at dp 1) reduces a buffer onto itself: the result
  // is the input, so the call must not even write it. The buffer is made read-only; a write would
  // fault. With a prescale it must still be applied.
  const long page = sysconf(_SC_PAGESIZE);
  void* mem = mmap(nullptr, static_cast<size_t>(page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* values = static_cast<float*>(mem);
  const int64_t count = page / static_cast<long>(sizeof(float));
  for (int64_t i = 0; i < count; ++i) values[i] = static_cast<float>(i) - 7.5f;
  ASSERT_EQ(mprotect(mem, static_cast<size_t>(page), PROT_READ), 0);
  const void* inputs[1] = {values};
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    reduce_arrays(DType::kF32, op, inputs, 1, count, values);
    reduce_arrays(DType::kBF16, op, inputs, 1, count * 2, values);
  }
  ASSERT_EQ(mprotect(mem, static_cast<size_t>(page), PROT_READ | PROT_WRITE), 0);
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(values[i], static_cast<float>(i) - 7.5f);
  reduce_arrays(DType::kF32, ReduceOp::kSum, inputs, 1, count, values, 0.5f);
  for (int64_t i = 0; i < count; ++i) ASSERT_EQ(values[i], (static_cast<float>(i) - 7.5f) * 0.5f);
  munmap(mem, static_cast<size_t>(page));
}

}  // namespace
}  // namespace mxddp
