// RecordingCompute: cpu_compute() behind a Compute that counts the calls the tests look for, may
// claim another device and may fail its reductions (a device fault). Shared by the comm, optimizer,
// FSDP and plan tests.
//
// Lagging (set `lagging`): the copies between the host and the claimed device (copy_from_host,
// copy_to_host_async) do not happen when the call returns but are queued, as on a stream that runs
// behind the host; the queue runs, in order, before any other operation of this compute and at
// synchronize(), and up to an event when that event is waited for (what was queued after it stays
// queued, as on a stream). A copy_from_host out of ordinary host
// memory reads it at once (as CUDA stages pageable memory); one out of allocate_host's memory reads
// it when the queue runs. Code above that reads staging before waiting for its copy, or reuses it
// while a copy out of it is queued, then moves the wrong bytes.
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
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <mxddp/comm.h>
#include <mxddp/compute.h>

namespace mxddp::testing {

class RecordingCompute final : public Compute {
 public:
  explicit RecordingCompute(Device device = Device::cpu(), bool fail_reduce = false)
      : device_(device), fail_reduce_(fail_reduce) {}
  ~RecordingCompute() override { drain(); }  // its queued copies use it
  RecordingCompute(const RecordingCompute&) = delete;
  RecordingCompute& operator=(const RecordingCompute&) = delete;
  std::string_view name() const override { return "recording"; }
  Device device() const override { return device_; }
  MemoryPlace place() const override { return device_.is_cpu() ? MemoryPlace::kHost : MemoryPlace::kDevice; }
  void synchronize() override {
    ++synchronizes;
    drain();
  }

  std::atomic<int> allocations{0}, host_allocations{0}, reduces{0}, copies{0}, copies_from_host{0}, synchronizes{0},
      quantizes{0}, copies_to_host_async{0}, events_recorded{0}, event_waits{0};
  // Each optimizer update call, and each run a sum of squares was asked over (a launch or two each
  // on a device).
  std::atomic<int> updates{0}, sum_of_squares_runs{0};
  // The thread that made the last copy_to_host_async.
  std::atomic<std::thread::id> async_copy_thread{};
  // While set, allocate_host fails (no page-locked memory left), as a staged collective would see it.
  std::atomic<bool> fail_host_allocation{false};
  // While set, host <-> device copies are queued (see the file comment). Set it before the compute's
  // first use.
  std::atomic<bool> lagging{false};
  // The lagging copies queued and not yet run.
  size_t queued_copies() const { return queue_->size(); }

 protected:
  ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    ++allocations;
    if (device_.is_cpu()) {
      auto block = std::make_shared<ComputeBuffer>(cpu().allocate(bytes, category, tracker, zeroed));
      void* data = block->data();
      return ComputeBuffer(std::move(block), data, bytes, device_);
    }
    auto block = std::make_shared<QueuedFree<DeviceCharge>>(queue_, host_tracker_, bytes, category, tracker, zeroed);
    void* data = poisoned(block->block.block.data());
    return ComputeBuffer(std::move(block), data, bytes, device_);
  }
  // Host memory, never poisoned: the code above reads and writes it directly.
  ComputeBuffer run_allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    ++host_allocations;
    if (fail_host_allocation) MXDDP_FAIL("no page-locked host memory left (injected)");
    ComputeBuffer block = cpu().allocate(bytes, category, tracker, zeroed);
    auto range = std::make_shared<PinnedRange>(PinnedRange{static_cast<char*>(block.data()), bytes});
    {
      std::lock_guard lock(pinned_mutex_);
      std::erase_if(pinned_, [](const std::weak_ptr<PinnedRange>& r) { return r.expired(); });
      pinned_.push_back(range);
    }
    // The owner keeps the range registered while the block lives.
    using Pinned = std::pair<ComputeBuffer, std::shared_ptr<PinnedRange>>;
    auto owner = std::make_shared<QueuedFree<Pinned>>(queue_, std::move(block), range);
    void* data = owner->block.first.data();
    return ComputeBuffer(std::move(owner), data, bytes, Device::cpu());
  }
  void run_zero(void* data, size_t bytes) override {
    drain();
    cpu().zero(real(data), bytes);
  }
  void run_copy(void* dst, const void* src, size_t bytes) override {
    drain();
    cpu().copy(real(dst), real(src), bytes);
  }
  void run_copy_from_host(void* dst, const void* host, size_t bytes) override {
    ++copies_from_host;
    if (!lagging || device_.is_cpu()) {
      drain();
      cpu().copy(real(dst), host, bytes);
      return;
    }
    if (is_pinned(host, bytes)) {
      enqueue([this, dst, host, bytes] { cpu().copy(real(dst), host, bytes); });
      return;
    }
    auto read_now = std::make_shared<std::vector<char>>(static_cast<const char*>(host),
                                                        static_cast<const char*>(host) + bytes);
    enqueue([this, dst, read_now, bytes] { cpu().copy(real(dst), read_now->data(), bytes); });
  }
  void run_copy_to_host(void* host, const void* src, size_t bytes) override {
    drain();
    cpu().copy(host, real(src), bytes);
  }
  void run_copy_to_host_async(void* host, const void* src, size_t bytes) override {
    ++copies_to_host_async;
    async_copy_thread = std::this_thread::get_id();
    if (!lagging || device_.is_cpu()) {
      drain();
      cpu().copy(host, real(src), bytes);
      return;
    }
    enqueue([this, host, src, bytes] { cpu().copy(host, real(src), bytes); });
  }
  std::unique_ptr<ComputeEvent> run_record_event() override {
    ++events_recorded;
    return std::make_unique<Event>(*this, queue_->position());
  }
  void run_convert(const TensorView& in, const TensorView& out) override {
    drain();
    cpu().convert(on_host(in), on_host(out));
  }
  bool run_all_finite(const TensorView& data) override {
    drain();
    return cpu().all_finite(on_host(data));
  }
  int64_t run_count_zeros(std::span<const TensorView> runs) override {
    drain();
    std::vector<TensorView> moved(runs.begin(), runs.end());
    for (TensorView& v : moved) v = on_host(v);
    return cpu().count_zeros(moved);
  }
  double run_sum_of_squares(std::span<const TensorView> runs) override {
    drain();
    sum_of_squares_runs += static_cast<int>(runs.size());
    std::vector<TensorView> moved(runs.begin(), runs.end());
    for (TensorView& v : moved) v = on_host(v);
    return cpu().sum_of_squares(moved);
  }
  void run_adamw(const ShardUpdate& shard, const AdamWScalars& scalars) override {
    drain();
    ++updates;
    cpu().adamw(on_host(shard), scalars);
  }
  void run_sgd(const ShardUpdate& shard, const SgdScalars& scalars) override {
    drain();
    ++updates;
    cpu().sgd(on_host(shard), scalars);
  }
  void run_mx_quantize(const TensorView& input, const Mxfp8View& out) override {
    drain();
    ++quantizes;
    cpu().mx_quantize(on_host(input), {on_host(out.data), on_host(out.scales), out.options});
  }
  void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const QuantizeOptions& options) override {
    drain();
    ++quantizes;
    cpu().mx_shard_scales(on_host(shard), offset, shape, on_host(scales), options);
  }
  void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const TensorView& data, const QuantizeOptions& options) override {
    drain();
    ++quantizes;
    cpu().mx_shard_encode(on_host(shard), offset, shape, on_host(scales), on_host(data), options);
  }
  void run_reduce(const ReduceRun& run) override {
    drain();
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
    drain();
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

  // An event: waiting for it runs the queue up to it (the copies queued before it was recorded).
  class Event final : public ComputeEvent {
   public:
    Event(RecordingCompute& compute, uint64_t position) : compute_(compute), position_(position) {}
    void wait() override {
      ++compute_.event_waits;
      compute_.queue_->drain(position_);
    }

   private:
    RecordingCompute& compute_;
    uint64_t position_;  // how many copies had been queued when it was recorded
  };
  struct PinnedRange {
    const char* data;
    size_t bytes;
  };

  // The lagging copies not yet run, in order. Shared with the blocks this compute hands out: freeing
  // one runs the queue first, as CUDA orders a stream-ordered free (and cudaFreeHost) after the
  // copies before it, so a queued copy never lands in freed memory.
  struct CopyQueue {
    std::mutex mutex;
    std::deque<std::function<void()>> copies;
    uint64_t pushed = 0;  // copies queued so far; those run are pushed - copies.size()
    void push(std::function<void()> copy) {
      std::lock_guard lock(mutex);
      copies.push_back(std::move(copy));
      ++pushed;
    }
    uint64_t position() {
      std::lock_guard lock(mutex);
      return pushed;
    }
    size_t size() {
      std::lock_guard lock(mutex);
      return copies.size();
    }
    // Runs the queued copies in order, on the calling thread: all of them, or those among the
    // first `upto` ever queued.
    void drain(uint64_t upto = UINT64_MAX) {
      std::lock_guard lock(mutex);
      while (!copies.empty() && pushed - copies.size() < upto) {
        copies.front()();
        copies.pop_front();
      }
    }
  };
  // What a block this compute hands out owns: the block, and its place in the copy queue's order.
  template <typename Block>
  struct QueuedFree {
    template <typename... Args>
    explicit QueuedFree(std::shared_ptr<CopyQueue> queue_in, Args&&... args)
        : queue(std::move(queue_in)), block(std::forward<Args>(args)...) {}
    ~QueuedFree() { queue->drain(); }
    QueuedFree(const QueuedFree&) = delete;
    QueuedFree& operator=(const QueuedFree&) = delete;
    std::shared_ptr<CopyQueue> queue;
    Block block;
  };

  void enqueue(std::function<void()> copy) { queue_->push(std::move(copy)); }
  void drain() { queue_->drain(); }
  bool is_pinned(const void* host, size_t bytes) {
    std::lock_guard lock(pinned_mutex_);
    const auto* p = static_cast<const char*>(host);
    for (const std::weak_ptr<PinnedRange>& weak : pinned_)
      if (auto r = weak.lock(); r && p >= r->data && p + bytes <= r->data + r->bytes) return true;
    return false;
  }

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
  std::shared_ptr<CopyQueue> queue_ = std::make_shared<CopyQueue>();
  std::mutex pinned_mutex_;                         // guards pinned_
  std::vector<std::weak_ptr<PinnedRange>> pinned_;  // allocate_host's live blocks
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
