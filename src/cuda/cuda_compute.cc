// compute.h's implementation on the current CUDA device (cuda.h's make_cuda_compute): memory from
// device_allocator() (and page-locked host memory for staging), the element work through cuda.h's
// kernels on the rank's stream. Arguments arrive checked (src/compute/compute.cc). Tested against
// cpu_compute() by tests/compute/compute_test.cc where a device is usable.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include <mxddp/cuda.h>

#include "compute/reduce_cuda.h"
#include "cuda/cuda_check.h"

namespace mxddp {
namespace {

// Page-locked host memory (cudaHostAlloc), charged to a tracker at the host's place while it lives.
struct PinnedBlock {
  PinnedBlock(size_t bytes_in, MemoryCategory category_in, MemoryTracker& tracker_in)
      : bytes(bytes_in), category(category_in), tracker(tracker_in) {
    if (bytes == 0) return;
    // Portable: page-locked for every context, whichever device the allocating thread has current.
    const cudaError_t status = cudaHostAlloc(&data, bytes, cudaHostAllocPortable);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw OutOfMemory(bytes, "page-locked host memory (cudaHostAlloc)");
    }
    MXDDP_CUDA_CHECK(status, "cudaHostAlloc of {} bytes", bytes);
    tracker.on_allocate(category, static_cast<int64_t>(bytes), MemoryPlace::kHost);
  }
  ~PinnedBlock() {
    if (data == nullptr) return;
    cudaFreeHost(data);
    tracker.on_free(category, static_cast<int64_t>(bytes), MemoryPlace::kHost);
  }
  PinnedBlock(const PinnedBlock&) = delete;
  PinnedBlock& operator=(const PinnedBlock&) = delete;

  void* data = nullptr;
  size_t bytes;
  MemoryCategory category;
  MemoryTracker& tracker;
};

// The events a compute records, kept for reuse. A collective's issue records one (the grad
// buffer's bucket-ready to collective-issued path), and creating and destroying a CUDA event there
// each time costs driver calls on that path; torch's NCCL process group caches its events for the
// same reason. An event returns here when its ComputeEvent is destroyed, so nobody waits on it any
// more: recording it again cannot move a pending wait (a stream's wait binds to the record it saw).
// Shared by the compute and its events, which may outlive it.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  int device() const { return device_; }
  // A free event, or a new one (no timing: only its completion is asked for). Device selected.
  cudaEvent_t acquire() {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        const cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    MXDDP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event on device {}", device_);
    return e;
  }
  void release(cudaEvent_t e) noexcept {
    try {
      std::lock_guard lock(mutex_);
      free_.push_back(e);
      return;
    } catch (...) {  // no memory for the free list: the event goes, not the process
    }
    cudaEventDestroy(e);
  }

 private:
  int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

// A CUDA event recorded on a rank's stream, from the compute's pool.
class CudaEvent final : public ComputeEvent {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, CudaStream stream) : pool_(std::move(pool)) {
    select_device(pool_->device());
    event_ = pool_->acquire();
    const cudaError_t status = cudaEventRecord(event_, stream);
    if (status != cudaSuccess) {
      cudaEventDestroy(event_);  // not back to the pool: its state is unknown
      event_ = nullptr;
    }
    MXDDP_CUDA_CHECK(status, "recording an event on device {}'s stream", pool_->device());
  }
  ~CudaEvent() override {
    if (event_ != nullptr) pool_->release(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void wait() override {
    select_device(pool_->device());
    MXDDP_CUDA_CHECK(cudaEventSynchronize(event_), "the work before an event on device {}", pool_->device());
  }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_ = nullptr;
};

class CudaCompute final : public Compute {
 public:
  explicit CudaCompute(CudaStream stream) : stream_(stream) {
    MXDDP_CUDA_CHECK(cudaGetDevice(&device_), "reading the current device");
    events_ = std::make_shared<EventPool>(device_);
  }

  std::string_view name() const override { return "cuda"; }
  Device device() const override { return Device::cuda(device_); }
  MemoryPlace place() const override { return MemoryPlace::kDevice; }
  void synchronize() override {
    select();
    cuda_synchronize(stream_);
  }

 protected:
  ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    select();  // DeviceBuffer allocates on, and records, the calling thread's current device
    auto block = std::make_shared<DeviceBuffer>(bytes, category, tracker, stream_);
    if (zeroed) cuda_zero(block->data(), bytes, stream_);
    void* data = block->data();
    return ComputeBuffer(std::move(block), data, bytes, device());
  }

  // Page-locked, so that the copies to and from it run at the link's speed and asynchronously.
  ComputeBuffer run_allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) override {
    select();
    auto block = std::make_shared<PinnedBlock>(bytes, category, tracker);
    if (zeroed && bytes > 0) std::memset(block->data, 0, bytes);
    void* data = block->data;
    return ComputeBuffer(std::move(block), data, bytes, Device::cpu());
  }

  void run_zero(void* data, size_t bytes) override { cuda_zero(data, bytes, stream_); }
  void run_copy(void* dst, const void* src, size_t bytes) override { cuda_copy(dst, src, bytes, stream_); }
  // From pageable host memory the copy has read host when it returns (CUDA stages it).
  void run_copy_from_host(void* dst, const void* host, size_t bytes) override {
    select();
    cuda_copy(dst, host, bytes, stream_);
  }
  void run_copy_to_host(void* host, const void* src, size_t bytes) override {
    select();
    cuda_copy(host, src, bytes, stream_);
    cuda_synchronize(stream_);
  }
  // Into page-locked memory (allocate_host) cudaMemcpyAsync returns at once.
  void run_copy_to_host_async(void* host, const void* src, size_t bytes) override {
    select();
    cuda_copy(host, src, bytes, stream_);
  }
  std::unique_ptr<ComputeEvent> run_record_event() override { return std::make_unique<CudaEvent>(events_, stream_); }

  void run_convert(const TensorView& in, const TensorView& out) override {
    if (in.dtype == DType::kF32)
      cuda_convert_f32_to_bf16(in.data_as<const float>(), out.data_as<bf16_bits>(), in.numel(), stream_);
    else
      cuda_convert_bf16_to_f32(in.data_as<const bf16_bits>(), out.data_as<float>(), in.numel(), stream_);
  }

  bool run_all_finite(const TensorView& data) override {
    if (count_.data() == nullptr) count_ = DeviceBuffer(sizeof(int64_t), MemoryCategory::kScratch, scratch_tracker_, stream_);
    auto* count_device = static_cast<int64_t*>(count_.data());
    cuda_count_nonfinite(data.data, data.dtype, data.numel(), count_device, stream_);
    int64_t count = 0;
    run_copy_to_host(&count, count_device, sizeof count);
    return count == 0;
  }

  int64_t run_count_zeros(std::span<const TensorView> runs) override {
    // One counter for every run, zeroed once; one copy brings it to the host.
    select();
    if (count_.data() == nullptr) count_ = DeviceBuffer(sizeof(int64_t), MemoryCategory::kScratch, scratch_tracker_, stream_);
    auto* count_device = static_cast<int64_t*>(count_.data());
    cuda_zero(count_device, sizeof(int64_t), stream_);
    for (const TensorView& run : runs) cuda_count_zeros(run.data, run.dtype, run.numel(), count_device, stream_);
    int64_t count = 0;
    run_copy_to_host(&count, count_device, sizeof count);
    return count;
  }

  double run_sum_of_squares(std::span<const TensorView> runs) override {
    // Each run's fixed-order sum lands in its own slot; one copy brings the slots to the host, where
    // they are added in the runs' order.
    if (runs.empty()) return 0.0;
    const auto per_run = static_cast<size_t>(kCudaSumOfSquaresNumel);
    const size_t bytes = runs.size() * per_run * sizeof(double);
    if (sums_.size_bytes() < bytes) {
      sums_ = DeviceBuffer();
      sums_ = DeviceBuffer(bytes, MemoryCategory::kScratch, scratch_tracker_, stream_);
    }
    auto* slots = static_cast<double*>(sums_.data());
    for (size_t r = 0; r < runs.size(); ++r)
      cuda_sum_of_squares(runs[r].data, runs[r].dtype, runs[r].numel(), slots + r * per_run, stream_);
    host_sums_.resize(runs.size() * per_run);
    run_copy_to_host(host_sums_.data(), slots, bytes);
    double sum = 0;
    for (size_t r = 0; r < runs.size(); ++r) sum += host_sums_[r * per_run];
    return sum;
  }

  void run_adamw(const ShardUpdate& s, const AdamWScalars& scalars) override {
    cuda_adamw(s.grads.data, s.grads.dtype, s.main, s.state0, s.state1, staged(s), s.params.dtype, s.grads.numel(),
               scalars, stream_);
  }

  void run_sgd(const ShardUpdate& s, const SgdScalars& scalars) override {
    cuda_sgd(s.grads.data, s.grads.dtype, s.main, s.state0, staged(s), s.params.dtype, s.grads.numel(), scalars, stream_);
  }

  void run_mx_quantize(const TensorView& input, const Mxfp8View& out) override {
    cuda_mx_quantize(input, out.data, out.scales, out.options, stream_);
  }

  void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const QuantizeOptions& options) override {
    cuda_mx_shard_scales(shard, offset, shape, scales, options, stream_);
  }
  void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                           const TensorView& data, const QuantizeOptions& options) override {
    cuda_mx_shard_encode(shard, offset, shape, scales, data, options, stream_);
  }

  void run_reduce(const ReduceRun& r) override {
    constexpr size_t kMax = cuda_kernels::kReduceBuffersMax;
    MXDDP_CHECK(r.inputs.size() <= kMax && r.outputs.size() <= kMax,
                "reduce on {}: {} inputs and {} outputs; the device's reduction takes at most {} of each",
                to_string(device()), r.inputs.size(), r.outputs.size(), kMax);
    select();
    cuda_kernels::ReduceLaunch launch{.elem = reduce_elem(r.dtype), .combine = reduce_combine(r.op),
                                      .prescale = r.prescale, .count = r.count,
                                      .n_inputs = static_cast<int>(r.inputs.size()),
                                      .n_outputs = static_cast<int>(r.outputs.size())};
    std::copy(r.inputs.begin(), r.inputs.end(), launch.inputs);
    std::copy(r.outputs.begin(), r.outputs.end(), launch.outputs);
    MXDDP_CUDA_CHECK(cuda_kernels::launch_reduce(launch, stream_), "reduce ({} {} of {} inputs, {} elements)",
                     dtype_name(r.dtype), reduce_op_name(r.op), r.inputs.size(), r.count);
  }

  void run_copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) override {
    select();
    for (void* dst : dsts) cuda_copy(dst, src, bytes, stream_);
  }

 private:
  // The collectives call the methods that select() from their progress threads, which chose no
  // device: their first CUDA call would otherwise create a context on device 0.
  void select() const { select_device(device_); }

  static cuda_kernels::ReduceElem reduce_elem(DType dtype) {
    using E = cuda_kernels::ReduceElem;
    switch (dtype) {
      case DType::kF32: return E::kF32;
      case DType::kBF16: return E::kBF16;
      case DType::kF64: return E::kF64;
      case DType::kU8: return E::kU8;
      case DType::kI32: return E::kI32;
      case DType::kI64: return E::kI64;
      case DType::kBool: return E::kBool;
      default: break;
    }
    MXDDP_FAIL("reduce: dtype {} reached the device's reduction", dtype_name(dtype));  // Compute::reduce refuses it
  }
  static cuda_kernels::ReduceCombine reduce_combine(ReduceOp op) {
    return op == ReduceOp::kSum ? cuda_kernels::ReduceCombine::kSum
           : op == ReduceOp::kAvg ? cuda_kernels::ReduceCombine::kAvg
                                  : cuda_kernels::ReduceCombine::kMax;
  }

  // The kernels' staging target: none where the params are main itself (written as main already).
  static void* staged(const ShardUpdate& s) { return s.params.data == s.main ? nullptr : s.params.data; }

  CudaStream stream_;
  int device_ = 0;
  std::shared_ptr<EventPool> events_;  // record_event's, reused
  MemoryTracker scratch_tracker_;  // the few bytes of results below: not the rank's model state
  DeviceBuffer count_;             // [1] int64: all_finite's and count_zeros' count
  DeviceBuffer sums_;              // [runs][kCudaSumOfSquaresNumel] f64: sum_of_squares' slots
  std::vector<double> host_sums_;  // their copy on the host
};

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(CudaStream stream) { return std::make_unique<CudaCompute>(stream); }

}  // namespace mxddp
