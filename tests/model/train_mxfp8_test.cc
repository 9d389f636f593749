// Training the reference GPT with MXFP8 params (fp8_param_gather; the forward products read the
// row-wise weights, the data-gradient products the column-wise ones): staging the gathers in the
// grad buffer changes only where bytes live, overlap changes only timing, dp 1 and 4 agree, a
// resumed run reproduces the uninterrupted one, and the loss stays close to the BF16 run's.
#include <unistd.h>

#include <cstring>

#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "model/train_util.h"

namespace mxddp::testing {
namespace {

TrainConfig mxfp8_config(bool reuse) {
  TrainConfig c = small_train_config();
  c.ddp.fp8_param_gather = true;
  c.ddp.reuse_grad_buf_for_mxfp8_param_ag = reuse;
  return c;
}

TEST(TrainMxfp8, ReuseOnAndOffGiveBitwiseIdenticalLosses) {
  const TrainResult off = train_local(2, mxfp8_config(false));
  const TrainResult on = train_local(2, mxfp8_config(true));
  EXPECT_EQ(losses(on), losses(off));
  EXPECT_EQ(on.evals.back().loss, off.evals.back().loss);
  // And MXFP8 is really in use: the losses differ from the BF16 run's.
  EXPECT_NE(losses(on), losses(train_local(2, small_train_config())));
  // Without a BF16 param buffer the params category holds only the non-MXFP8 params' own copies.
  EXPECT_LT(on.memory_by_rank[0].steady.live(MemoryCategory::kParams),
            off.memory_by_rank[0].steady.live(MemoryCategory::kParams));
  EXPECT_GT(on.memory_by_rank[0].steady.live(MemoryCategory::kMxfp8), 0);
}

TEST(TrainMxfp8, OverlapParamGatherOnAndOffGiveIdenticalLosses) {
  TrainConfig c = mxfp8_config(true);
  const auto base = losses(train_local(2, c));
  c.ddp.overlap_param_gather = true;
  c.ddp.overlap_grad_reduce = true;
  c.ddp.bucket_size = 3000;
  EXPECT_EQ(losses(train_local(2, c)), base);
}

TEST(TrainMxfp8, Dp1AndDp4Agree) {
  const TrainConfig c = mxfp8_config(true);
  expect_close(losses(train_local(4, c)), losses(train_local(1, c)), 1e-5, "MXFP8 with reuse, dp 4 vs dp 1");
}

TEST(TrainMxfp8, ResumeInTheMiddleReproducesTheUninterruptedRun) {
  TempDir dir("mxddp_mxfp8_resume");
  TrainConfig c = mxfp8_config(true);
  c.train_iters = 6;
  const std::vector<double> full = losses(train_local(2, c));
  TrainConfig first = c;
  first.train_iters = 3;
  first.save_dir = dir / "ckpt";
  train_local(2, first);
  TrainConfig rest = c;
  rest.load_dir = dir / "ckpt";
  EXPECT_EQ(losses(train_local(2, rest)), std::vector<double>(full.begin() + 3, full.end()));
}

// The model params a checkpoint stores are bf16(main params) in every mode, MXFP8 reuse included
// (whose staging lives in grad memory, zeroed once quantized).
TEST(TrainCheckpoint, ModelTensorsAreTheMainParamsCastToBf16InEveryMode) {
  struct Mode {
    const char* name;
    TrainConfig config;
  };
  std::vector<Mode> modes = {{"bf16", small_train_config()}, {"mxfp8", mxfp8_config(false)},
                             {"mxfp8 + reuse", mxfp8_config(true)}, {"fsdp", small_train_config()}};
  modes[3].config.use_megatron_fsdp = true;
  for (Mode& mode : modes) {
    TempDir dir("mxddp_model_tensors");
    mode.config.train_iters = 2;
    mode.config.eval_iters = 0;
    mode.config.save_dir = dir / "ckpt";
    train_local(2, mode.config);
    int64_t compared = 0, nonzero = 0;
    for (int rank = 0; rank < 2; ++rank) {
      const std::string path =
          fmt::format("{}/rank_{:05d}.safetensors", resolve_checkpoint_dir(mode.config.save_dir), rank);
      const std::vector<char> file = ckpt::read_file(path);
      const auto entries = ckpt::decode_safetensors(file, path);
      for (const auto& [name, entry] : entries) {
        if (!name.starts_with("main/")) continue;
        const auto model = entries.find("model/" + name.substr(5));
        ASSERT_NE(model, entries.end()) << mode.name << ": no model slice for " << name;
        ASSERT_EQ(model->second.dtype, DType::kBF16) << mode.name << " " << name;
        ASSERT_EQ(model->second.numel, entry.numel) << mode.name << " " << name;
        for (int64_t i = 0; i < entry.numel; ++i) {
          float main;
          bf16_bits saved;
          std::memcpy(&main, file.data() + entry.offset + 4 * i, 4);
          std::memcpy(&saved, file.data() + model->second.offset + 2 * i, 2);
          ASSERT_EQ(saved, f32_to_bf16(main)) << mode.name << " " << name << " element " << i;
          nonzero += saved != 0;
          ++compared;
        }
      }
    }
    EXPECT_EQ(compared, small_train_config().model.num_params()) << mode.name << ": every param saved once";
    EXPECT_GT(nonzero, compared / 2) << mode.name;
  }
}

// The default model and data for the default length, MXFP8 params (staged in the grad buffer)
// against BF16 on the same seeds. "Final loss" is the validation loss over 8 global batches. One
// seed's final loss is chaotic in small perturbations: a 1e-6 relative change of the clip
// coefficient moved MXFP8's from +0.2% to +4.6% of BF16's. Measured paired differences (MXFP8 / BF16
// - 1) over seeds 1-6: -2.4, -1.7, +1.0, -0.5, +1.7, -0.5% (mean -0.4%, sd 1.6%). So the claim is
// made of the mean over three seeds (sd about 0.9%): within 3% of BF16, over 3 sd from a failure
// by chance; and no seed beyond 6% (over 3.5 sd), which a systematic MXFP8 fault would cross.
TEST(TrainMxfp8, FinalLossWithinThreePercentOfBf16OnTheDefaultRunOverThreeSeeds) {
  const double mean_ratio = mean_final_loss_ratio(
      [](TrainConfig& c) {
        c.ddp.fp8_param_gather = true;
        c.ddp.reuse_grad_buf_for_mxfp8_param_ag = true;
      },
      "bf16", "mxfp8");
  EXPECT_LT(std::abs(mean_ratio), 0.03);
}

}  // namespace
}  // namespace mxddp::testing
