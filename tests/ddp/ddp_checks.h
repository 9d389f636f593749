// DDP gradient-sync checks shared by the local-backend suite and the MPI suite. Every rank derives
// its gradients from (rank, param, element, micro-batch) alone, so each rank computes the serial
// reference itself. Gradients are quarter steps in [-8, 8): exact in bf16 and f32.
#pragma once

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include <mxddp/ddp.h>

namespace mxddp::testing {

// A small model's params, registration order, with a tied embedding; bucket_size 300 below splits
// it into several buckets of different sizes.
inline std::vector<ParamSpec> small_model() {
  return {{"embed", Shape{40, 8}, true}, {"l0.w", Shape{8, 8}},   {"l0.b", Shape{8}},
          {"l1.w", Shape{8, 24}},        {"l1.b", Shape{24}},     {"l2.w", Shape{24, 8}},
          {"l2.b", Shape{8}},            {"norm", Shape{8}}};
}

inline float grad_value(int rank, int param, int64_t e, int micro) {
  return static_cast<float>(((rank * 13 + param * 7 + e * 5 + micro * 3) % 64) - 32) * 0.25f;
}

inline float read(const TensorView& v, int64_t i) {
  return v.dtype == DType::kF32 ? v.data_as<float>()[i] : bf16_to_f32(v.data_as<bf16_bits>()[i]);
}
inline void write(const TensorView& v, int64_t i, float x) {
  if (v.dtype == DType::kF32) v.data_as<float>()[i] = x;
  else v.data_as<bf16_bits>()[i] = f32_to_bf16(x);
}

// One micro-batch of "backward": accumulate into main_grad and report each param, in an order
// that differs between ranks (the library must still issue collectives in the same order).
inline void backward(DistributedDataParallel& ddp, int rank, int micro) {
  std::vector<int> order(static_cast<size_t>(ddp.num_params()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(order.size() - 1 - i);
  std::mt19937 rng(static_cast<unsigned>(rank * 100 + micro));
  std::shuffle(order.begin(), order.end(), rng);
  for (int p : order) {
    const TensorView g = ddp.main_grad(p);
    for (int64_t e = 0; e < g.numel(); ++e) write(g, e, read(g, e) + grad_value(rank, p, e, micro));
    ddp.grad_ready(p);
  }
}

// This rank's local accumulated gradient as the grad buffer holds it before the collective.
inline float local_grad(DType grad_dtype, int rank, int param, int64_t e, int micro_batches) {
  float acc = 0;
  for (int m = 0; m < micro_batches; ++m) {
    acc += grad_value(rank, param, e, m);
    if (grad_dtype == DType::kBF16) acc = bf16_to_f32(f32_to_bf16(acc));
  }
  return acc;
}

inline float round_to(DType dtype, float x) { return dtype == DType::kF32 ? x : bf16_to_f32(f32_to_bf16(x)); }

// The serial reference of the synchronized gradient, combining ranks in rank order.
inline float reduced_grad(const DdpConfig& cfg, DType grad_dtype, int dp, int param, int64_t e, int micro_batches) {
  const float scale = 1.0f / static_cast<float>(dp);
  float acc = 0;
  for (int r = 0; r < dp; ++r) {
    float g = local_grad(grad_dtype, r, param, e, micro_batches);
    if (!cfg.average_in_collective) g *= scale;  // prescale: in f32, fused into the sum
    acc = r == 0 ? g : acc + g;
  }
  if (cfg.average_in_collective) acc /= static_cast<float>(dp);
  return round_to(grad_dtype, acc);
}

// One iteration of `micro_batches`, then checks every element this rank can check: reduced where
// the collective delivers (its shard with reduce-scatter, everything with all-reduce) and, with
// reduce-scatter, the untouched local gradient elsewhere, which proves the choice.
inline void check_grad_sync(Communicator& comm, const DdpConfig& cfg, int micro_batches) {
  MemoryTracker tracker;
  DistributedDataParallel ddp(comm, small_model(), cfg, tracker);
  const int dp = comm.size(), rank = comm.rank();
  for (int iteration = 0; iteration < 2; ++iteration) {  // the second proves the state resets
    ddp.zero_grad_buffer();
    for (int m = 0; m + 1 < micro_batches; ++m) {
      auto scope = ddp.no_sync();
      backward(ddp, rank, m);
      for (int g = 0; g < ddp.num_bucket_groups(); ++g) EXPECT_FALSE(ddp.bucket_group_issued(g)) << "no_sync communicated";
    }
    backward(ddp, rank, micro_batches - 1);
    ddp.finish_grad_sync();
  }
  const bool rs = cfg.use_distributed_optimizer && !cfg.force_all_reduce;
  const ParamLayout& layout = ddp.buffer().layout();
  const DType grad_dtype = ddp.buffer().grad_buffer().dtype;
  int64_t bad = 0;
  std::string first;
  for (int p = 0; p < ddp.num_params(); ++p) {
    const TensorView g = ddp.main_grad(p);
    const Range pr = layout.params[static_cast<size_t>(p)].range;
    for (int64_t e = 0; e < g.numel(); ++e) {
      bool in_shard = true;
      if (rs) {
        const Range sr = layout.shards[static_cast<size_t>(rank)][static_cast<size_t>(layout.params[static_cast<size_t>(p)].bucket)].range;
        in_shard = pr.start + e >= sr.start && pr.start + e < sr.end;
      }
      // Outside this rank's shard an in-place reduce-scatter leaves scratch (comm.h).
      if (!in_shard) continue;
      const float want = reduced_grad(cfg, grad_dtype, dp, p, e, micro_batches);
      if (read(g, e) != want && bad++ == 0)
        first = fmt::format("param {} element {}: got {}, want {}", p, e, read(g, e), want);
    }
  }
  EXPECT_EQ(bad, 0) << "rank " << rank << "/" << dp << ": " << first;
}

// With overlap on, the first bucket group's collective must be issued, and complete, while later
// gradients are still outstanding.
inline void check_first_bucket_in_flight_before_last_grad_ready(Communicator& comm) {
  MemoryTracker tracker;
  DdpConfig cfg{.overlap_grad_reduce = true, .use_distributed_optimizer = true, .bucket_size = 300};
  DistributedDataParallel ddp(comm, small_model(), cfg, tracker);
  ASSERT_GE(ddp.num_bucket_groups(), 2);
  const ParamLayout& layout = ddp.buffer().layout();
  std::vector<int> first_bucket = layout.buckets[0].params;
  ddp.zero_grad_buffer();
  auto report = [&](int p) {
    const TensorView g = ddp.main_grad(p);
    for (int64_t e = 0; e < g.numel(); ++e) write(g, e, grad_value(comm.rank(), p, e, 0));
    ddp.grad_ready(p);
  };
  for (int p : first_bucket) report(p);
  EXPECT_TRUE(ddp.bucket_group_issued(0));
  EXPECT_FALSE(ddp.bucket_group_issued(1));
  // Backward "computes" while the collective runs; it must finish without any further call.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!ddp.bucket_group_completed(0) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  EXPECT_TRUE(ddp.bucket_group_completed(0)) << "bucket 0 did not complete before the last grad_ready";
  for (int p = 0; p < ddp.num_params(); ++p)
    if (std::find(first_bucket.begin(), first_bucket.end(), p) == first_bucket.end()) report(p);
  ddp.finish_grad_sync();
}

}  // namespace mxddp::testing
