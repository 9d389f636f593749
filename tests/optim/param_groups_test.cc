// Per-param-group hyperparameters of the distributed optimizer (what torch's param_groups give a
// torch optimizer): each param's group, params no group holds, per-param step counts, params a step
// leaves untouched (torch's grad None), the unscale and clip coefficients of a step, the grad_norm
// collective, and torch's Adam with L2 decay, each against a scalar reference written from torch's
// formulas, at dp 1, 2 and 4 on the local backend.
#include <map>
#include <set>

#include <mxddp/model.h>

#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

// torch's AdamW / Adam / SGD over the whole global batch, a group per param (-1: not trained),
// each param counting its own steps. Grads formed as PlainTrainer forms them (rank slices' means
// times 1/parts, summed in slice order), so only the optimizer differs.
struct GroupedReference {
  OptimizerType type;
  std::vector<ParamGroup> groups;
  std::vector<int> group_of;
  std::vector<std::vector<float>> main, m, v, grad;
  std::vector<int64_t> steps;
  double last_norm = 0;

  GroupedReference(OptimizerType t, std::vector<ParamGroup> g, std::vector<int> of)
      : type(t), groups(std::move(g)), group_of(std::move(of)), main(mlp_init()) {
    for (auto& p : main)
      for (float& x : p) x = bf16_to_f32(f32_to_bf16(x));  // the model reads bf16 params
    for (auto& p : main) {
      m.emplace_back(p.size(), 0.0f);
      v.emplace_back(p.size(), 0.0f);
      grad.emplace_back(p.size(), 0.0f);
    }
    steps.assign(main.size(), 0);
  }

  void compute_grads(int step, int parts) {
    std::vector<std::vector<float>> part(grad.size());
    ModelHooks h;
    h.param = [&](int i) {
      std::vector<float> p = main[static_cast<size_t>(i)];
      for (float& x : p) x = bf16_to_f32(f32_to_bf16(x));
      return p;
    };
    h.accumulate = [&](int i, const std::vector<float>& g) { part[static_cast<size_t>(i)] = g; };
    const float scale = 1.0f / static_cast<float>(parts);
    const int local = kGlobalBatch / parts;
    for (int r = 0; r < parts; ++r) {
      forward_backward(h, step, r * local, local);
      for (size_t p = 0; p < grad.size(); ++p)
        for (size_t k = 0; k < grad[p].size(); ++k)
          grad[p][k] = r == 0 ? part[p][k] * scale : grad[p][k] + part[p][k] * scale;
    }
    double sq = 0;
    for (auto& g : grad)
      for (float x : g) sq += static_cast<double>(x) * x;
    last_norm = std::sqrt(sq);
  }

  void update(const std::set<int>& frozen, float coeff) {
    for (size_t p = 0; p < main.size(); ++p) {
      if (group_of[p] < 0 || frozen.contains(static_cast<int>(p))) continue;
      const ParamGroup& g = groups[static_cast<size_t>(group_of[p])];
      const auto t = static_cast<double>(++steps[p]);
      const float bc1 = static_cast<float>(1 - std::pow(static_cast<double>(g.beta1), t));
      const float bc2s = static_cast<float>(std::sqrt(1 - std::pow(static_cast<double>(g.beta2), t)));
      for (size_t i = 0; i < main[p].size(); ++i) {
        float& x = main[p][i];
        float gr = grad[p][i] * coeff;
        if (type == OptimizerType::kAdam) {
          if (g.decoupled_weight_decay) x *= 1.0f - g.lr * g.weight_decay;
          else gr += g.weight_decay * x;  // torch.optim.Adam's L2
          m[p][i] = g.beta1 * m[p][i] + (1 - g.beta1) * gr;
          v[p][i] = g.beta2 * v[p][i] + (1 - g.beta2) * gr * gr;
          x -= (g.lr / bc1) * m[p][i] / (std::sqrt(v[p][i]) / bc2s + g.eps);
        } else {
          gr += g.weight_decay * x;
          m[p][i] = g.momentum * m[p][i] + gr;  // torch's first step: buf = grad (the same, from 0)
          x -= g.lr * (g.momentum == 0 ? gr : m[p][i]);
        }
      }
    }
  }
};

double max_rel_diff(const DistributedOptimizer& opt, const GroupedReference& ref) {
  double worst = 0;
  for (int b = 0; b < opt.num_buckets(); ++b) {
    const float* main = opt.main_params(b).data_as<const float>();
    for (const ShardParamRange& r : opt.bucket(b).owned)
      for (int64_t k = 0; k < r.in_param.size(); ++k) {
        const double got = main[r.in_shard.start + k];
        const double want = ref.main[static_cast<size_t>(r.param)][static_cast<size_t>(r.in_param.start + k)];
        worst = std::max(worst, std::fabs(got - want) / std::max(std::fabs(want), 1e-3));
      }
  }
  return worst;
}

struct Case {
  OptimizerType type = OptimizerType::kAdam;
  std::vector<ParamGroup> groups;
  std::vector<int> group_of;
  std::map<int, std::set<int>> frozen;  // step -> params left untouched
  double unscale = 1.0, clip_coeff = 1.0;
};

// Trains 5 steps under `c` against the reference; returns nothing, checks as it goes.
void check_case(Communicator& comm, const Case& c) {
  MemoryTracker tracker;
  auto init = mlp_init();
  DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
  DistributedOptimizer opt(ddp, {.optimizer = c.type, .clip_grad = 0}, tracker);
  opt.set_param_groups(c.group_of, c.groups);
  GroupedReference ref(c.type, c.groups, c.group_of);
  const int local = kGlobalBatch / comm.size();
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    forward_backward(ddp_hooks(ddp), s, comm.rank() * local, local);
    ddp.finish_grad_sync();
    const auto it = c.frozen.find(s);
    const std::set<int> frozen = it == c.frozen.end() ? std::set<int>{} : it->second;
    ref.compute_grads(s, comm.size());
    EXPECT_NEAR(opt.grad_norm(), ref.last_norm, 1e-6 * ref.last_norm) << "step " << s;
    const StepResult r =
        opt.step({.unscale = c.unscale, .clip_coeff = c.clip_coeff, .frozen = {frozen.begin(), frozen.end()}});
    ASSERT_FALSE(r.skipped);
    EXPECT_NEAR(r.grad_norm, ref.last_norm * c.unscale, 1e-6 * ref.last_norm * c.unscale) << "step " << s;
    ref.update(frozen, static_cast<float>(c.unscale * c.clip_coeff));
  }
  EXPECT_LE(max_rel_diff(opt, ref), 1e-6) << "rank " << comm.rank() << "/" << comm.size();
  EXPECT_EQ(opt.step_count(), 5);
  for (int p = 0; p < ddp.num_params(); ++p) EXPECT_EQ(opt.param_step(p), ref.steps[static_cast<size_t>(p)]) << p;
}

class ParamGroups : public ::testing::TestWithParam<int> {};

// Two groups with their own lr, decay, betas and eps; l2.w in no group (never moves); l0.b left
// untouched at step 2 (so its bias correction runs a step behind the rest).
TEST_P(ParamGroups, AdamWPerGroupHyperparametersFrozenAndUntrainedParams) {
  run_local(GetParam(), [](Communicator& comm) {
    check_case(comm, {.groups = {{.lr = 1e-2f, .weight_decay = 0.1f},
                                 {.lr = 3e-3f, .weight_decay = 0.05f, .beta1 = 0.8f, .beta2 = 0.99f, .eps = 1e-6f}},
                      .group_of = {0, 0, 1, 1, -1, 1},
                      .frozen = {{2, {1}}, {3, {1, 2}}}});
  });
}

TEST_P(ParamGroups, AdamWithL2DecayAsTorchAdam) {
  run_local(GetParam(), [](Communicator& comm) {
    check_case(comm, {.groups = {{.lr = 1e-2f, .weight_decay = 0.2f, .decoupled_weight_decay = false},
                                 {.lr = 5e-3f, .weight_decay = 0.0f, .decoupled_weight_decay = false}},
                      .group_of = {0, 1, 0, 1, 0, 1}});
  });
}

// torch.optim.SGD: L2 decay, momentum per group, momentum 0 a plain step.
TEST_P(ParamGroups, SgdPerGroupMomentumIncludingNone) {
  run_local(GetParam(), [](Communicator& comm) {
    check_case(comm, {.type = OptimizerType::kSgd,
                      .groups = {{.lr = 5e-2f, .weight_decay = 0.1f, .momentum = 0.9f},
                                 {.lr = 2e-2f, .weight_decay = 0.01f, .momentum = 0.0f}},
                      .group_of = {0, 1, 0, 1, 1, 0},
                      .frozen = {{1, {4}}}});
  });
}

// The step's grad multipliers: GradScaler's 1/scale (the norm is reported unscaled) and a clip
// coefficient decided before the step.
TEST_P(ParamGroups, UnscaleAndClipCoefficientMultiplyTheGrads) {
  run_local(GetParam(), [](Communicator& comm) {
    check_case(comm, {.groups = {{.lr = 1e-2f, .weight_decay = 0.1f}},
                      .group_of = {0, 0, 0, 0, 0, 0},
                      .unscale = 1.0 / 1024,
                      .clip_coeff = 0.5});
  });
}

INSTANTIATE_TEST_SUITE_P(Dp, ParamGroups, ::testing::Values(1, 2, 4));

// The OptimizerConfig path is Megatron's two default groups; set_lr reaches both.
TEST(ParamGroupsDefaults, ConfigGivesDecayAndNoDecayGroups) {
  run_local(2, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker);
    DistributedOptimizer opt(ddp, {.lr = 2e-3f, .weight_decay = 0.3f, .adam_beta1 = 0.7f}, tracker);
    ASSERT_EQ(opt.num_groups(), 2);
    EXPECT_EQ(opt.group(0).weight_decay, 0.3f);
    EXPECT_EQ(opt.group(1).weight_decay, 0.0f);
    EXPECT_EQ(opt.group(1).beta1, 0.7f);
    for (int p = 0; p < ddp.num_params(); ++p) EXPECT_EQ(opt.group_of(p), ddp.params()[static_cast<size_t>(p)].shape.ndim() >= 2 ? 0 : 1);
    opt.set_lr(5e-4f);
    EXPECT_EQ(opt.group(0).lr, 5e-4f);
    EXPECT_EQ(opt.group(1).lr, 5e-4f);
    opt.set_step_count(7);
    EXPECT_EQ(opt.param_step(3), 7);
  });
}

TEST(ParamGroupsErrors, NameTheValueAndWhatIsValid) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker);
    DistributedOptimizer opt(ddp, {}, tracker);
    auto expect_error = [](const std::function<void()>& f, const std::string& text) {
      try {
        f();
        ADD_FAILURE() << "no error; expected one containing: " << text;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
      }
    };
    expect_error([&] { opt.set_param_groups({0, 0}, {{}}); }, "2 group indices for 6 registered params");
    expect_error([&] { opt.set_param_groups({0, 0, 0, 0, 0, 2}, {{}, {}}); }, "param 5 has group 2; valid: -1 (not trained) or 0..1");
    expect_error([&] { opt.set_group(0, {.beta2 = 1.0f}); }, "beta2 must be in [0, 1); got 1");
    expect_error([&] { opt.set_group(3, {}); }, "param group 3 does not exist; valid: 0..1");
    expect_error([&] { opt.set_group(0, {.eps = 0.0f}); }, "eps must be finite and > 0; got 0");
    expect_error([&] { opt.step({.frozen = {9}}); }, "frozen param 9 is not registered; valid: 0..5");
    expect_error([&] { opt.step({.unscale = 0.0}); }, "unscale must be finite and > 0; got 0");
  });
}

}  // namespace
}  // namespace mxddp::testing
