// The optimizer kernels against a scalar reference written from the formulas (PyTorch's AdamW and
// SGD), for every grad/param dtype combination the optimizer dispatches.
#include <random>

#include <gtest/gtest.h>

#include "optim/adamw_kernel.h"

namespace mxddp::optim_kernel {
namespace {

struct Inputs {
  std::vector<float> grad, main, m, v;
};

Inputs random_inputs(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1, 1);
  Inputs in;
  for (int64_t i = 0; i < n; ++i) {
    in.grad.push_back(bf16_to_f32(f32_to_bf16(d(rng))));  // representable in bf16 too
    in.main.push_back(d(rng));
    in.m.push_back(0.1f * d(rng));
    in.v.push_back(0.01f * std::fabs(d(rng)));
  }
  return in;
}

template <typename G, typename P>
void check_adamw() {
  const int64_t n = 1003;
  Inputs in = random_inputs(n, 5);
  const AdamScalars s{1e-3f, 0.1f, 0.9f, 0.999f, 1e-8f, 1e-3f / 0.19f, 0.0447f, 0.5f};
  std::vector<G> grad(n);
  for (int64_t i = 0; i < n; ++i) store(grad.data(), i, in.grad[static_cast<size_t>(i)]);
  std::vector<P> param(n);
  Inputs out = in;
  adamw(grad.data(), out.main.data(), out.m.data(), out.v.data(), param.data(), n, s);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const float g = in.grad[i] * s.clip_coeff;
    float p = in.main[i] * (1.0f - s.lr * s.weight_decay);
    const float m = s.beta1 * in.m[i] + (1.0f - s.beta1) * g;
    const float v = s.beta2 * in.v[i] + (1.0f - s.beta2) * g * g;
    p -= s.step_size * m / (std::sqrt(v) / s.bias_correction2_sqrt + s.eps);
    ASSERT_EQ(out.m[i], m) << i;
    ASSERT_EQ(out.v[i], v) << i;
    ASSERT_EQ(out.main[i], p) << i;
    const float staged = sizeof(P) == sizeof(float) ? p : bf16_to_f32(f32_to_bf16(p));
    ASSERT_EQ(load(param.data(), static_cast<int64_t>(i)), staged) << i;
  }
}

TEST(OptimKernel, AdamWMatchesScalarFormulaForEveryDTypePair) {
  check_adamw<float, float>();
  check_adamw<float, bf16_bits>();
  check_adamw<bf16_bits, float>();
  check_adamw<bf16_bits, bf16_bits>();
}

TEST(OptimKernel, SgdMatchesScalarFormula) {
  const int64_t n = 517;
  Inputs in = random_inputs(n, 9);
  const SgdScalars s{0.05f, 0.01f, 0.9f, 0.75f};
  std::vector<bf16_bits> param(n);
  Inputs out = in;
  sgd(in.grad.data(), out.main.data(), out.m.data(), param.data(), n, s);
  for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
    const float g = in.grad[i] * s.clip_coeff + s.weight_decay * in.main[i];
    const float buf = s.momentum * in.m[i] + g;
    ASSERT_EQ(out.m[i], buf);
    ASSERT_EQ(out.main[i], in.main[i] - s.lr * buf);
    ASSERT_EQ(param[i], f32_to_bf16(out.main[i]));
  }
}

TEST(OptimKernel, SumOfSquaresMatchesLongDouble) {
  for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{8}, int64_t{1001}}) {
    Inputs in = random_inputs(n, 3);
    long double want = 0;
    for (float g : in.grad) want += static_cast<long double>(g) * g;
    EXPECT_NEAR(sum_of_squares(in.grad.data(), n), static_cast<double>(want), 1e-12 * static_cast<double>(want) + 1e-300);
    std::vector<bf16_bits> h(static_cast<size_t>(n));
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(in.grad[i]);
    EXPECT_NEAR(sum_of_squares(h.data(), n), static_cast<double>(want), 1e-12 * static_cast<double>(want) + 1e-300);
  }
}

}  // namespace
}  // namespace mxddp::optim_kernel
