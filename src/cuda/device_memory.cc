// The device side's runtime glue (cuda.h): whether a device is usable, streams, synchronization
// and copies, the stream-ordered allocator interface with the CUDA runtime's pool as its default,
// and DeviceBuffer, charged to a MemoryTracker as HostBuffer is.
#include <atomic>
#include <cstdlib>

#include <mxddp/cuda.h>

#include "cuda/cuda_check.h"

namespace mxddp {

int cuda_device_count(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    if (why != nullptr) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      *why = status != cudaSuccess
                 ? fmt::format("no usable CUDA device: {} ({})", cudaGetErrorString(status), cudaGetErrorName(status))
                 : fmt::format("no CUDA device (CUDA_VISIBLE_DEVICES={})", visible ? visible : "<unset>");
    }
    cudaGetLastError();  // a failed probe must not poison the next runtime call
    return 0;
  }
  return count;
}

void cuda_synchronize(CudaStream stream) { MXDDP_CUDA_CHECK(cudaStreamSynchronize(stream), "synchronizing a stream"); }

void cuda_set_device(int device) { select_device(device); }

OwnedCudaStream::OwnedCudaStream() {
  MXDDP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
}

OwnedCudaStream::~OwnedCudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);  // returns at once; pending work still completes
}

void cuda_copy(void* dst, const void* src, size_t bytes, CudaStream stream) {
  if (bytes == 0) return;
  MXDDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "copying {} bytes", bytes);
}

namespace {

class CudaPoolAllocator final : public DeviceAllocator {
 public:
  void* allocate(size_t bytes, CudaStream stream) override {
    void* p = nullptr;
    const cudaError_t status = cudaMallocAsync(&p, bytes, stream);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw OutOfMemory(bytes, "device memory (cudaMallocAsync)");
    }
    MXDDP_CUDA_CHECK(status, "cudaMallocAsync of {} bytes", bytes);
    return p;
  }
  void deallocate(void* data, size_t, CudaStream stream) noexcept override { cudaFreeAsync(data, stream); }
  std::string_view name() const override { return "cuda_malloc_async"; }
};

std::atomic<DeviceAllocator*> g_allocator{nullptr};

}  // namespace

DeviceAllocator& cuda_pool_allocator() {
  static CudaPoolAllocator pool;
  return pool;
}

DeviceAllocator& device_allocator() {
  DeviceAllocator* a = g_allocator.load(std::memory_order_acquire);
  return a != nullptr ? *a : cuda_pool_allocator();
}

void set_device_allocator(DeviceAllocator* allocator) { g_allocator.store(allocator, std::memory_order_release); }

DeviceBuffer::DeviceBuffer(size_t bytes, MemoryCategory category, MemoryTracker& tracker, CudaStream stream,
                           DeviceAllocator* allocator) {
  if (bytes == 0) return;
  MXDDP_CUDA_CHECK(cudaGetDevice(&device_index_), "reading the current device");
  DeviceAllocator* a = allocator ? allocator : &device_allocator();
  block_ = std::unique_ptr<void, detail::DeviceBlockRelease>(
      a->allocate(bytes, stream), detail::DeviceBlockRelease{bytes, category, &tracker, a, stream});
  tracker.on_allocate(category, static_cast<int64_t>(bytes), MemoryPlace::kDevice);
}

void detail::DeviceBlockRelease::operator()(void* data) const noexcept {
  allocator->deallocate(data, bytes, stream);
  tracker->on_free(category, static_cast<int64_t>(bytes), MemoryPlace::kDevice);
}

TensorView DeviceBuffer::view(DType dtype, const Shape& shape) const {
  const size_t need = static_cast<size_t>(shape.numel()) * dtype_size_bytes(dtype);
  MXDDP_CHECK(need <= size_bytes(), "a {} {} view needs {} bytes; the device buffer holds {}", dtype_name(dtype),
              shape.to_string(), need, size_bytes());
  return TensorView{data(), dtype, shape, Device::cuda(device_index_)};
}

}  // namespace mxddp
