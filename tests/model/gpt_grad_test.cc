// The reference GPT's backward: every param's gradient against central finite differences of
// the forward, all in f64 on a tiny model; recomputation (full and selective) giving the same
// gradients bit for bit, in f64 and in f32; and the f32
// model over DistributedDataParallel (bf16 params, gradients accumulated into main_grad and
// reported with grad_ready) agreeing with the f64 reference.
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/model.h>
#include <mxddp/quant.h>

#include "model/gpt_graph.h"
#include "model/random.h"

namespace mxddp::testing {
namespace {

// vocab 40: every logit matters; seq 5 and 2 heads: a non-trivial causal mask per head.
GptConfig grad_check_config() {
  return GptConfig{.vocab_size = 40, .num_layers = 2, .hidden_size = 8, .num_attention_heads = 2, .seq_length = 5};
}
constexpr int kBatch = 2;

// Random params large enough that every nonlinearity is away from its linear regime.
std::vector<std::vector<double>> random_params(const GptConfig& c, uint64_t seed) {
  model::Rng rng(seed);
  std::vector<std::vector<double>> v;
  for (const ParamSpec& s : gpt_param_specs(c)) {
    std::vector<double> p(static_cast<size_t>(s.shape.numel()));
    const bool norm_weight = s.name.ends_with("layernorm.weight");
    for (double& x : p) x = (norm_weight ? 1.0 : 0.0) + 0.3 * rng.normal();
    v.push_back(std::move(p));
  }
  return v;
}

std::vector<int32_t> random_tokens(const GptConfig& c, uint64_t seed) {
  model::Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(kBatch) * (c.seq_length + 1));
  for (int32_t& x : t) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(c.vocab_size)));
  return t;
}

// The graph in f64 over plain vectors.
struct ReferenceGpt {
  GptConfig config;
  std::vector<std::vector<double>> params, grads;
  // When set, what the data-gradient products read instead of params (MXFP8: column-wise).
  std::vector<std::vector<double>> dgrad_params;
  std::map<std::string, std::vector<double>> scratch;
  std::vector<int> ready_count;
  std::vector<int> ready_order;

  ReferenceGpt(const GptConfig& c, std::vector<std::vector<double>> p) : config(c), params(std::move(p)) {
    for (const auto& x : params) grads.emplace_back(x.size(), 0.0);
    ready_count.assign(params.size(), 0);
  }

  model::GptAccess<double> access() {
    model::GptAccess<double> a;
    a.weight = [this](int i, model::WeightUse use) {
      const bool dgrad = use == model::WeightUse::kDataGrad && !dgrad_params.empty();
      return (dgrad ? dgrad_params : params)[static_cast<size_t>(i)].data();
    };
    a.grad = [this](int i) { return grads[static_cast<size_t>(i)].data(); };
    a.grad_ready = [this](int i) {
      ++ready_count[static_cast<size_t>(i)];
      ready_order.push_back(i);
    };
    a.scratch = [this](const std::string& name, int64_t n) {
      auto& v = scratch[name];
      if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
      return v.data();
    };
    return a;
  }

  double loss(const std::vector<int32_t>& tokens) {
    model::GptGraph<double> g(config, access());
    return g.forward(tokens.data(), kBatch, 0.0);
  }
  double loss_and_grad(const std::vector<int32_t>& tokens,
                       RecomputeGranularity granularity = RecomputeGranularity::kNone, RecomputeModules modules = {}) {
    model::GptGraph<double> g(config, access(), granularity, std::move(modules));
    const double l = g.forward(tokens.data(), kBatch, 1.0);
    g.backward();
    return l;
  }
  // The activations the layers share, dropped after each layer's forward ("rc/..."), sorted.
  std::vector<std::string> shared_scratch() const {
    std::vector<std::string> names;
    for (const auto& [name, storage] : scratch)
      if (name.starts_with("rc/")) names.push_back(name.substr(3));
    return names;
  }
};

// f32 copies of f64 params, and views of them as a DDP's initial values.
struct F32Params {
  std::vector<std::vector<float>> values;
  std::vector<TensorView> views;
  F32Params(const std::vector<std::vector<double>>& params, const std::vector<ParamSpec>& specs) {
    for (const auto& p : params) values.emplace_back(p.begin(), p.end());
    for (size_t i = 0; i < specs.size(); ++i) views.push_back({values[i].data(), DType::kF32, specs[i].shape});
  }
};

// main_grad against expected.grads / n, element by element. The tolerance of a param is 1e-4 of
// the largest |tolerance_from.grads| / n in it, plus 1e-7.
struct GradMismatches {
  int64_t count = 0;
  std::string first;  // the first element out of tolerance, for the failure message
};
GradMismatches main_grad_mismatches(const DistributedDataParallel& ddp, const ReferenceGpt& expected,
                                    const ReferenceGpt& tolerance_from, double n) {
  GradMismatches m;
  const auto& specs = ddp.buffer().params();
  for (size_t p = 0; p < specs.size(); ++p) {
    const float* g = ddp.main_grad(static_cast<int>(p)).data_as<float>();
    double max_abs = 0;
    for (double x : tolerance_from.grads[p]) max_abs = std::max(max_abs, std::abs(x) / n);
    const double tol = 1e-4 * max_abs + 1e-7;
    for (size_t k = 0; k < expected.grads[p].size(); ++k)
      if (std::abs(g[k] - expected.grads[p][k] / n) > tol && m.count++ == 0)
        m.first = fmt::format("{} element {}: {} vs {} (tolerance {})", specs[p].name, k, g[k], expected.grads[p][k] / n, tol);
  }
  return m;
}

TEST(GptGradient, EveryParamMatchesFiniteDifferencesInDouble) {
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 7);
  ReferenceGpt ref(c, random_params(c, 11));
  ref.loss_and_grad(tokens);
  const auto specs = gpt_param_specs(c);
  constexpr double kStep = 1e-5;
  int64_t checked = 0;
  for (size_t p = 0; p < specs.size(); ++p) {
    EXPECT_EQ(ref.ready_count[p], 1) << specs[p].name << " must be reported ready exactly once";
    double max_abs = 0;
    for (double g : ref.grads[p]) max_abs = std::max(max_abs, std::abs(g));
    EXPECT_GT(max_abs, 1e-6) << specs[p].name << ": a zero gradient checks nothing";
    for (size_t k = 0; k < ref.params[p].size(); ++k) {
      const double saved = ref.params[p][k];
      ref.params[p][k] = saved + kStep;
      const double up = ref.loss(tokens);
      ref.params[p][k] = saved - kStep;
      const double down = ref.loss(tokens);
      ref.params[p][k] = saved;
      const double fd = (up - down) / (2 * kStep);
      ASSERT_NEAR(ref.grads[p][k], fd, 1e-7 + 1e-6 * std::abs(fd)) << specs[p].name << " element " << k;
      ++checked;
    }
  }
  EXPECT_EQ(checked, c.num_params());
}

TEST(GptGradient, RecomputeGivesTheSameLossAndGradientsBitwise) {
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 3);
  ReferenceGpt plain(c, random_params(c, 5)), recompute(c, random_params(c, 5));
  // Other values for the data-gradient products (as MXFP8's column-wise copies are), so that a
  // recompute reading those instead of the forward weights changes the result.
  plain.dgrad_params = recompute.dgrad_params = random_params(c, 9);
  EXPECT_EQ(plain.loss_and_grad(tokens), recompute.loss_and_grad(tokens, RecomputeGranularity::kFull));
  EXPECT_EQ(plain.grads, recompute.grads);
  EXPECT_EQ(recompute.shared_scratch(),
            (std::vector<std::string>{"atty", "fc1", "ln1", "ln1_mean", "ln1_rstd", "ln2", "ln2_mean", "ln2_rstd",
                                      "qkv", "softmax_stats", "xmid"}))
      << "full recompute keeps only each layer's input";
}

// Selective recompute re-runs a module's own operations on the same inputs, in backward, so the
// loss and every gradient are the plain run's bit for bit. The dropped activations are one set the
// layers share and overwrite, so after forward it holds the last layer's: a backward that read
// them without re-running the module would get layer 0's gradients wrong. The shared set is
// exactly what each module drops (model.h, RecomputeModule), nothing more.
TEST(GptGradient, SelectiveRecomputeGivesTheSameLossAndGradientsBitwise) {
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 4);
  ReferenceGpt plain(c, random_params(c, 6));
  plain.dgrad_params = random_params(c, 8);  // as in the test above
  const double plain_loss = plain.loss_and_grad(tokens);
  EXPECT_TRUE(plain.shared_scratch().empty());
  using enum RecomputeModule;
  const std::vector<std::pair<RecomputeModules, std::vector<std::string>>> cases = {
      {{kCoreAttn}, {"softmax_stats"}},
      {{kMlp}, {"fc1"}},
      {{kCoreAttn, kMlp}, {"fc1", "softmax_stats"}},
      {{kLayernorm}, {"ln1", "ln1_mean", "ln1_rstd", "ln2", "ln2_mean", "ln2_rstd"}},
      {{kCoreAttn, kMlp, kLayernorm},
       {"fc1", "ln1", "ln1_mean", "ln1_rstd", "ln2", "ln2_mean", "ln2_rstd", "softmax_stats"}},
  };
  for (const auto& [modules, dropped] : cases) {
    SCOPED_TRACE("selective recompute of " + recompute_modules_names(modules));
    ReferenceGpt selective(c, random_params(c, 6));
    selective.dgrad_params = plain.dgrad_params;
    EXPECT_EQ(selective.loss_and_grad(tokens, RecomputeGranularity::kSelective, modules), plain_loss);
    EXPECT_EQ(selective.grads, plain.grads);
    EXPECT_EQ(selective.shared_scratch(), dropped);
    EXPECT_EQ(selective.ready_order, plain.ready_order);
  }
}

// Each gradient is reported the moment it is final: the final norm's first, then each layer's
// from the top down in the order backward produces them, and the embeddings last (the tied token
// embedding gets its LM-head part first and its lookup part at the very end). Since the buffer
// lays params out in reverse registration order, bucket 0 fills first and goes out first.
TEST(GptGradient, GradientsAreReportedInBackwardOrder) {
  const GptConfig c = grad_check_config();
  ReferenceGpt ref(c, random_params(c, 2));
  ref.loss_and_grad(random_tokens(c, 2));
  const GptParamIds ids(c);
  std::vector<int> expected = {ids.final_norm_weight(), ids.final_norm_bias()};
  for (int l = c.num_layers - 1; l >= 0; --l)
    for (LayerParam p : {kFc2W, kFc2B, kFc1W, kFc1B, kLn2W, kLn2B, kProjW, kProjB, kQkvW, kQkvB, kLn1W, kLn1B})
      expected.push_back(ids.layer(l, p));
  expected.push_back(ids.wpe());
  expected.push_back(ids.wte());
  EXPECT_EQ(ref.ready_order, expected);
}

TEST(GptGradient, BackwardWithoutForwardIsAnError) {
  ReferenceGpt ref(grad_check_config(), random_params(grad_check_config(), 1));
  model::GptGraph<double> g(ref.config, ref.access());
  EXPECT_THROW(g.backward(), Error);
}

// The f32 model over DDP (bf16 params) against the f64 reference on the same bf16-rounded values.
TEST(GptModelOverDdp, GradientsInMainGradMatchTheDoubleReference) {
  set_compute_threads(1);
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 9);
  auto init = random_params(c, 13);
  for (auto& p : init)
    for (double& x : p) x = bf16_to_f32(f32_to_bf16(static_cast<float>(x)));  // what the bf16 buffer holds
  ReferenceGpt ref(c, init);
  const double ref_loss = ref.loss_and_grad(tokens);

  run_local(1, [&](Communicator& comm) {
    const auto specs = gpt_param_specs(c);
    const F32Params init_f32(init, specs);
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    // Small buckets with overlap: every group must go out during backward, so every param must
    // have been reported with grad_ready by the time forward_backward returns.
    DdpConfig cfg{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 200};
    DistributedDataParallel ddp(comm, specs, cfg, tracker, init_f32.views);
    ASSERT_GT(ddp.num_bucket_groups(), 3);
    GptModel model(ddp, pool, c);
    ddp.zero_grad_buffer();
    const double loss = model.forward_backward(tokens.data(), kBatch, 1.0f);
    for (int g = 0; g < ddp.num_bucket_groups(); ++g) EXPECT_TRUE(ddp.bucket_group_issued(g)) << "group " << g;
    ddp.finish_grad_sync();
    const double n = kBatch * c.seq_length;
    EXPECT_NEAR(loss, ref_loss / n, 1e-5 * ref_loss / n);
    const GradMismatches m = main_grad_mismatches(ddp, ref, ref, n);
    EXPECT_EQ(m.count, 0) << m.first;
  });
}

// With fp8_param_gather the forward products must read the row-wise MXFP8 weights and the
// data-gradient products the column-wise ones. E4M3 elements are floating point, so the two
// orientations of one weight differ only in blocks with a wide range; to make the check sharp the
// test overwrites each column-wise copy with another matrix's. The f32 model must then match an
// f64 reference that reads exactly those, and fail against one that reads the row-wise weights
// everywhere.
TEST(GptModelOverDdp, Mxfp8WeightsAreRowWiseInForwardAndColumnWiseInDataGradients) {
  set_compute_threads(1);
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 21);
  const auto init = random_params(c, 23), other = random_params(c, 29);
  const auto specs = gpt_param_specs(c, /*mxfp8_linear_weights=*/true);
  run_local(1, [&](Communicator& comm) {
    const F32Params init_f32(init, specs);
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    DistributedDataParallel ddp(comm, specs, {.use_distributed_optimizer = true, .fp8_param_gather = true}, tracker,
                                init_f32.views);
    auto dequantized = [](const Mxfp8View& q, const Shape& shape) {
      std::vector<float> v(static_cast<size_t>(shape.numel()));
      mx_dequantize(q.data, q.scales, {v.data(), DType::kF32, shape}, q.options);
      return std::vector<double>(v.begin(), v.end());
    };
    std::vector<std::vector<double>> row(specs.size()), col(specs.size());
    int mxfp8_params = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!specs[i].mxfp8) {
        const TensorView p = ddp.param(static_cast<int>(i));
        std::vector<float> v(static_cast<size_t>(p.numel()));
        convert_bf16_to_f32(p.data_as<const bf16_bits>(), v.data(), v.size());
        row[i] = col[i] = std::vector<double>(v.begin(), v.end());
        continue;
      }
      ++mxfp8_params;
      const Mxfp8View q_row = ddp.mxfp8_param(static_cast<int>(i), QuantAxis::kRow);
      const Mxfp8View q_col = ddp.mxfp8_param(static_cast<int>(i), QuantAxis::kCol);
      std::vector<float> replacement(other[i].begin(), other[i].end());
      mx_quantize({replacement.data(), DType::kF32, specs[i].shape}, q_col.data, q_col.scales, q_col.options);
      row[i] = dequantized(q_row, specs[i].shape);
      col[i] = dequantized(q_col, specs[i].shape);
    }
    EXPECT_EQ(mxfp8_params, 4 * c.num_layers);
    ReferenceGpt ref(c, row), row_everywhere(c, row);
    ref.dgrad_params = col;
    const double ref_loss = ref.loss_and_grad(tokens);
    row_everywhere.loss_and_grad(tokens);

    GptModel model(ddp, pool, c);
    ddp.zero_grad_buffer();
    const double loss = model.forward_backward(tokens.data(), kBatch, 1.0f);
    ddp.finish_grad_sync();
    const double n = kBatch * c.seq_length;
    EXPECT_NEAR(loss, ref_loss / n, 1e-5 * ref_loss / n);
    const GradMismatches m = main_grad_mismatches(ddp, ref, ref, n);
    EXPECT_EQ(m.count, 0) << m.first;
    // Elements that would fail the same check with row-wise weights in the data gradients.
    EXPECT_GT(main_grad_mismatches(ddp, row_everywhere, ref, n).count, 100)
        << "the check must tell the orientations apart";
  });
}

// The f32 model over DDP: every recompute mode accumulates the plain run's main_grad bit for bit,
// with bf16 params and with MXFP8 ones (whose forward and data-gradient weights differ).
TEST(GptModelOverDdp, RecomputeGivesBitwiseTheSameMainGrad) {
  set_compute_threads(1);
  const GptConfig c = grad_check_config();
  const auto tokens = random_tokens(c, 31);
  const auto init = random_params(c, 37);
  using enum RecomputeModule;
  const std::vector<GptModelOptions> modes = {
      {.recompute_granularity = RecomputeGranularity::kFull},
      {.recompute_granularity = RecomputeGranularity::kSelective, .recompute_modules = {kCoreAttn}},
      {.recompute_granularity = RecomputeGranularity::kSelective, .recompute_modules = {kMlp}},
      {.recompute_granularity = RecomputeGranularity::kSelective, .recompute_modules = {kCoreAttn, kMlp}},
      {.recompute_granularity = RecomputeGranularity::kSelective, .recompute_modules = {kCoreAttn, kMlp, kLayernorm}},
  };
  for (const bool mxfp8 : {false, true}) {
    const auto specs = gpt_param_specs(c, mxfp8);
    const F32Params init_f32(init, specs);
    // main_grad of every param after one forward_backward, and the loss.
    auto run = [&](const GptModelOptions& options) {
      std::pair<double, std::vector<std::vector<float>>> out;
      run_local(1, [&](Communicator& comm) {
        MemoryTracker tracker;
        GlobalMemoryBuffer pool(tracker);
        DistributedDataParallel ddp(comm, specs, {.use_distributed_optimizer = true, .fp8_param_gather = mxfp8},
                                    tracker, init_f32.views);
        GptModel model(ddp, pool, c, options);
        ddp.zero_grad_buffer();
        out.first = model.forward_backward(tokens.data(), kBatch, 1.0f);
        ddp.finish_grad_sync();
        for (int p = 0; p < ddp.num_params(); ++p) {
          const TensorView g = ddp.main_grad(p);
          out.second.emplace_back(g.data_as<const float>(), g.data_as<const float>() + g.numel());
        }
      });
      return out;
    };
    const auto plain = run({});
    for (const GptModelOptions& options : modes) {
      SCOPED_TRACE(fmt::format("{} params, {} recompute of '{}'", mxfp8 ? "mxfp8" : "bf16",
                               recompute_granularity_name(options.recompute_granularity),
                               recompute_modules_names(options.recompute_modules)));
      const auto recomputed = run(options);
      EXPECT_EQ(recomputed.first, plain.first);
      EXPECT_EQ(recomputed.second, plain.second);
    }
  }
}

// GptModelOptions names the flag, the value and what would be valid.
TEST(GptModelOptions, RefusesContradictoryRecomputeSettings) {
  // The error's message, or "(accepted)".
  auto message = [](auto&& check) {
    try {
      check();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto validated = [&](const GptModelOptions& o) { return message([&] { o.validate(); }); };
  auto expect_has = [](const std::string& text, const std::string& needle) {
    EXPECT_NE(text.find(needle), std::string::npos) << "'" << needle << "' not in: " << text;
  };
  using enum RecomputeModule;
  expect_has(validated({.recompute_modules = {kMlp}}),
             "--recompute-modules mlp is only for --recompute-granularity selective, and the granularity is none");
  expect_has(validated({.recompute_granularity = RecomputeGranularity::kFull, .recompute_modules = {kCoreAttn, kMlp}}),
             "--recompute-modules core_attn mlp is only for --recompute-granularity selective, and the granularity is "
             "full");
  expect_has(validated({.recompute_granularity = RecomputeGranularity::kSelective}),
             "selective needs at least one of --recompute-modules core_attn, mlp, layernorm");
  EXPECT_EQ(validated({.recompute_granularity = RecomputeGranularity::kSelective, .recompute_modules = {kLayernorm}}),
            "(accepted)");
  EXPECT_EQ(validated({.recompute_granularity = RecomputeGranularity::kFull}), "(accepted)");
  EXPECT_EQ(parse_recompute_granularity("selective"), RecomputeGranularity::kSelective);
  EXPECT_EQ(parse_recompute_module("core_attn"), kCoreAttn);
  expect_has(message([] { parse_recompute_granularity("none"); }),  // not a value of Megatron's flag
             "--recompute-granularity 'none' is not valid: full or selective");
  expect_has(message([] { parse_recompute_module("attention"); }),
             "--recompute-modules 'attention' is not valid: core_attn, mlp or layernorm");
  // The model refuses them too, not only the command line.
  run_local(1, [&](Communicator& comm) {
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    const GptConfig c = grad_check_config();
    DistributedDataParallel ddp(comm, gpt_param_specs(c), {.use_distributed_optimizer = true}, tracker);
    expect_has(message([&] { GptModel(ddp, pool, c, {.recompute_granularity = RecomputeGranularity::kSelective}); }),
               "selective needs at least one of --recompute-modules");
  });
}

TEST(GptModelOverDdp, RejectsAParamListThatIsNotTheGpts) {
  run_local(1, [](Communicator& comm) {
    MemoryTracker tracker;
    GlobalMemoryBuffer pool(tracker);
    const GptConfig c = grad_check_config();
    GptConfig other = c;
    other.hidden_size = 16;
    DistributedDataParallel ddp(comm, gpt_param_specs(other), {.use_distributed_optimizer = true}, tracker);
    try {
      GptModel model(ddp, pool, c);
      FAIL() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("embedding.word_embeddings.weight"), std::string::npos) << e.what();
    }
    DistributedDataParallel bf16_grads(comm, gpt_param_specs(c), {.grad_reduce_in_fp32 = false, .use_distributed_optimizer = true},
                                       tracker);
    EXPECT_THROW(GptModel(bf16_grads, pool, c), Error);
  });
}

TEST(GptConfig, PresetsAndBadValues) {
  EXPECT_EQ(gpt_preset("tiny").num_layers, 2);
  const GptConfig small = gpt_preset("small");
  EXPECT_GT(small.num_params(), 10'000'000);
  EXPECT_LT(small.num_params(), 11'000'000);
  const GptConfig gpt2 = gpt_preset("gpt2-124m");
  EXPECT_EQ(gpt2.num_layers, 12);
  EXPECT_EQ(gpt2.hidden_size, 768);
  // The param list's sizes add up to num_params.
  int64_t total = 0;
  for (const ParamSpec& s : gpt_param_specs(gpt2)) total += s.shape.numel();
  EXPECT_EQ(total, gpt2.num_params());
  EXPECT_THROW(gpt_preset("gpt5"), Error);
  GptConfig bad = gpt_preset("tiny");
  bad.num_attention_heads = 3;
  EXPECT_THROW(bad.validate(), Error);
  bad = gpt_preset("tiny");
  bad.vocab_size = 0;
  EXPECT_THROW(bad.validate(), Error);
  // Any vocabulary is a model (an imported HF GPT-2's 50257); the data's ids are checked where read.
  GptConfig gpt2_vocab = gpt_preset("tiny");
  gpt2_vocab.vocab_size = 50257;
  EXPECT_NO_THROW(gpt2_vocab.validate());
  bad.vocab_size = 50304;  // any vocabulary (a padded GPT-2 one)
  EXPECT_NO_THROW(bad.validate());
}

TEST(GptConfig, InitializationIsDeterministicAndGpt2Like) {
  const GptConfig c = gpt_preset("tiny");
  const auto a = gpt_init_params(c, 1), b = gpt_init_params(c, 1), other = gpt_init_params(c, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  const GptParamIds ids(c);
  double sum_sq = 0;
  for (float x : a[static_cast<size_t>(ids.layer(0, kQkvW))]) sum_sq += double{x} * x;
  const double std_qkv = std::sqrt(sum_sq / static_cast<double>(a[static_cast<size_t>(ids.layer(0, kQkvW))].size()));
  EXPECT_NEAR(std_qkv, 0.02, 0.002);
  for (float x : a[static_cast<size_t>(ids.layer(1, kLn2W))]) EXPECT_EQ(x, 1.0f);
  for (float x : a[static_cast<size_t>(ids.layer(1, kFc1B))]) EXPECT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace mxddp::testing
