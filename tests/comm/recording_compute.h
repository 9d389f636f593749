// RecordingCompute: cpu_compute() behind a Compute that counts the calls the tests look for, may
// claim another device and may fail its reductions (a device fault). Shared by the comm, optimizer,
// FSDP and plan tests.
//
// Claiming a device runs the code above it down its device path on the CPU: every view it gives
// out says that device, every check of where buffers live applies, and its bytes are charged to
// the caller's tracker as device bytes (as a DeviceBuffer charges them). The pointers it hands out
// are its host blocks' addresses moved by kPoisonOffset, which makes them non-canonical on x86-64:
// code above that reads or writes "device" memory directly, instead of through a Compute, faults
// at once, as it would on a GPU. Each run_* moves them back (real()) before cpu_compute() works.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>

namespace mxddp::testing {

class RecordingCompute final : public Compute {
 public:
  explicit RecordingCompute(Device device = Device::cpu(), bool fail_reduce = false)
      : device_(device), fail_reduce_(fail_reduce) {}
  std::string_view name() const override { return "recording"; }
  Device device() const override { return device_; }
  MemoryPlace place() const override { return device_.is_cpu() ? MemoryPlace::kHost : MemoryPlace::kDevice; }
  void synchronize() override { ++synchronizes; }

  std::atomic<int> allocations{0}, host_allocations{0}, reduces{0}, copies{0}, copies_from_host{0}, synchronizes{0},
      quantizes{0};
  // While set, allocate_host fails (no page-locked memory left), as a staged collective would see it.
  std::atomic<bool> fail_host_allocation{false};

 protected:
  ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    ++allocations;
    if (device_.is_cpu()) {
      auto block = std::make_shared<ComputeBuffer>(cpu().allocate(bytes, category, tracker, zeroed));
      void* data = block->data();
      return ComputeBuffer(std::move(block), data, bytes, device_);
    }
    auto block = std::make_shared<DeviceCharge>(host_tracker_, bytes, category, tracker, zeroed);
    void* data = poisoned(block->block.data());
    return ComputeBuffer(std::move(block), data, bytes, device_);
  }
  // Host memory, never poisoned: the code above reads and writes it directly.
  ComputeBuffer run_allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    ++host_allocations;
    if (fail_host_allocation) MXDDP_FAIL("no page-locked host memory left (injected)");
    return cpu().allocate(bytes, category, tracker, zeroed);
  }
  void run_zero(void* data, size_t bytes) override { cpu().zero(real(data), bytes); }
  void run_copy(void* dst, const void* src, size_t bytes) override { cpu().copy(real(dst), real(src), bytes); }
  void run_copy_from_host(void* dst, const void* host, size_t bytes) override {
    ++copies_from_host;
    cpu().copy(real(dst), host, bytes);
  }
  void run_copy_to_host(void* host, const void* src, size_t bytes) override { cpu().copy(host, real(src), bytes); }
  void run_convert(const TensorView& in, const TensorView& out) override { cpu().convert(on_host(in), on_host(out)); }
  bool run_all_finite(const TensorView& data) override { return cpu().all_finite(on_host(data)); }
  double run_sum_of_squares(std::span<const TensorView> runs) override {
    std::vector<TensorView> moved(runs.begin(), runs.end());
    for (TensorView& v : moved) v = on_host(v);
    return cpu().sum_of_squares(moved);
  }
  void run_adamw(const ShardUpdate& shard, const AdamWScalars& scalars) override { cpu().adamw(on_host(shard), scalars); }
  void run_sgd(const ShardUpdate& shard, const SgdScalars& scalars) override { cpu().sgd(on_host(shard), scalars); }
  void run_mx_quantize(const TensorView& input, const Mxfp8View& out) override {
    ++quantizes;
    cpu().mx_quantize(on_host(input), {on_host(out.data), on_host(out.scales), out.options});
  }
  void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const QuantizeOptions& options) override {
    ++quantizes;
    cpu().mx_shard_scales(on_host(shard), offset, shape, on_host(scales), options);
  }
  void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const TensorView& data, const QuantizeOptions& options) override {
    ++quantizes;
    cpu().mx_shard_encode(on_host(shard), offset, shape, on_host(scales), on_host(data), options);
  }
  void run_reduce(const ReduceRun& run) override {
    ++reduces;
    if (fail_reduce_) MXDDP_FAIL("the device faulted (injected)");
    std::vector<const void*> inputs(run.inputs.begin(), run.inputs.end());
    std::vector<void*> outputs(run.outputs.begin(), run.outputs.end());
    for (const void*& p : inputs) p = real(p);
    for (void*& p : outputs) p = real(p);
    ReduceRun moved = run;
    moved.inputs = inputs;
    moved.outputs = outputs;
    cpu().reduce(moved);
  }
  void run_copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) override {
    ++copies;
    std::vector<void*> moved(dsts.begin(), dsts.end());
    for (void*& p : moved) p = real(p);
    cpu().copy_to_many(real(src), moved, bytes);
  }

 private:
  static constexpr uintptr_t kPoisonOffset = uintptr_t{1} << 62;

  // A host block charged to the caller's tracker as a device's while it lives. It keeps the host
  // blocks' own tracker alive, so a buffer may outlive its RecordingCompute.
  struct DeviceCharge {
    DeviceCharge(std::shared_ptr<MemoryTracker> host, size_t bytes, MemoryCategory c, MemoryTracker& t, bool zeroed)
        : host_tracker(std::move(host)), block(cpu().allocate(bytes, c, *host_tracker, zeroed)), tracker(t), category(c) {
      tracker.on_allocate(category, static_cast<int64_t>(bytes), MemoryPlace::kDevice);
    }
    ~DeviceCharge() { tracker.on_free(category, static_cast<int64_t>(block.size_bytes()), MemoryPlace::kDevice); }
    DeviceCharge(const DeviceCharge&) = delete;
    DeviceCharge& operator=(const DeviceCharge&) = delete;
    std::shared_ptr<MemoryTracker> host_tracker;  // declared first: outlives block
    ComputeBuffer block;
    MemoryTracker& tracker;
    MemoryCategory category;
  };

  static Compute& cpu() { return cpu_compute(); }
  // A host address as this compute hands it out, and back.
  void* poisoned(void* p) const {
    return p == nullptr || device_.is_cpu() ? p : reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + kPoisonOffset);
  }
  template <typename T>
  T* real(T* p) const {
    return p == nullptr || device_.is_cpu() ? p : reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) - kPoisonOffset);
  }
  // A view of this compute's memory as cpu_compute() takes it: the host's, at the real address.
  TensorView on_host(TensorView v) const {
    v.device = Device::cpu();
    v.data = real(v.data);
    return v;
  }
  ShardUpdate on_host(ShardUpdate s) const {
    s.grads = on_host(s.grads);
    s.params = on_host(s.params);
    s.main = real(s.main);
    s.state0 = real(s.state0);
    s.state1 = real(s.state1);
    return s;
  }

  const Device device_;
  const bool fail_reduce_;
  std::shared_ptr<MemoryTracker> host_tracker_ = std::make_shared<MemoryTracker>();  // the host blocks' charges
};

// A local group's ranks on a claimed device: one RecordingCompute per rank claiming `device` (none
// for 0 ranks: the group stays on the host), and the LocalOptions that hand them to run_local or a
// LocalGroup. Must outlive the group.
struct ClaimedDevice {
  explicit ClaimedDevice(int ranks, Device device = Device::cuda(5)) {
    for (int r = 0; r < ranks; ++r) {
      computes.push_back(std::make_unique<RecordingCompute>(device));
      options.computes.push_back(computes.back().get());
    }
  }
  std::vector<std::unique_ptr<RecordingCompute>> computes;  // [rank]
  LocalOptions options;
};

}  // namespace mxddp::testing
