// MXFP8 params under FSDP (issue 12 part 3): losses equal DDP's MXFP8 params (reuse off) bit for
// bit for every recompute, fine-grained on and off, dp 1, 2, 4; the per-rank event log shows
// row-wise only in forward and recompute, column-wise only in backward, each gather released once
// and nothing gathered at finish_grad_sync; the configurations the trainer refuses; the peak
// gathered bytes of a selective mlp recompute, fine-grained on against off, from the param shapes;
// and the sharded scales (issue 30 point 2): each rank's shard of each orientation's scales is the
// slice of quantizing the whole tensor, a gather brings back the whole tensor's scales, and the
// MXFP8 bytes at rest fall by dp.
#include <algorithm>
#include <array>
#include <map>
#include <tuple>

#include <mxddp/fsdp.h>
#include <mxddp/fsdp_fine_grained.h>

#include "fsdp/fsdp_engine.h"

#include "core/error_of.h"
#include "fsdp/fsdp_util.h"

namespace mxddp::testing {
namespace {

TrainConfig mxfp8_fsdp_config(int dp) {
  TrainConfig c = fsdp_config(ShardingStrategy::kOptimGradsParams, true);
  c.ddp.fp8_param_gather = true;  // the DDP twin: MXFP8 params, reuse_grad_buf_for_mxfp8_param_ag off
  c.micro_batch_size = 2;
  c.global_batch_size = 2 * dp;  // one micro-batch: DDP and FSDP reduce each element the same way
  c.optimizer.clip_grad = 0;     // (the global norm's partial sums would follow the buckets)
  c.eval_iters = 1;
  return c;
}

const Recompute kRecomputes[] = {
    {"none", RecomputeGranularity::kNone, {}},
    {"full", RecomputeGranularity::kFull, {}},
    {"selective_core_attn", RecomputeGranularity::kSelective, {RecomputeModule::kCoreAttn}},
    {"selective_mlp", RecomputeGranularity::kSelective, {RecomputeModule::kMlp}},
    {"selective_all", RecomputeGranularity::kSelective,
     {RecomputeModule::kCoreAttn, RecomputeModule::kMlp, RecomputeModule::kLayernorm}},
};

class Mxfp8FsdpParity : public ::testing::TestWithParam<std::tuple<int, bool, int>> {};

TEST_P(Mxfp8FsdpParity, LossesEqualDdpMxfp8BitwiseOrTheConfigIsRefused) {
  const auto [recompute, fine_grained, dp] = GetParam();
  const Recompute& r = kRecomputes[recompute];
  TrainConfig c = mxfp8_fsdp_config(dp);
  c.recompute_granularity = r.granularity;
  c.recompute_modules = r.modules;
  c.fsdp.megatron_fsdp_enable_fine_grained_param_gather = fine_grained;
  if (!fine_grained && recompute_reruns_weighted_modules(r.granularity, r.modules)) {
    // Required by the (default) recompute-aware policy, and explicitly off.
    const std::string message = error_of([&] { c.validate(dp); });
    EXPECT_NE(message.find("--no-megatron-fsdp-enable-fine-grained-param-gather is not valid"), std::string::npos)
        << message;
    return;
  }
  TrainConfig ddp_config = as_ddp(c);
  ddp_config.fsdp.megatron_fsdp_enable_fine_grained_param_gather = std::nullopt;  // FSDP's flag
  const TrainResult ddp = train_local(dp, ddp_config);
  const TrainResult fsdp = train_local(dp, c);
  ASSERT_EQ(fsdp.steps.size(), 3u);
  EXPECT_EQ(losses(fsdp), losses(ddp));
  ASSERT_EQ(fsdp.evals.size(), ddp.evals.size());
  for (size_t i = 0; i < fsdp.evals.size(); ++i) EXPECT_EQ(fsdp.evals[i].loss, ddp.evals[i].loss);
}

INSTANTIATE_TEST_SUITE_P(RecomputeFineGrainedDp, Mxfp8FsdpParity,
                         ::testing::Combine(::testing::Range(0, 5), ::testing::Bool(), ::testing::Values(1, 2, 4)),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool, int>>& info) {
                           return fmt::format("{}_{}_dp{}", kRecomputes[std::get<0>(info.param)].name,
                                              std::get<1>(info.param) ? "fine" : "unit", std::get<2>(info.param));
                         });

// ---- The trainer's refusals ----------------------------------------------------------------------

TEST(Mxfp8Fsdp, TheTrainerRefusesWhatFsdpCannotShardAsMxfp8) {
  TrainConfig c = mxfp8_fsdp_config(2);
  EXPECT_NO_THROW(c.validate(2));
  c.fsdp.data_parallel_sharding_strategy = ShardingStrategy::kOptimGrads;
  EXPECT_NE(error_of([&] { c.validate(2); }).find("needs --data-parallel-sharding-strategy optim_grads_params"),
            std::string::npos);
  c = mxfp8_fsdp_config(2);
  c.ddp.reuse_grad_buf_for_mxfp8_param_ag = true;
  EXPECT_NE(error_of([&] { c.validate(2); }).find("--reuse-grad-buf-for-mxfp8-param-ag is DDP's"), std::string::npos);
  // The megatron policy forces the fine-grained gather for any MXFP8 run; recompute-aware only
  // where a selective recompute re-runs weighted modules.
  c = mxfp8_fsdp_config(2);
  EXPECT_FALSE(c.fine_grained_param_gather().on);
  c.fsdp.fine_grained_param_gather_policy = FineGrainedParamGatherPolicy::kMegatron;
  EXPECT_TRUE(c.fine_grained_param_gather().required);
}

TEST(Mxfp8Fsdp, FsdpRefusesMxfp8ParamsUnlessItShardsParams) {
  const GptConfig model{.num_layers = 1, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  run_local(1, [&](Communicator& comm) {
    MemoryTracker tracker;
    const auto specs = gpt_param_specs(model, true);
    auto init = gpt_init_params(model, 7);
    FsdpConfig fc;
    fc.data_parallel_sharding_strategy = ShardingStrategy::kOptim;
    const std::string message =
        error_of([&] { FullyShardedDataParallel(comm, specs, gpt_fsdp_units(model, false), fc, tracker, param_views(init, specs)); });
    EXPECT_NE(message.find("need data_parallel_sharding_strategy optim_grads_params"), std::string::npos) << message;
    EXPECT_NE(message.find("got optim"), std::string::npos) << message;

    // The forward-orientation mark means nothing on a param that is not MXFP8.
    auto marked = gpt_param_specs(model, false);
    marked[0].mxfp8_colwise_forward = true;
    const std::string unmarked = error_of(
        [&] { FullyShardedDataParallel(comm, marked, gpt_fsdp_units(model, false), FsdpConfig{}, tracker, param_views(init, marked)); });
    EXPECT_NE(unmarked.find("param '" + marked[0].name + "' is marked mxfp8_colwise_forward but not mxfp8"), std::string::npos)
        << unmarked;
  });
}

// ---- The event log ------------------------------------------------------------------------------

// The orientation of a param's copy in a slot axis (kRow: the forward's, kCol: backward's): the
// other one for a weight read column-wise in forward. Written from ParamSpec's rule.
QuantAxis orientation_in_slot(const ParamSpec& spec, QuantAxis slot_axis) {
  if (!spec.mxfp8_colwise_forward) return slot_axis;
  return slot_axis == QuantAxis::kRow ? QuantAxis::kCol : QuantAxis::kRow;
}

// An MXFP8 bucket's E8M0 scales in one slot axis: one byte per block of 32 of each param in the
// orientation that slot holds, padded to divide into dp shards.
int64_t padded_scales_numel(const std::vector<ParamSpec>& specs, const BucketPlacement& bucket, QuantAxis slot_axis,
                            int dp) {
  int64_t n = 0;
  for (int p : bucket.params) {
    const ParamSpec& spec = specs[static_cast<size_t>(p)];
    n += mx_scale_shape(spec.shape[0], spec.shape[1], orientation_in_slot(spec, slot_axis)).numel();
  }
  return (n + dp - 1) / dp * dp;
}

// Each unit's bucket bytes per slot (values: bf16, 2 per element; row- and column-wise: 1 and the
// orientation's scales), from the layout FSDP computes for these units (the param shapes, padded
// as the layout rule pads).
std::vector<std::array<int64_t, kGatherSlots>> unit_slot_bytes(const FullyShardedDataParallel& fsdp) {
  std::vector<std::array<int64_t, kGatherSlots>> bytes(static_cast<size_t>(fsdp.num_units() + 1), {0, 0, 0});
  const auto& layout = fsdp.layout();
  const int dp = fsdp.communicator().size();
  for (int u = 0; u <= fsdp.num_units(); ++u)
    for (int b : u < fsdp.num_units() ? fsdp_engine(fsdp).unit_buckets(u) : fsdp_engine(fsdp).non_unit_buckets()) {
      const BucketPlacement& bucket = layout.buckets[static_cast<size_t>(b)];
      const bool mxfp8 = fsdp.params()[static_cast<size_t>(bucket.params.front())].mxfp8;
      auto& slot = bytes[static_cast<size_t>(u)];
      if (mxfp8) {
        slot[1] += bucket.range.size() + padded_scales_numel(fsdp.params(), bucket, QuantAxis::kRow, dp);
        slot[2] += bucket.range.size() + padded_scales_numel(fsdp.params(), bucket, QuantAxis::kCol, dp);
      } else {
        slot[0] += 2 * bucket.range.size();
      }
    }
  return bytes;
}

struct Driven {
  std::vector<FsdpGatherEvent> events;  // one iteration of `micro` micro-batches, then an evaluation
  std::array<int64_t, kGatherSlots> peaks{};
  int64_t gathered_peak_bytes = 0;  // the tracker's kGathered peak: every slot together
  int units = 0;
  std::vector<std::array<int64_t, kGatherSlots>> slot_bytes;  // [unit + 1] from the layout
};

// Drives FSDP with MXFP8 params and a GPT through `iters` iterations by hand on 2 ranks and returns
// rank r's log; checks at every finish_grad_sync that nothing is gathered.
Driven drive(const GptConfig& model, const Recompute& r, bool fine_grained, bool overlap, int rank, int iters = 2) {
  Driven out;
  set_compute_threads(1);
  run_local(2, [&](Communicator& comm) {
    FsdpConfig fc;
    fc.overlap_grad_reduce = fc.overlap_param_gather = overlap;
    HandDrivenFsdpGpt run(
        comm, model, fc,
        {.recompute_granularity = r.granularity, .recompute_modules = r.modules, .fine_grained_param_gather = fine_grained},
        /*mxfp8=*/true);
    auto& [tracker, pool, specs, init, fsdp, opt, gpt, data, tokens] = run;
    for (int it = 0; it < iters; ++it) {
      opt.zero_grad();
      for (int m = 0; m < 2; ++m) forward_backward_micro_batch(fsdp, gpt, data, it, m, tokens);
      EXPECT_EQ(fsdp_engine(fsdp).units_gathered(), 0) << r.name << ": a unit is gathered at finish_grad_sync";
      fsdp.finish_grad_sync();
      EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered()) << r.name;
      EXPECT_EQ(tracker.usage().live(MemoryCategory::kGathered), 0) << r.name;
      opt.step();
    }
    opt.force_param_sync();
    gpt.evaluate(tokens.data(), 2);
    EXPECT_FALSE(fsdp_engine(fsdp).anything_gathered()) << r.name << ": after evaluation";
    if (comm.rank() != rank) return;
    out.events = fsdp_engine(fsdp).gather_events();
    for (int s = 0; s < kGatherSlots; ++s) out.peaks[static_cast<size_t>(s)] = fsdp.peak_gathered_bytes(static_cast<GatherSlot>(s));
    out.gathered_peak_bytes = tracker.usage().peak(MemoryCategory::kGathered);
    out.units = fsdp.num_units();
    out.slot_bytes = unit_slot_bytes(fsdp);
  });
  return out;
}

TEST(Mxfp8Fsdp, RowwiseOnlyInForwardAndRecomputeColumnwiseOnlyInBackwardEachReleasedOnce) {
  const GptConfig model{.num_layers = 2, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  for (const Recompute& r : kRecomputes)
    for (bool fine_grained : {false, true})
      for (bool overlap : {false, true})
        for (int rank : {0, 1}) {
          const std::string what = fmt::format("{} {} overlap {} rank {}", r.name, fine_grained ? "fine" : "unit", overlap, rank);
          const Driven d = drive(model, r, fine_grained, overlap, rank);
          std::vector<std::array<int, kGatherSlots>> held(static_cast<size_t>(d.units + 1), {0, 0, 0});
          int rowwise_recompute = 0, colwise = 0;
          for (const FsdpGatherEvent& e : d.events) {
            int& h = held[static_cast<size_t>(e.group)][static_cast<size_t>(e.slot)];
            if (e.kind == FsdpGatherEvent::Kind::kGather) {
              EXPECT_EQ(h, 0) << what << ": gathered twice";
              h = 1;
              EXPECT_TRUE(e.slot != GatherSlot::kRowwise || e.phase != FsdpPhase::kBackward) << what << ": row-wise in backward";
              EXPECT_TRUE(e.slot != GatherSlot::kColwise || e.phase == FsdpPhase::kBackward)
                  << what << ": column-wise outside backward";
              rowwise_recompute += e.slot == GatherSlot::kRowwise && e.phase == FsdpPhase::kRecompute;
              colwise += e.slot == GatherSlot::kColwise;
            } else {
              EXPECT_EQ(h, 1) << what << ": released without a gather";
              h = 0;
            }
            // The non-unit params are BF16: values only.
            EXPECT_TRUE(e.group != d.units || e.slot == GatherSlot::kValues) << what;
          }
          for (const auto& slots : held)
            for (int h : slots) EXPECT_EQ(h, 0) << what << ": still held at the end";
          // Units holding MXFP8 weights: 4 per layer either way (a layer, or its qkv, proj, fc1, fc2).
          const int weighted_units = fine_grained ? 4 * model.num_layers : model.num_layers;
          EXPECT_EQ(colwise, weighted_units * 2 * 2) << what << ": one column-wise gather per unit, micro-batch, iteration";
          // A recompute gathers row-wise again: the whole layer without fine-grained (full, or any
          // selective that re-runs layernorm or mlp), only fc1 with it (mlp's recompute stops at GELU).
          int expected = 0;
          // (A full recompute re-runs mlp only up to GELU too: fc2 is not gathered.)
          if (r.granularity == RecomputeGranularity::kFull) expected = fine_grained ? 3 * model.num_layers : model.num_layers;
          else if (recompute_reruns_weighted_modules(r.granularity, r.modules))
            expected = fine_grained ? (r.modules.contains(RecomputeModule::kMlp) ? model.num_layers : 0) : model.num_layers;
          EXPECT_EQ(rowwise_recompute, expected * 2 * 2) << what;
        }
}

// ---- Peak gathered bytes: selective mlp, fine-grained on against off ------------------------------

TEST(Mxfp8Fsdp, FineGrainedLowersThePeakOfASelectiveMlpRecomputeByWhatTheShapesImply) {
  const GptConfig model{.num_layers = 2, .hidden_size = 32, .num_attention_heads = 2, .seq_length = 16};
  const Recompute mlp{"selective_mlp", RecomputeGranularity::kSelective, {RecomputeModule::kMlp}};
  // Without prefetch (overlap off) what is gathered at any moment follows from the hooks alone.
  // v, r, c: a unit's values, row-wise and column-wise bytes; NU the non-unit values, held from the
  // embeddings' pre-forward to finish_grad_sync.
  const Driven off = drive(model, mlp, false, /*overlap=*/false, 0, 1);
  const Driven on = drive(model, mlp, true, /*overlap=*/false, 0, 1);
  const auto v = [](const Driven& d, size_t u) { return d.slot_bytes[u][0]; };
  const auto r = [](const Driven& d, size_t u) { return d.slot_bytes[u][1]; };
  const auto c = [](const Driven& d, size_t u) { return d.slot_bytes[u][2]; };
  // Unit-level: a layer's backward holds its values and column-wise payload from the pre-backward,
  // and the recompute adds the whole layer's row-wise payload.
  int64_t expect_off = 0;
  for (size_t l = 0; l < static_cast<size_t>(model.num_layers); ++l)
    expect_off = std::max(expect_off, v(off, l) + c(off, l) + r(off, l));
  expect_off += v(off, static_cast<size_t>(off.units));
  // Fine-grained (units ln1, qkv, proj, ln2, fc1, fc2 per layer): forward holds one unit's values and
  // row-wise payload; fc1's recompute gathers its row-wise payload (released at its post-forward)
  // and its values, which stay through fc2's backward (fc2's values and column-wise) and fc1's own.
  int64_t expect_on = 0;
  for (size_t u = 0; u < static_cast<size_t>(on.units); ++u) expect_on = std::max({expect_on, v(on, u) + r(on, u), v(on, u) + c(on, u)});
  for (size_t l = 0; l < static_cast<size_t>(model.num_layers); ++l) {
    const size_t fc1 = 6 * l + 4, fc2 = 6 * l + 5;
    expect_on = std::max(expect_on, v(on, fc1) + std::max(v(on, fc2) + c(on, fc2), c(on, fc1)));
  }
  expect_on += v(on, static_cast<size_t>(on.units));
  EXPECT_EQ(off.gathered_peak_bytes, expect_off);
  EXPECT_EQ(on.gathered_peak_bytes, expect_on);
  EXPECT_EQ(off.gathered_peak_bytes - on.gathered_peak_bytes, expect_off - expect_on);
  EXPECT_GT(expect_off, expect_on);
  // Split by orientation: row-wise peaks at one layer's (off) against fc1's or fc2's (on).
  EXPECT_GT(off.peaks[1], on.peaks[1]);
}

// ---- Sharded scales (issue 30 point 2) ----------------------------------------------------------

// A GPT with MXFP8 linear weights, fine-grained units (each weight a unit of its own).
const GptConfig kScalesModel{.num_layers = 2, .hidden_size = 48, .num_attention_heads = 2, .seq_length = 8};

// FSDP over kScalesModel's params at dp ranks; fn(comm, fsdp, specs, bf16 initial values [param],
// tracker) on each rank right after construction. colwise_forward: every other MXFP8 param is marked
// as read column-wise in forward (as an HF Conv1D's W [in, out] is; the C++ GPT reads none so).
template <typename Fn>
void with_mxfp8_fsdp(int dp, Fn&& fn, bool colwise_forward = false) {
  run_local(dp, [&](Communicator& comm) {
    MemoryTracker tracker;
    std::vector<ParamSpec> specs = gpt_param_specs(kScalesModel, /*mxfp8=*/true);
    bool mark = false;
    for (ParamSpec& spec : specs)
      if (spec.mxfp8) spec.mxfp8_colwise_forward = colwise_forward && (mark = !mark);
    std::vector<std::vector<float>> init = gpt_init_params(kScalesModel, 3);
    FullyShardedDataParallel fsdp(comm, specs, gpt_fsdp_units(kScalesModel, true), FsdpConfig{}, tracker,
                                  param_views(init, specs));
    // What the MXFP8 shards were quantized from: the f32 initial values rounded to bf16.
    std::vector<std::vector<bf16_bits>> bf16(init.size());
    for (size_t p = 0; p < init.size(); ++p) {
      bf16[p].resize(init[p].size());
      convert_f32_to_bf16(init[p].data(), bf16[p].data(), init[p].size());
    }
    fn(comm, fsdp, specs, bf16, tracker);
  });
}

// Param p's whole-tensor quantization in one orientation: u8 data [M, N] and scales.
struct WholeTensor {
  std::vector<uint8_t> data, scales;
};
WholeTensor quantize_whole(const ParamSpec& spec, const std::vector<bf16_bits>& values, QuantAxis axis) {
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  WholeTensor w;
  w.data.resize(static_cast<size_t>(rows * cols));
  const Shape scale_shape = mx_scale_shape(rows, cols, axis);
  w.scales.resize(static_cast<size_t>(scale_shape.numel()));
  mx_quantize(TensorView{const_cast<bf16_bits*>(values.data()), DType::kBF16, spec.shape},
              TensorView{w.data.data(), DType::kU8, spec.shape}, TensorView{w.scales.data(), DType::kU8, scale_shape},
              {.axis = axis});
  return w;
}

TEST(Mxfp8FsdpScales, EachRanksShardIsTheSliceOfQuantizingTheWholeTensor) {
  for (bool colwise_forward : {false, true})
  for (int dp : {1, 2, 3, 4})
    with_mxfp8_fsdp(dp, [&](Communicator& comm, FullyShardedDataParallel& fsdp, const std::vector<ParamSpec>& specs,
                            const std::vector<std::vector<bf16_bits>>& bf16, MemoryTracker&) {
      const FsdpEngine& engine = fsdp_engine(fsdp);
      int mxfp8_buckets = 0;
      for (size_t b = 0; b < fsdp.layout().buckets.size(); ++b) {
        const BucketPlacement& bucket = fsdp.layout().buckets[b];
        if (!specs[static_cast<size_t>(bucket.params.front())].mxfp8) continue;
        ++mxfp8_buckets;
        for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
          // The slot axis's array: each param's whole-tensor scales in the orientation that slot
          // holds, in layout order, zero-padded.
          std::vector<uint8_t> whole;
          for (int p : bucket.params) {
            const ParamSpec& spec = specs[static_cast<size_t>(p)];
            const WholeTensor w = quantize_whole(spec, bf16[static_cast<size_t>(p)], orientation_in_slot(spec, axis));
            whole.insert(whole.end(), w.scales.begin(), w.scales.end());
          }
          const int64_t padded = padded_scales_numel(specs, bucket, axis, dp);
          whole.resize(static_cast<size_t>(padded), 0);
          const TensorView shard = engine.mxfp8_scales_shard(static_cast<int>(b), axis);
          ASSERT_EQ(shard.numel(), padded / dp) << "dp " << dp << " bucket " << b;
          const uint8_t* got = shard.data_as<const uint8_t>();
          const std::vector<uint8_t> mine(got, got + shard.numel());
          const auto from = whole.begin() + comm.rank() * shard.numel();
          EXPECT_EQ(mine, std::vector<uint8_t>(from, from + shard.numel()))
              << "dp " << dp << " rank " << comm.rank() << " bucket " << b << (axis == QuantAxis::kRow ? " row" : " col")
              << " slot, colwise_forward " << colwise_forward;
        }
      }
      EXPECT_EQ(mxfp8_buckets, 8) << "fine-grained: qkv, proj, fc1, fc2 of 2 layers";
    }, colwise_forward);
}

TEST(Mxfp8FsdpScales, AGatherBringsBackTheWholeTensorsScalesAndData) {
  for (bool colwise_forward : {false, true})
  for (int dp : {2, 3})
    with_mxfp8_fsdp(dp, [&](Communicator& comm, FullyShardedDataParallel& fsdp, const std::vector<ParamSpec>& specs,
                            const std::vector<std::vector<bf16_bits>>& bf16, MemoryTracker&) {
      fsdp.start_iteration([] {});
      const std::vector<std::vector<int>> units = gpt_fsdp_units(kScalesModel, true);
      int checked = 0;
      // Each unit's forward copy in a forward pass (row-wise; column-wise for a param read so), then
      // its other copy in backward; the pass's slot axis is kRow in forward, kCol in backward.
      auto check = [&](const std::vector<int>& unit, QuantAxis slot_axis) {
        for (int p : unit) {
          if (!specs[static_cast<size_t>(p)].mxfp8) continue;
          const QuantAxis axis = orientation_in_slot(specs[static_cast<size_t>(p)], slot_axis);
          const Mxfp8View v = fsdp.mxfp8_param(p, axis);
          EXPECT_EQ(v.options.axis, axis);
          const WholeTensor w = quantize_whole(specs[static_cast<size_t>(p)], bf16[static_cast<size_t>(p)], axis);
          const auto* scales = v.scales.data_as<const uint8_t>();
          const auto* data = v.data.data_as<const uint8_t>();
          const std::string what = fmt::format("dp {} rank {} param {} {}", dp, comm.rank(),
                                               specs[static_cast<size_t>(p)].name, axis == QuantAxis::kRow ? "row" : "col");
          EXPECT_EQ(std::vector<uint8_t>(scales, scales + v.scales.numel()), w.scales) << what;
          EXPECT_EQ(std::vector<uint8_t>(data, data + v.data.numel()), w.data) << what;
          ++checked;
        }
      };
      for (const std::vector<int>& unit : units) {
        fsdp.before_forward(unit);
        check(unit, QuantAxis::kRow);
        fsdp.after_forward(unit);
      }
      for (auto unit = units.rbegin(); unit != units.rend(); ++unit) {
        fsdp.before_backward(*unit);
        check(*unit, QuantAxis::kCol);
      }
      fsdp.release_gathered_params();
      EXPECT_EQ(checked, 2 * 8) << "both orientations of qkv, proj, fc1, fc2 in 2 layers";
    }, colwise_forward);
}

TEST(Mxfp8FsdpScales, TheMxfp8BytesAtRestFallByDp) {
  // Per MXFP8 bucket of G elements (the params and the layout's padding): each orientation's
  // payload shard (G/dp) and scale shard (S_axis/dp, S_axis padded to a multiple of dp). So at most
  // (the whole tensors' payloads and scales + the layout's padding) / dp + 2 bytes per bucket.
  std::map<int, int64_t> at_rest;
  for (int dp : {1, 2, 4, 8})
    with_mxfp8_fsdp(dp, [&](Communicator& comm, FullyShardedDataParallel& fsdp, const std::vector<ParamSpec>& specs,
                            const std::vector<std::vector<bf16_bits>>&, MemoryTracker& tracker) {
      if (comm.rank() != 0) return;
      int64_t expected = 0, buckets = 0, whole = 0, padding = 0;
      for (const BucketPlacement& bucket : fsdp.layout().buckets) {
        if (!specs[static_cast<size_t>(bucket.params.front())].mxfp8) continue;
        ++buckets;
        expected += 2 * bucket.range.size() / dp + (padded_scales_numel(specs, bucket, QuantAxis::kRow, dp) +
                                                    padded_scales_numel(specs, bucket, QuantAxis::kCol, dp)) / dp;
        padding += bucket.range.size();
        for (int p : bucket.params) {
          const Shape& shape = specs[static_cast<size_t>(p)].shape;
          whole += 2 * shape.numel() + mx_scale_shape(shape[0], shape[1], QuantAxis::kRow).numel() +
                   mx_scale_shape(shape[0], shape[1], QuantAxis::kCol).numel();
          padding -= shape.numel();
        }
      }
      const int64_t live = tracker.usage().live(MemoryCategory::kMxfp8);
      EXPECT_EQ(live, expected) << "dp " << dp;
      EXPECT_LE(live, (whole + 2 * padding) / dp + 2 * buckets) << "dp " << dp;
      at_rest[dp] = live;
    });
  EXPECT_LT(at_rest[8], at_rest[1] / 4);
}

}  // namespace
}  // namespace mxddp::testing
