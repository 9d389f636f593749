// compute.h's host implementation: the CPU kernels (src/optim/adamw_kernel.h, core.h's casts and
// finiteness test) spread over the calling rank's threads (parallel_elements), each thread on one
// contiguous range, so that every result is the same at any thread count. Arguments arrive checked
// (compute.cc). The collectives' reduce and copy_to_many are reduce.h's kernels on the calling
// thread alone: the local backend already splits a collective across its ranks' progress threads.
#include <algorithm>
#include <cstring>
#include <vector>

#include <mxddp/compute.h>

#include "../core/parallel_elements.h"
#include "../optim/adamw_kernel.h"
#include "reduce.h"

namespace mxddp {
namespace {

// Runs kernel(grads + offset, params + offset) with both cast to their element types (params
// not staged, or main itself: optim_kernel::NoStage, since the kernel writes main anyway).
template <typename Kernel>
void with_typed(const ShardUpdate& s, int64_t offset, Kernel&& kernel) {
  const bool g32 = s.grads.dtype == DType::kF32;
  const bool stage = s.params.data != nullptr && s.params.data != s.main;
  const bool p32 = s.params.dtype == DType::kF32;
  auto* none = static_cast<optim_kernel::NoStage*>(nullptr);
  if (!stage && g32) kernel(s.grads.data_as<const float>() + offset, none);
  else if (!stage) kernel(s.grads.data_as<const bf16_bits>() + offset, none);
  else if (g32 && p32) kernel(s.grads.data_as<const float>() + offset, s.params.data_as<float>() + offset);
  else if (g32) kernel(s.grads.data_as<const float>() + offset, s.params.data_as<bf16_bits>() + offset);
  else if (p32) kernel(s.grads.data_as<const bf16_bits>() + offset, s.params.data_as<float>() + offset);
  else kernel(s.grads.data_as<const bf16_bits>() + offset, s.params.data_as<bf16_bits>() + offset);
}

// The host's events: its work is done when each call returns, so every event is reached.
class ReachedEvent final : public ComputeEvent {
 public:
  void wait() override {}
};

class CpuCompute final : public Compute {
 public:
  std::string_view name() const override { return "cpu"; }
  Device device() const override { return Device::cpu(); }
  MemoryPlace place() const override { return MemoryPlace::kHost; }
  void synchronize() override {}  // every operation has finished when it returns

 protected:
  ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    auto block = std::make_shared<HostBuffer>(bytes, category, tracker);
    if (zeroed && bytes > 0) parallel_zero(block->data(), bytes);
    void* data = block->data();
    return ComputeBuffer(std::move(block), data, bytes, Device::cpu());
  }
  // The host's own memory is what it copies fastest.
  ComputeBuffer run_allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    return run_allocate(bytes, category, tracker, zeroed);
  }

  void run_zero(void* data, size_t bytes) override { parallel_zero(data, bytes); }
  void run_copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void run_copy_from_host(void* dst, const void* host, size_t bytes) override { std::memcpy(dst, host, bytes); }
  void run_copy_to_host(void* host, const void* src, size_t bytes) override { std::memcpy(host, src, bytes); }
  void run_copy_to_host_async(void* host, const void* src, size_t bytes) override { std::memcpy(host, src, bytes); }
  std::unique_ptr<ComputeEvent> run_record_event() override { return std::make_unique<ReachedEvent>(); }

  void run_convert(const TensorView& in, const TensorView& out) override {
    const auto n = static_cast<size_t>(in.numel());
    if (in.dtype == DType::kF32) convert_f32_to_bf16(in.data_as<const float>(), out.data_as<bf16_bits>(), n);
    else convert_bf16_to_f32(in.data_as<const bf16_bits>(), out.data_as<float>(), n);
  }

  bool run_all_finite(const TensorView& data) override { return mxddp::all_finite(data); }

  int64_t run_count_zeros(std::span<const TensorView> runs) override {
    // A logging pass, once a step where asked for: one thread reads at the memory's speed.
    int64_t zeros = 0;
    for (const TensorView& run : runs) zeros += mxddp::count_zeros(run);
    return zeros;
  }

  double run_sum_of_squares(std::span<const TensorView> runs) override {
    // Each run is cut into chunks of kChunkNumel at fixed offsets; the chunks are summed over the
    // rank's threads (eight lanes each) and added up in order.
    constexpr int64_t kChunkNumel = int64_t{1} << 20;
    struct Chunk {
      const void* data;
      int64_t numel;
      bool f32;
    };
    std::vector<Chunk> chunks;
    for (const TensorView& run : runs) {
      const size_t element_bytes = dtype_size_bytes(run.dtype);
      for (int64_t at = 0; at < run.numel(); at += kChunkNumel)
        chunks.push_back({static_cast<const char*>(run.data) + static_cast<size_t>(at) * element_bytes,
                          std::min(kChunkNumel, run.numel() - at), run.dtype == DType::kF32});
    }
    std::vector<double> sums(chunks.size());
    parallel_elements(
        static_cast<int64_t>(chunks.size()),
        [&](int64_t c0, int64_t c1) {
          for (int64_t c = c0; c < c1; ++c) {
            const Chunk& k = chunks[static_cast<size_t>(c)];
            sums[static_cast<size_t>(c)] =
                k.f32 ? optim_kernel::sum_of_squares(static_cast<const float*>(k.data), k.numel)
                      : optim_kernel::sum_of_squares(static_cast<const bf16_bits*>(k.data), k.numel);
          }
        },
        /*min_per_thread=*/2, /*align=*/1);
    double sum = 0;
    for (double s : sums) sum += s;
    return sum;
  }

  void run_adamw(const ShardUpdate& shard, const AdamWScalars& a) override {
    const optim_kernel::AdamScalars s{a.lr,        a.weight_decay, a.beta1,      a.beta2, a.eps,
                                      a.step_size, a.bias_correction2_sqrt, a.clip_coeff, a.l2};
    float *main = shard.main, *m = shard.state0, *v = shard.state1;
    parallel_elements(shard.grads.numel(), [&](int64_t i0, int64_t i1) {
      with_typed(shard, i0, [&](auto* g, auto* p) { optim_kernel::adamw(g, main + i0, m + i0, v + i0, p, i1 - i0, s); });
    });
  }

  void run_sgd(const ShardUpdate& shard, const SgdScalars& a) override {
    const optim_kernel::SgdScalars s{a.lr, a.weight_decay, a.momentum, a.clip_coeff};
    float *main = shard.main, *momentum = shard.state0;
    parallel_elements(shard.grads.numel(), [&](int64_t i0, int64_t i1) {
      with_typed(shard, i0, [&](auto* g, auto* p) { optim_kernel::sgd(g, main + i0, momentum + i0, p, i1 - i0, s); });
    });
  }

  // quant.h's codec, which splits a large tensor across the machine's cores itself.
  void run_mx_quantize(const TensorView& input, const Mxfp8View& out) override {
    mxddp::mx_quantize(input, out.data, out.scales, out.options);
  }

  void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const QuantizeOptions& options) override {
    mxddp::mx_shard_scales(shard, offset, shape, scales, options);
  }
  void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const TensorView& data, const QuantizeOptions& options) override {
    mxddp::mx_shard_encode(shard, offset, shape, scales, data, options);
  }

  void run_reduce(const ReduceRun& r) override {
    reduce_arrays_to(r.dtype, r.op, r.inputs.data(), static_cast<int>(r.inputs.size()), r.count, r.outputs.data(),
                     static_cast<int>(r.outputs.size()), r.prescale);
  }

  void run_copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) override {
    mxddp::copy_to_many(src, dsts.data(), static_cast<int>(dsts.size()), bytes);
  }
};

}  // namespace

Compute& cpu_compute() {
  static CpuCompute compute;
  return compute;
}

}  // namespace mxddp
