// Jobs the device tests run on host memory and on a device and compare: every collective on
// buffers of a rank's compute (run_job), and DDP with the distributed optimizer, bf16 or MXFP8
// params (train_ddp). Shared by the local group's test on one GPU (local_group_test.cc) and the NCCL
// communicator's (nccl_device_test.cc).
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <mxddp/comm.h>
#include <mxddp/compute.h>
#include <mxddp/ddp.h>
#include <mxddp/optim.h>

namespace mxddp::testing {

constexpr int64_t kBlock = 70'003;  // per rank: odd, so the ranks' shares split mid-line

// Rank r's starting values for element i (NaN and Inf among them, and sums that round).
inline float start_value(int rank, int64_t i) {
  if (i % 9973 == 5) return rank == 1 ? NAN : 1.0f;
  if (i % 9973 == 6) return rank == 0 ? INFINITY : -2.0f;
  return std::sin(static_cast<float>(i * (rank + 3))) * std::exp2(static_cast<float>((i + rank) % 23) - 11.0f);
}

// What one rank ends with: its buffers after the job, copied to the host in one byte string.
inline std::vector<uint8_t> run_job(Communicator& comm, Compute& compute) {
  const int r = comm.rank(), n = comm.size();
  const int64_t whole = kBlock * n;
  MemoryTracker tracker;
  std::vector<float> host(static_cast<size_t>(whole));
  for (int64_t i = 0; i < whole; ++i) host[static_cast<size_t>(i)] = start_value(r, i);
  std::vector<bf16_bits> host16(host.size());
  convert_f32_to_bf16(host.data(), host16.data(), host.size());
  std::vector<int64_t> counts(64);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int64_t>(i) * (r + 1) - 40;

  const Device where = compute.device();
  ComputeBuffer f = compute.allocate(host.size() * 4, MemoryCategory::kGrads, tracker);
  ComputeBuffer h = compute.allocate(host16.size() * 2, MemoryCategory::kGrads, tracker);
  ComputeBuffer block = compute.allocate(static_cast<size_t>(kBlock) * 4, MemoryCategory::kGrads, tracker);
  ComputeBuffer c = compute.allocate(counts.size() * 8, MemoryCategory::kScratch, tracker);
  compute.copy_from_host(f.data(), host.data(), host.size() * 4);
  compute.copy_from_host(h.data(), host16.data(), host16.size() * 2);
  compute.copy_from_host(c.data(), counts.data(), counts.size() * 8);
  const TensorView fv = f.view(DType::kF32, Shape{whole}), hv = h.view(DType::kBF16, Shape{whole});
  const TensorView bv = block.view(DType::kF32, Shape{kBlock});
  EXPECT_EQ(fv.device, where);

  comm.all_reduce(fv, {.prescale = 0.5f});                          // DDP's grads, 1/dp fused
  comm.all_reduce(hv, {.op = ReduceOp::kAvg});                      // bf16 grads
  comm.all_reduce(c.view(DType::kI64, Shape{64}), {.op = ReduceOp::kMax});
  comm.reduce_scatter(fv, bv, {.prescale = 0.25f});                 // out of place
  comm.reduce_scatter(hv, hv.slice(r * kBlock, kBlock));            // in place: the grad buffer's
  Work gather = comm.all_gather(bv, fv, {.async_op = true});        // the param gather, overlapped
  gather.wait();
  comm.broadcast(hv.slice(0, kBlock), {.root = n - 1});

  std::vector<uint8_t> out(host.size() * 4 + host16.size() * 2 + counts.size() * 8);
  compute.copy_to_host(out.data(), f.data(), host.size() * 4);
  compute.copy_to_host(out.data() + host.size() * 4, h.data(), host16.size() * 2);
  compute.copy_to_host(out.data() + host.size() * 6, c.data(), counts.size() * 8);
  return out;
}

// DDP (bf16 params, f32 grads, the grad reduce overlapped) and AdamW on the distributed optimizer,
// 3 steps with grads made on the host from (rank, step, param) and copied into main_grad as a
// model's backward would leave them; returns the param buffer's bytes after the last gather. With
// mxfp8_reuse the weights are MXFP8 params gathered through the grad buffer (fp8_param_gather and
// reuse_grad_buf_for_mxfp8_param_ag), and the result is the model's copies instead: every MXFP8
// param's data and scales in both orientations, quantized on the device, and the others' bf16.
struct DdpResult {
  std::vector<uint8_t> params;
  std::vector<double> norms;
};

inline DdpResult train_ddp(Communicator& comm, Compute& compute, bool mxfp8_reuse) {
  const std::vector<ParamSpec> specs{{.name = "embedding", .shape = Shape{320, 64}, .mxfp8 = mxfp8_reuse},
                                     {.name = "fc1.weight", .shape = Shape{256, 64}, .mxfp8 = mxfp8_reuse},
                                     {.name = "fc1.bias", .shape = Shape{256}},
                                     {.name = "fc2.weight", .shape = Shape{64, 256}, .mxfp8 = mxfp8_reuse},
                                     {.name = "norm", .shape = Shape{64}}};
  std::vector<std::vector<float>> init;
  std::vector<TensorView> init_views;
  for (size_t p = 0; p < specs.size(); ++p) {
    init.emplace_back(static_cast<size_t>(specs[p].shape.numel()));
    for (size_t i = 0; i < init.back().size(); ++i) init.back()[i] = 0.02f * std::sin(static_cast<float>(i * (p + 1)));
    init_views.push_back(TensorView{init.back().data(), DType::kF32, specs[p].shape, Device::cpu()});
  }
  DdpConfig config;
  config.use_distributed_optimizer = true;
  config.overlap_grad_reduce = true;
  config.bucket_size = 20'000;
  config.fp8_param_gather = mxfp8_reuse;
  config.reuse_grad_buf_for_mxfp8_param_ag = mxfp8_reuse;
  MemoryTracker tracker;
  DistributedDataParallel ddp(comm, specs, config, tracker, init_views);
  EXPECT_EQ(&ddp.compute(), &compute) << "the buffers live on the communicator's compute";
  DistributedOptimizer opt(ddp, {.lr = 1e-2f, .weight_decay = 0.1f, .clip_grad = 0}, tracker);
  DdpResult out;
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    for (int p = static_cast<int>(specs.size()) - 1; p >= 0; --p) {  // backward's order
      std::vector<float> grad(static_cast<size_t>(specs[static_cast<size_t>(p)].shape.numel()));
      for (size_t i = 0; i < grad.size(); ++i)
        grad[i] = std::cos(static_cast<float>(i + 7 * step + 13 * p) * 0.37f * static_cast<float>(comm.rank() + 1));
      compute.copy_from_host(ddp.main_grad(p).data, grad.data(), grad.size() * sizeof(float));
      ddp.grad_ready(p);
    }
    ddp.finish_grad_sync();
    out.norms.push_back(opt.step().grad_norm);
  }
  opt.force_param_sync();
  auto append = [&](const TensorView& v) {
    const size_t at = out.params.size();
    out.params.resize(at + v.nbytes());
    compute.copy_to_host(out.params.data() + at, v.data, v.nbytes());
  };
  if (!mxfp8_reuse) append(ddp.buffer().param_buffer());
  for (int p = 0; mxfp8_reuse && p < ddp.num_params(); ++p) {
    if (!ddp.is_mxfp8(p)) append(ddp.param(p));
    else
      for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) {
        append(ddp.mxfp8_param(p, axis).data);
        append(ddp.mxfp8_param(p, axis).scales);
      }
  }
  return out;
}

// run_job's results of one rank on two runs, a (the host's) and b: equal bytes, except that a NaN
// may carry the device's own payload. ranks: the size of the group that ran them.
inline void expect_same_job_bytes(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int ranks) {
  const size_t whole = static_cast<size_t>(kBlock * ranks);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < whole; ++i) {
    float x, y;
    std::memcpy(&x, &a[4 * i], 4);
    std::memcpy(&y, &b[4 * i], 4);
    ASSERT_TRUE((std::isnan(x) && std::isnan(y)) || std::memcmp(&x, &y, 4) == 0)
        << "f32 element " << i << ": " << x << " vs " << y;
  }
  for (size_t i = 0; i < whole; ++i) {
    bf16_bits x, y;
    std::memcpy(&x, &a[whole * 4 + 2 * i], 2);
    std::memcpy(&y, &b[whole * 4 + 2 * i], 2);
    ASSERT_TRUE(x == y || (std::isnan(bf16_to_f32(x)) && std::isnan(bf16_to_f32(y)))) << "bf16 element " << i;
  }
  EXPECT_EQ(std::memcmp(&a[whole * 6], &b[whole * 6], 64 * 8), 0) << "the i64 max";
}

}  // namespace mxddp::testing
