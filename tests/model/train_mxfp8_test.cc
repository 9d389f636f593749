// Training the reference GPT with MXFP8 params (fp8_param_gather; the forward products read the
// row-wise weights, the data-gradient products the column-wise ones): staging the gathers in the
// grad buffer changes only where bytes live, overlap changes only timing, dp 1 and 4 agree, a
// resumed run reproduces the uninterrupted one, and the loss stays close to the BF16 run's.
#include <unistd.h>

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

// The default model and data for the default length. "Final loss" is the validation loss over 8
// global batches: a single training batch's loss is too noisy for a 3% comparison.
TEST(TrainMxfp8, FinalLossWithinThreePercentOfBf16OnTheDefaultRun) {
  TrainConfig bf16;
  bf16.eval_iters = 8;
  bf16.eval_interval = 0;
  TrainConfig mxfp8 = bf16;
  mxfp8.ddp.fp8_param_gather = true;
  mxfp8.ddp.reuse_grad_buf_for_mxfp8_param_ag = true;
  const double loss_bf16 = train_local(2, bf16).evals.back().loss;
  const double loss_mxfp8 = train_local(2, mxfp8).evals.back().loss;
  std::printf("final validation loss: bf16 %.4f, mxfp8 %.4f (%+.2f%%)\n", loss_bf16, loss_mxfp8,
              100.0 * (loss_mxfp8 / loss_bf16 - 1.0));
  EXPECT_LT(loss_bf16, 1.0) << "the comparison is only meaningful once the model has learned";
  EXPECT_LT(std::abs(loss_mxfp8 / loss_bf16 - 1.0), 0.03);
}

}  // namespace
}  // namespace mxddp::testing
