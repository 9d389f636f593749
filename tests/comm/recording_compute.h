// RecordingCompute: cpu_compute() behind a Compute that counts the calls the tests look for, may
// claim another device (its host memory labelled as that device's, so that the code above it runs
// its device path on the CPU: every view it gives out, every check of where buffers live) and may
// fail its reductions (a device fault). Shared by the comm and optimizer tests.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include <mxddp/compute.h>

namespace mxddp::testing {

class RecordingCompute final : public Compute {
 public:
  explicit RecordingCompute(Device device = Device::cpu(), bool fail_reduce = false)
      : device_(device), fail_reduce_(fail_reduce) {}
  std::string_view name() const override { return "recording"; }
  Device device() const override { return device_; }
  MemoryPlace place() const override { return MemoryPlace::kHost; }
  void synchronize() override { ++synchronizes; }

  std::atomic<int> allocations{0}, reduces{0}, copies{0}, synchronizes{0}, quantizes{0};

 protected:
  // Host memory, labelled with the claimed device: the code above sees the device's views.
  ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    ++allocations;
    auto block = std::make_shared<ComputeBuffer>(cpu().allocate(bytes, category, tracker, zeroed));
    void* data = block->data();
    return ComputeBuffer(std::move(block), data, bytes, device_);
  }
  void run_zero(void* data, size_t bytes) override { cpu().zero(data, bytes); }
  void run_copy(void* dst, const void* src, size_t bytes) override { cpu().copy(dst, src, bytes); }
  void run_copy_from_host(void* dst, const void* host, size_t bytes) override { cpu().copy(dst, host, bytes); }
  void run_copy_to_host(void* host, const void* src, size_t bytes) override { cpu().copy(host, src, bytes); }
  // The views come labelled with the claimed device; cpu_compute() gets them as the host's.
  void run_convert(const TensorView& in, const TensorView& out) override { cpu().convert(host(in), host(out)); }
  bool run_all_finite(const TensorView& data) override { return cpu().all_finite(host(data)); }
  double run_sum_of_squares(std::span<const TensorView> runs) override {
    std::vector<TensorView> on_host(runs.begin(), runs.end());
    for (TensorView& v : on_host) v = host(v);
    return cpu().sum_of_squares(on_host);
  }
  void run_adamw(const ShardUpdate& shard, const AdamWScalars& scalars) override { cpu().adamw(host(shard), scalars); }
  void run_sgd(const ShardUpdate& shard, const SgdScalars& scalars) override { cpu().sgd(host(shard), scalars); }
  void run_mx_quantize(const TensorView& input, const Mxfp8View& out) override {
    ++quantizes;
    cpu().mx_quantize(host(input), {host(out.data), host(out.scales), out.options});
  }
  void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const QuantizeOptions& options) override {
    ++quantizes;
    cpu().mx_shard_scales(host(shard), offset, shape, host(scales), options);
  }
  void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const TensorView& data, const QuantizeOptions& options) override {
    ++quantizes;
    cpu().mx_shard_encode(host(shard), offset, shape, host(scales), host(data), options);
  }
  void run_reduce(const ReduceRun& run) override {
    ++reduces;
    if (fail_reduce_) MXDDP_FAIL("the device faulted (injected)");
    cpu().reduce(run);
  }
  void run_copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) override {
    ++copies;
    cpu().copy_to_many(src, dsts, bytes);
  }

 private:
  static Compute& cpu() { return cpu_compute(); }
  static TensorView host(TensorView v) {
    v.device = Device::cpu();
    return v;
  }
  static ShardUpdate host(ShardUpdate s) {
    s.grads = host(s.grads);
    s.params = host(s.params);
    return s;
  }
  const Device device_;
  const bool fail_reduce_;
};

}  // namespace mxddp::testing
