// The training loop on the in-process backend: the same global batch gives the same losses at
// dp 1, 2 and 4; overlap and recomputation change nothing but timing and memory; the loss falls
// well below the data's unigram entropy; a run saved at iteration k and resumed (at the same dp
// or another) reproduces the uninterrupted run; no scratch allocation after the first iteration.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include <mxddp/plan.h>

#include "checkpoint/file_io.h"
#include "forwarding_data_parallel.h"
#include "model/train_util.h"
#include "plan/memory_floor.h"

namespace mxddp::testing {
namespace {

TEST(TrainLocal, SameGlobalBatchGivesTheSameLossesAtDp124) {
  const TrainConfig c = small_train_config();  // accumulation 4, 2 and 1 micro-batches
  const TrainResult dp1 = train_local(1, c);
  ASSERT_EQ(dp1.steps.size(), 4u);
  for (int dp : {2, 4}) {
    const auto all = train_local_all(dp, c);
    for (const TrainResult& r : all) EXPECT_EQ(losses(r), losses(all.front())) << "every rank reports the same loss";
    expect_close(losses(all.front()), losses(dp1), 1e-5, dp == 2 ? "dp 2 vs dp 1" : "dp 4 vs dp 1");
    ASSERT_EQ(all.front().evals.size(), 1u);
    EXPECT_NEAR(all.front().evals[0].loss, dp1.evals[0].loss, 1e-5 * dp1.evals[0].loss);
  }
  EXPECT_LT(dp1.steps.back().loss, dp1.steps.front().loss);
}

TEST(TrainLocal, OverlapChangesNothingButTiming) {
  TrainConfig c = small_train_config();
  const auto base = losses(train_local(2, c));
  c.ddp.overlap_grad_reduce = true;
  c.ddp.bucket_size = 3000;  // several bucket groups
  c.ddp.overlap_param_gather = true;
  EXPECT_EQ(losses(train_local(2, c)), base) << "overlapped grad reduce and param gather";
  c.ddp.overlap_param_gather_with_optimizer_step = true;
  EXPECT_EQ(losses(train_local(2, c)), base) << "param gather overlapped with the optimizer step";
  c.ddp.buckets_per_group = 2;
  c.ddp.average_in_collective = true;
  c.ddp.check_for_nan_in_grad = true;
  expect_close(losses(train_local(2, c)), base, 1e-6, "grouped buckets, averaged in the collective");
  // Other layouts and collectives: the same math up to the grad norm's summation order.
  TrainConfig other = small_train_config();
  other.ddp.pad_buckets_for_high_nccl_busbw = true;
  expect_close(losses(train_local(2, other)), base, 1e-6, "buckets padded for NCCL bus bandwidth");
  other.ddp.force_all_reduce = true;
  expect_close(losses(train_local(2, other)), base, 1e-6, "all-reduce instead of reduce-scatter");
}

// Recompute (full, and selective for each module set) gives the plain run's losses bit for bit at
// dp 2, and saves exactly the scratch the shapes imply: a dropped activation lives in one set the
// layers share instead of one per layer, so each saves (L - 1) x its bytes. The pool's scratch
// never shrinks, so its steady-state peak is the sum of every key's size, and everything else
// (residual streams, weights, gradients, the head) is the same in every mode.
TEST(TrainLocal, RecomputeGivesTheSameLossesAndSavesTheScratchTheShapesImply) {
  TrainConfig c = small_train_config();
  c.model.num_layers = 4;
  const TrainResult plain = train_local(2, c);
  auto scratch_peak = [](const TrainResult& r) { return r.memory_by_rank[0].steady.peak(MemoryCategory::kScratch); };

  // Elements of each activation a layer keeps for backward (gpt_graph.h), from the shapes.
  const int64_t b = c.micro_batch_size, t = c.model.seq_length, n = b * t, h = c.model.hidden_size;
  const int64_t heads = c.model.num_attention_heads, layers = c.model.num_layers;
  const int64_t stats = b * heads * 2 * t;           // core_attn: the softmax statistics [B, H, 2, T]
  const int64_t mlp = n * 4 * h;                     // mlp: fc1's output [N, 4C]
  const int64_t norms = 2 * (n * h + 2 * n);         // layernorm: two outputs [N, C] and their mean, rstd [N]
  const int64_t linear_outputs = n * 3 * h + 2 * n * h;  // qkv [N, 3C], atty and xmid [N, C]: full only
  auto saving_bytes = [&](int64_t dropped_numel) {
    return (layers - 1) * dropped_numel * static_cast<int64_t>(sizeof(float));
  };

  c.recompute_granularity = RecomputeGranularity::kFull;
  const TrainResult full = train_local(2, c);
  EXPECT_EQ(losses(full), losses(plain));
  EXPECT_EQ(scratch_peak(plain) - scratch_peak(full), saving_bytes(stats + mlp + norms + linear_outputs));

  using enum RecomputeModule;
  const std::vector<std::pair<RecomputeModules, int64_t>> cases = {
      {{kCoreAttn}, stats}, {{kMlp}, mlp}, {{kCoreAttn, kMlp}, stats + mlp}, {{kLayernorm}, norms},
      {{kCoreAttn, kMlp, kLayernorm}, stats + mlp + norms}};
  c.recompute_granularity = RecomputeGranularity::kSelective;
  for (const auto& [modules, dropped_numel] : cases) {
    SCOPED_TRACE("selective recompute of " + recompute_modules_names(modules));
    c.recompute_modules = modules;
    const TrainResult selective = train_local(2, c);
    EXPECT_EQ(losses(selective), losses(plain));
    EXPECT_EQ(scratch_peak(plain) - scratch_peak(selective), saving_bytes(dropped_numel));
    EXPECT_GT(scratch_peak(plain), scratch_peak(selective));
    EXPECT_GT(scratch_peak(selective), scratch_peak(full));
    EXPECT_EQ(selective.memory_by_rank[0].scratch_allocations_after_warmup, 0);
  }
}

// A training mode the whole-run checks below sweep: DDP (with MXFP8 params staged in the grad
// buffer or not) or FSDP with a strategy.
struct TrainMode {
  const char* name;
  bool mxfp8, fsdp;
  ShardingStrategy strategy = ShardingStrategy::kOptimGradsParams;
  void apply(TrainConfig& c) const {
    c.ddp.fp8_param_gather = c.ddp.reuse_grad_buf_for_mxfp8_param_ag = mxfp8;
    c.use_megatron_fsdp = fsdp;
    c.fsdp.data_parallel_sharding_strategy = strategy;
  }
};

// A recompute reads weights in backward, after the layer's pre-backward hook: with MXFP8 params
// gathered through the grad buffer (which holds gradients by then; the model-side copies are what
// is read) and under FSDP optim_grads_params (the layer is gathered again by that hook; a
// recompute before it fails), every mode trains exactly as without recompute.
TEST(TrainLocal, RecomputeChangesNothingWithMxfp8ParamsOrUnderFsdp) {
  for (const TrainMode& mode : {TrainMode{"ddp mxfp8 reuse", true, false}, TrainMode{"fsdp optim_grads_params", false, true}}) {
    SCOPED_TRACE(mode.name);
    TrainConfig c = small_train_config();
    mode.apply(c);
    c.ddp.overlap_grad_reduce = c.ddp.overlap_param_gather = true;
    c.fsdp.overlap_grad_reduce = c.fsdp.overlap_param_gather = true;
    const std::vector<double> plain = losses(train_local(2, c));
    c.recompute_granularity = RecomputeGranularity::kFull;
    EXPECT_EQ(losses(train_local(2, c)), plain) << "full";
    c.recompute_granularity = RecomputeGranularity::kSelective;
    c.recompute_modules = {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm};
    EXPECT_EQ(losses(train_local(2, c)), plain) << "selective core_attn mlp layernorm";
  }
}

TEST(TrainLocal, SteadyStateAllocatesNothingAndEveryRankReportsItsMemory) {
  TrainConfig c = small_train_config();
  c.train_iters = 5;
  c.eval_interval = 2;  // evaluations in the steady state use the same scratch
  const TrainResult r = train_local(4, c);
  ASSERT_EQ(r.memory_by_rank.size(), 4u);
  EXPECT_EQ(r.evals.size(), 3u);
  for (const RankMemory& m : r.memory_by_rank) {
    EXPECT_EQ(m.scratch_allocations_after_warmup, 0);
    EXPECT_EQ(m.steady.peak(MemoryCategory::kScratch), m.steady.live(MemoryCategory::kScratch));
    EXPECT_GT(m.steady.live(MemoryCategory::kScratch), 0);
    // bf16 params, f32 grads, and this rank's quarter of the f32 main params and two Adam moments.
    const int64_t params = m.steady.live(MemoryCategory::kParams) / 2;
    EXPECT_GE(params, c.model.num_params());
    EXPECT_EQ(m.steady.live(MemoryCategory::kGrads), 4 * params);
    EXPECT_EQ(m.steady.live(MemoryCategory::kMainParams), params);
    EXPECT_EQ(m.steady.live(MemoryCategory::kOptimizerState), 2 * params);
    EXPECT_GE(m.overall.total_peak_bytes, m.steady.total_peak_bytes);
  }
}

TEST(TrainLocal, LossFallsWellBelowTheUnigramEntropy) {
  TrainConfig c;  // the default model and data, in a run half the default length
  c.train_iters = 150;
  c.eval_iters = 2;
  c.eval_interval = 0;
  const TrainResult r = train_local(2, c);
  ASSERT_EQ(r.steps.size(), 150u);
  EXPECT_NEAR(r.steps.front().loss, std::log(256.0), 0.05) << "an untrained model is uniform over bytes";
  EXPECT_NEAR(r.unigram_entropy, 2.92, 0.05);
  // Stated threshold: 60% of the unigram entropy, i.e. the model uses context.
  EXPECT_LT(r.steps.back().loss, 0.6 * r.unigram_entropy);
  EXPECT_LT(r.evals.back().loss, 0.6 * r.unigram_entropy);
  for (const StepRecord& s : r.steps) EXPECT_FALSE(s.skipped);
}

TEST(TrainLocal, ResumeReproducesTheUninterruptedRunAtTheSameAndAnotherDp) {
  TempDir dir("mxddp_resume");
  TrainConfig c = small_train_config();
  c.train_iters = 6;
  const TrainResult full2 = train_local(2, c);
  const TrainResult full4 = train_local(4, c);

  TrainConfig first = c;
  first.train_iters = 3;
  first.save_dir = dir / "ckpt";
  const std::vector<double> full2_losses = losses(full2), full4_losses = losses(full4);
  const TrainResult head = train_local(2, first);
  EXPECT_EQ(losses(head), std::vector<double>(full2_losses.begin(), full2_losses.begin() + 3));

  TrainConfig rest = c;
  rest.load_dir = dir / "ckpt";
  const TrainResult same_dp = train_local(2, rest);
  EXPECT_EQ(same_dp.start_iteration, 3);
  ASSERT_EQ(same_dp.steps.size(), 3u);
  EXPECT_EQ(same_dp.steps.front().iteration, 4);
  EXPECT_EQ(losses(same_dp), std::vector<double>(full2_losses.begin() + 3, full2_losses.end())) << "bitwise at the same dp";
  EXPECT_EQ(same_dp.evals.back().loss, full2.evals.back().loss);

  const TrainResult other_dp = train_local(4, rest);
  expect_close(losses(other_dp), std::vector<double>(full4_losses.begin() + 3, full4_losses.end()), 1e-5,
               "saved at dp 2, resumed at dp 4, vs uninterrupted at dp 4");
}

// Rewrites the newest checkpoint of history `dir` with metadata `key` set to value, or without it
// when value is null (a save from before that key existed), resealing the manifest's CRC-32 as
// documented.
void edit_checkpoint_metadata(const std::string& dir, const std::string& key, const char* value) {
  std::string iteration;
  std::ifstream(dir + "/latest_checkpointed_iteration.txt") >> iteration;
  const std::string path = fmt::format("{}/iter_{:07d}/manifest.json", dir, std::stoll(iteration));
  std::ifstream in(path);
  nlohmann::json m = nlohmann::json::parse(in);
  ASSERT_TRUE(m.at("metadata").contains(key)) << key << " not in " << path;
  if (value == nullptr) m.at("metadata").erase(key);
  else m.at("metadata")[key] = value;
  m.erase("manifest_crc32");
  const std::string canonical = m.dump();
  m["manifest_crc32"] = ckpt::crc32_of(std::vector<char>(canonical.begin(), canonical.end()));
  std::ofstream(path) << m.dump(1);
}

// Issue 30 point 4 ii: a checkpoint stores the consumed samples (Megatron's consumed_train_samples)
// and a resume reads on from them, whatever the batch size was. With lr 0 the params never change,
// so an iteration's loss depends only on which samples it reads: 2 iterations of 8 then one of 16
// must read samples 16..31, the uninterrupted run's iterations 3 and 4.
TEST(TrainLocal, ResumeWithAnotherBatchSizeReadsOnFromTheConsumedSamples) {
  TempDir dir("mxddp_consumed");
  TrainConfig c = small_train_config();
  c.lr = c.min_lr = 0.0f;
  c.eval_iters = 0;
  c.train_iters = 5;
  const TrainResult full = train_local(2, c);  // samples 8(i-1)..8i-1 at iteration i
  ASSERT_EQ(full.steps.size(), 5u);
  EXPECT_EQ(full.steps[2].consumed_samples, 24);

  TrainConfig head = c;
  head.train_iters = 2;
  head.save_dir = dir / "ckpt";
  EXPECT_EQ(train_local(2, head).steps.back().consumed_samples, 16);

  TrainConfig wide = c;  // one iteration of 16, saved
  wide.global_batch_size = 16;
  wide.train_iters = 3;
  wide.load_dir = wide.save_dir = dir / "ckpt";
  const TrainResult resumed = train_local(2, wide);
  EXPECT_EQ(resumed.start_consumed_samples, 16);
  ASSERT_EQ(resumed.steps.size(), 1u);
  EXPECT_EQ(resumed.steps[0].iteration, 3);
  EXPECT_EQ(resumed.steps[0].consumed_samples, 32) << "16 consumed before + 16, not 3 x 16";
  EXPECT_NEAR(resumed.steps[0].loss, (full.steps[2].loss + full.steps[3].loss) / 2, 1e-6 * full.steps[2].loss)
      << "iteration 3 at 16 reads the samples of iterations 3 and 4 at 8";

  TrainConfig narrow = c;  // back to 8: samples 32..39, the uninterrupted run's iteration 5
  narrow.load_dir = dir / "ckpt";
  const TrainResult back = train_local(2, narrow);
  EXPECT_EQ(back.start_consumed_samples, 32) << "the checkpoint saved after the batch-size change";
  ASSERT_EQ(back.steps.size(), 2u);
  EXPECT_EQ(back.steps[0].consumed_samples, 40);
  EXPECT_EQ(back.steps[0].loss, full.steps[4].loss) << "the same samples in the same micro-batches";

  // A checkpoint from before consumed samples were saved: derived as iteration x this run's batch
  // size, as every count was then (after iteration 3 at 16: 48; iteration 4 reads 48..63).
  // A count that is not a count, fewer samples than iterations, or one the run would overflow: an
  // error naming it.
  for (const auto& [value, needle] : {std::pair<const char*, std::string>{"abc", "has consumed_train_samples 'abc'"},
                                      {"2", "consumed_train_samples 2 at iteration 3: every iteration consumes"},
                                      {"9223372036854775800", "its consumed_train_samples 9223372036854775800 plus"}}) {
    edit_checkpoint_metadata(dir / "ckpt", "consumed_train_samples", value);
    TrainConfig bad = wide;
    bad.train_iters = 4;
    bad.save_dir.clear();
    const std::vector<std::string> errors = train_local_errors(2, bad);
    EXPECT_NE(errors[0].find(needle), std::string::npos) << errors[0];
  }
  edit_checkpoint_metadata(dir / "ckpt", "consumed_train_samples", nullptr);
  TrainConfig old = wide;
  old.train_iters = 4;
  old.save_dir.clear();
  const TrainResult from_old = train_local(2, old);
  EXPECT_EQ(from_old.start_iteration, 3);
  EXPECT_EQ(from_old.start_consumed_samples, 48);
  ASSERT_EQ(from_old.steps.size(), 1u);
  EXPECT_EQ(from_old.steps[0].consumed_samples, 64);
}

TEST(TrainLocal, ResumingAnotherModelFailsAndNamesTheMismatch) {
  TempDir dir("mxddp_resume_bad");
  TrainConfig c = small_train_config();
  c.train_iters = 1;
  c.save_dir = dir / "ckpt";
  train_local(1, c);
  TrainConfig other = small_train_config();
  other.model.hidden_size = 64;
  other.load_dir = dir / "ckpt";
  EXPECT_THROW(train_local(1, other), Error);
  TrainConfig missing = small_train_config();
  missing.load_dir = dir / "nothing-here";
  EXPECT_THROW(train_local(1, missing), Error);
}

TEST(TrainLocal, RefusesToSaveOverSomethingThatIsNotACheckpoint) {
  TempDir dir("mxddp_save_guard");
  std::filesystem::create_directories(dir / "precious");
  std::ofstream(dir / "precious/notes.txt") << "keep me";
  TrainConfig c = small_train_config();
  c.train_iters = 1;
  c.save_dir = dir / "precious";
  try {
    train_local(1, c);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 'notes.txt', which is not part of an mxddp checkpoint history"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "precious/notes.txt"));
  // An existing history is saved into.
  c.save_dir = dir / "ckpt";
  train_local(1, c);
  c.train_iters = 2;
  EXPECT_EQ(train_local(1, c).steps.size(), 2u);
}

TEST(TrainLocal, BadConfigsAreClearErrors) {
  TrainConfig c = small_train_config();
  c.global_batch_size = 6;  // not a multiple of micro 2 x dp 4
  try {
    train_local(4, c);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--global-batch-size 6"), std::string::npos) << e.what();
  }
  c = small_train_config();
  c.lr_decay_style = static_cast<LrDecayStyle>(7);
  EXPECT_THROW(c.validate(1), Error);
  try {
    parse_lr_decay_style("step");
    ADD_FAILURE() << "--lr-decay-style step accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--lr-decay-style 'step' is not valid: cosine, linear or constant"),
              std::string::npos) << e.what();
  }
  c = small_train_config();
  c.min_lr = 2 * c.lr;
  EXPECT_THROW(c.validate(1), Error);
  c = small_train_config();
  c.save_interval = 2;
  EXPECT_THROW(c.validate(1), Error) << "a save interval without a directory";
}

// A learning rate of 1e30 makes the first update throw the weights to ~1e30, so iteration 2's
// forward overflows: with the check (the default) the run stops there on every rank, naming the
// iteration and the params; without it every later iteration is skipped and counted, and nothing
// stops the run.
TEST(TrainLocal, NanLossOrGradStopsTheRunUnlessTheCheckIsOff) {
  for (bool fsdp : {false, true}) {
    TrainConfig c = small_train_config();
    c.use_megatron_fsdp = fsdp;
    c.lr = c.min_lr = 1e30f;
    c.eval_iters = 0;
    const std::vector<std::string> errors = train_local_errors(2, c);
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("iteration 2: NaN or Inf found"), std::string::npos) << (fsdp ? "fsdp: " : "ddp: ") << e;
      EXPECT_NE(e.find("params whose gradients hold it: embedding.word_embeddings.weight"), std::string::npos) << e;
      EXPECT_NE(e.find("--no-check-for-nan-in-loss-and-grad"), std::string::npos) << e;
    }
    c.check_for_nan_in_loss_and_grad = false;
    const TrainResult r = train_local(2, c);
    ASSERT_EQ(r.steps.size(), static_cast<size_t>(c.train_iters));
    EXPECT_FALSE(r.steps[0].skipped);
    for (size_t i = 1; i < r.steps.size(); ++i) EXPECT_TRUE(r.steps[i].skipped) << "iteration " << i + 1;
  }
}

// A replica that drifted on one rank, as a bit flip or a faulty gather would leave it: rank 1 flips
// one byte of a param (its MXFP8 row-wise payload where it is one) as the check reads it after the
// given force_param_sync, i.e. after the param sync the check waits for.
class DriftingReplica final : public ForwardingDataParallel {
 public:
  DriftingReplica(std::unique_ptr<DataParallel> inner, int param, int drift_at_sync)
      : ForwardingDataParallel(std::move(inner)), param_(param), drift_at_sync_(drift_at_sync) {}
  void force_param_sync(const std::function<void()>& stage) override {
    ForwardingDataParallel::force_param_sync(stage);
    armed_ = ++syncs_ == drift_at_sync_ && communicator().rank() == 1;
  }
  void before_forward(const std::vector<int>& m) override {
    ForwardingDataParallel::before_forward(m);
    if (!armed_ || std::find(m.begin(), m.end(), param_) == m.end()) return;
    const TensorView bytes = is_mxfp8(param_) ? mxfp8_param(param_, QuantAxis::kRow).data : param(param_);
    static_cast<uint8_t*>(bytes.data)[7] ^= 0x10;
    armed_ = false;
  }

 private:
  const int param_, drift_at_sync_;
  int syncs_ = 0;
  bool armed_ = false;
};

// Megatron's --check-weight-hash-across-dp-replicas-interval, under DDP, DDP with MXFP8 params
// staged in the grad buffer and FSDP with sharded and replicated params: a clean run passes every
// check and trains exactly as without it; one drifted byte on one rank stops the run on every rank,
// naming the iteration, the param and the rank.
TEST(TrainLocal, WeightHashCheckFindsADriftedReplicaAndNothingElse) {
  for (const TrainMode& mode : {TrainMode{"ddp", false, false}, TrainMode{"ddp mxfp8 reuse", true, false},
                                TrainMode{"fsdp optim_grads_params", false, true},
                                TrainMode{"fsdp no_shard", false, true, ShardingStrategy::kNoShard}}) {
    SCOPED_TRACE(mode.name);
    TrainConfig c = small_train_config();
    c.eval_iters = 0;  // the only param syncs forced are the checks' (and the one at the end)
    mode.apply(c);
    const TrainResult unchecked = train_local(2, c);
    c.check_weight_hash_across_dp_replicas_interval = 1;
    const TrainResult checked = train_local(2, c);
    ASSERT_EQ(checked.steps.size(), unchecked.steps.size());
    for (size_t i = 0; i < checked.steps.size(); ++i) EXPECT_EQ(checked.steps[i].loss, unchecked.steps[i].loss) << i;

    const int qkv = GptParamIds(c.model).layer(1, kQkvW);
    c.check_weight_hash_across_dp_replicas_interval = 2;
    TrainCallbacks drift;
    drift.wrap_data_parallel = [&](std::unique_ptr<DataParallel> inner) -> std::unique_ptr<DataParallel> {
      return std::make_unique<DriftingReplica>(std::move(inner), qkv, /*drift_at_sync=*/2);
    };
    const std::vector<std::string> errors = train_local_errors(2, c, drift);
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("iteration 4: the model params differ across data-parallel replicas"), std::string::npos) << e;
      EXPECT_NE(e.find("'decoder.layers.1.self_attention.linear_qkv.weight' (ranks 1 differ from rank 0)"),
                std::string::npos) << e;
      EXPECT_EQ(e.find("layers.0"), std::string::npos) << "only the drifted param is named: " << e;
    }
  }
}

// A run that cannot fit is refused before anything is allocated, with the figures: a billion
// layers used to grow until the kernel killed the process, a hidden size of a million died after
// seconds with std::bad_alloc.
TEST(TrainMemoryFloor, ARunThatCannotFitIsRefusedBeforeAllocating) {
  ASSERT_GT(available_memory_bytes(), 0) << "/proc/meminfo has MemAvailable on Linux";
  for (const GptConfig model : {GptConfig{.num_layers = 2147483647}, GptConfig{.hidden_size = 1000000}}) {
    TrainConfig c = small_train_config();
    c.model = model;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::string> errors = train_local_errors(2, c);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2)) << "refused before allocating";
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("this run cannot fit in this machine's memory: 2 ranks here need at least"), std::string::npos) << e;
      EXPECT_NE(e.find(fmt::format("--num-layers {}, --hidden-size {}", model.num_layers, model.hidden_size)),
                std::string::npos) << e;
      EXPECT_NE(e.find("GiB is available"), std::string::npos) << e;
      EXPECT_NE(e.find("iB each: initial values"), std::string::npos) << e;
    }
  }
}

// A run whose floor fits but whose exact plan does not (here a layer's activations, 11 of
// [N, C] with fc1 [N, 4C] counted as 4, where the floor counts only its input) is refused with the
// plan's figures.
TEST(TrainMemoryFloor, ARunTheFloorLetsThroughIsRefusedByThePlan) {
  const double available = available_memory_bytes();
  ASSERT_GT(available, 0);
  TrainConfig c = small_train_config();
  c.model = GptConfig{.num_layers = 2, .hidden_size = 1024, .num_attention_heads = 16, .seq_length = 8192};
  c.micro_batch_size = 16;  // N = 131072 rows: [N, C] is 512 MiB
  c.global_batch_size = 32;
  c.corpus_bytes = 1 << 20;
  const MemoryPlan plan = plan_train_memory(c, {.dp = 2});
  ASSERT_GT(2.0 * static_cast<double>(plan.overall.total_peak_bytes), available) << "the activations: 2 x 17.7 GiB";
  ASSERT_LT(2.0 * train_memory_floor(c, 2, 1 << 20).rank_bytes(), available) << "while the floor fits";
  const std::vector<std::string> errors = train_local_errors(2, c);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("this run does not fit in this machine's memory: 2 ranks here need"), std::string::npos) << e;
    EXPECT_NE(e.find(fmt::format("a peak of {} by the plan", format_bytes(static_cast<double>(plan.overall.total_peak_bytes)))),
              std::string::npos) << e;
    EXPECT_NE(e.find("`mxddp plan` with the same flags"), std::string::npos) << e;
  }
}

// The floor never refuses a run that fits: in every mode it is at most what a run measures.
TEST(TrainMemoryFloor, IsAtMostWhatTheRunUses) {
  for (const TrainMode& mode : {TrainMode{"ddp", false, false}, TrainMode{"ddp mxfp8 reuse", true, false},
                                TrainMode{"fsdp no_shard", false, true, ShardingStrategy::kNoShard},
                                TrainMode{"fsdp optim", false, true, ShardingStrategy::kOptim},
                                TrainMode{"fsdp optim_grads", false, true, ShardingStrategy::kOptimGrads},
                                TrainMode{"fsdp optim_grads_params", false, true}}) {
    SCOPED_TRACE(mode.name);
    TrainConfig c = small_train_config();
    mode.apply(c);
    const TrainMemoryFloor floor = train_memory_floor(c, 2, 0);
    const double tracked_floor = floor.params_bytes + floor.grads_bytes + floor.main_params_bytes +
                                 floor.optimizer_state_bytes + floor.activations_bytes;
    const TrainResult r = train_local(2, c);
    for (const RankMemory& m : r.memory_by_rank) EXPECT_LE(tracked_floor, static_cast<double>(m.overall.total_peak_bytes));
    // On this small model scratch (attention, the MLP's hidden) dominates; the floor counts
    // only each layer's input of it. A floor far below the run would let through runs that
    // cannot fit.
    const double measured = static_cast<double>(r.memory_by_rank[0].overall.total_peak_bytes);
    std::printf("%s: floor %.0f bytes, measured peak %.0f (%.2f)\n", mode.name, tracked_floor, measured,
                tracked_floor / measured);
    EXPECT_GT(tracked_floor, 0.25 * measured);
  }
}

TEST(LearningRate, WarmupThenCosineToMin) {
  TrainConfig c;
  c.lr = 1.0f;
  c.min_lr = 0.1f;
  c.lr_warmup_iters = 10;
  c.train_iters = 110;
  EXPECT_FLOAT_EQ(learning_rate(c, 0), 0.1f);
  EXPECT_FLOAT_EQ(learning_rate(c, 9), 1.0f);
  EXPECT_FLOAT_EQ(learning_rate(c, 10), 1.0f);
  EXPECT_NEAR(learning_rate(c, 60), 0.55f, 1e-6);
  EXPECT_FLOAT_EQ(learning_rate(c, 110), 0.1f);
  c.lr_decay_style = LrDecayStyle::kLinear;
  EXPECT_NEAR(learning_rate(c, 35), 0.775f, 1e-6);
  c.lr_decay_style = LrDecayStyle::kConstant;
  EXPECT_FLOAT_EQ(learning_rate(c, 100), 1.0f);
}

// The largest --lr the flag takes gives finite rates all along (the warmup's lr x (it + 1) used to
// overflow to inf, which the optimizer then refused mid-run, found by the hostile campaign).
TEST(LearningRate, LargestLrStaysFiniteThroughWarmupAndDecay) {
  TrainConfig c;
  c.lr = std::numeric_limits<float>::max();
  c.min_lr = 0;
  c.lr_warmup_iters = 4;
  c.train_iters = 12;
  for (LrDecayStyle style : {LrDecayStyle::kCosine, LrDecayStyle::kLinear, LrDecayStyle::kConstant}) {
    c.lr_decay_style = style;
    for (int64_t it = 0; it <= c.train_iters; ++it) {
      const float lr = learning_rate(c, it);
      EXPECT_TRUE(std::isfinite(lr)) << "iteration " << it;
      EXPECT_LE(lr, c.lr) << "iteration " << it;
    }
  }
  EXPECT_FLOAT_EQ(learning_rate(c, 1), c.lr / 2);
}

}  // namespace
}  // namespace mxddp::testing
