// mxddp cuda: the library's device side. Built when CMake finds a CUDA compiler (MXDDP_CUDA, the
// target mxddp_cuda); this header needs no CUDA header to be included.
//
// Owns:
//   - whether a device is usable here (cuda_device_count), with the reason when none is;
//   - device memory: one stream-ordered allocator interface (DeviceAllocator), whose default is the
//     CUDA runtime's pool (cudaMallocAsync) and which a host framework replaces with its own (under
//     torch, its caching allocator, so the two never hold memory from each other), and DeviceBuffer,
//     the owning block charged to a MemoryTracker as HostBuffer is;
//   - the kernels, each beside its CPU reference in its layer and tested against it: the f32 <-> bf16
//     casts, scale, the NaN/Inf count and grad accumulation (src/core/elementwise_cuda.cu,
//     bit-exact), MXFP8 quantize and dequantize
//     (src/quant/mxfp8_cuda.cu, bit-exact), AdamW and SGD on a shard and the grad norm's sum of
//     squares (src/optim/optim_cuda.cu; the update bit-exact, the sum in a fixed order), and the
//     collectives' reduction across buffers (src/compute/reduce_cuda.cu, bit-exact; compute.h's
//     reduce, through make_cuda_compute).
//
// Every kernel takes device pointers and the stream it runs on, and returns once it is enqueued: a
// launch failure throws an Error naming the kernel and CUDA's message; a fault inside it surfaces
// at the next synchronization (cuda_synchronize). Sizes are checked before use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <mxddp/compute.h>
#include <mxddp/core.h>
#include <mxddp/memory.h>
#include <mxddp/quant.h>

struct CUstream_st;  // the CUDA runtime's stream type (cudaStream_t is a pointer to it)

namespace mxddp {

// cudaStream_t, without the CUDA headers. nullptr: the legacy default stream.
using CudaStream = ::CUstream_st*;

// Devices this process can use: 0, with why set (no driver, no device, CUDA_VISIBLE_DEVICES
// empty), where none is. Never throws.
int cuda_device_count(std::string* why = nullptr);
// Waits for every operation enqueued on stream; throws an Error with CUDA's message if one failed.
void cuda_synchronize(CudaStream stream);
// Makes device the calling thread's current device (what later allocations and launches on this
// thread use); throws an Error naming it when it does not exist.
void cuda_set_device(int device);

// A stream of the current device, destroyed with its owner: one per rank, so that each rank's work
// and its share of the collectives are ordered on their own (LocalOptions::computes). Non-blocking:
// it does not wait for the legacy default stream. Move-only.
class OwnedCudaStream {
 public:
  OwnedCudaStream();
  ~OwnedCudaStream();
  OwnedCudaStream(OwnedCudaStream&& other) noexcept : stream_(other.stream_) { other.stream_ = nullptr; }
  OwnedCudaStream& operator=(OwnedCudaStream&&) = delete;
  OwnedCudaStream(const OwnedCudaStream&) = delete;
  OwnedCudaStream& operator=(const OwnedCudaStream&) = delete;
  CudaStream get() const { return stream_; }

 private:
  CudaStream stream_ = nullptr;
};

// ----------------------------------------------------------------------------------------------
// Device memory
// ----------------------------------------------------------------------------------------------

// Stream-ordered device memory: a block allocated on a stream may be used by work enqueued on that
// stream after the call, and deallocate(p, bytes, stream) frees it once the work enqueued before the
// call is done. Implementations throw OutOfMemory when the device has no room.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(size_t bytes, CudaStream stream) = 0;
  virtual void deallocate(void* data, size_t bytes, CudaStream stream) noexcept = 0;
  virtual std::string_view name() const = 0;  // "cuda_malloc_async", "torch", ...
};

// The CUDA runtime's stream-ordered pool of the current device (cudaMallocAsync / cudaFreeAsync).
DeviceAllocator& cuda_pool_allocator();
// The allocator DeviceBuffers use when given none: cuda_pool_allocator() until replaced. The
// replacement must outlive every buffer it allocated; nullptr restores the default.
DeviceAllocator& device_allocator();
void set_device_allocator(DeviceAllocator* allocator);

namespace detail {
// What freeing a DeviceBuffer's block needs: it goes back to its allocator on its stream and leaves
// the tracker. As the owner's deleter it makes the buffer move-only with the defaults.
struct DeviceBlockRelease {
  size_t bytes = 0;
  MemoryCategory category = MemoryCategory::kScratch;
  MemoryTracker* tracker = nullptr;
  DeviceAllocator* allocator = nullptr;
  CudaStream stream = nullptr;
  void operator()(void* data) const noexcept;
};
}  // namespace detail

// One owning block of device memory, charged to tracker under category while it lives. Move-only;
// freed on the stream it was allocated on. Contents are uninitialized.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(size_t bytes, MemoryCategory category, MemoryTracker& tracker, CudaStream stream,
               DeviceAllocator* allocator = nullptr);

  void* data() const { return block_.get(); }
  size_t size_bytes() const { return block_ ? block_.get_deleter().bytes : 0; }
  MemoryCategory category() const { return block_.get_deleter().category; }
  // A view of the first numel elements of dtype, on the device it was allocated on; throws if they
  // do not fit.
  TensorView view(DType dtype, const Shape& shape) const;

 private:
  std::unique_ptr<void, detail::DeviceBlockRelease> block_;
  int device_index_ = 0;
};

// Copies bytes between host and device (either direction, or device to device), ordered on stream.
void cuda_copy(void* dst, const void* src, size_t bytes, CudaStream stream);

// ----------------------------------------------------------------------------------------------
// Kernels (device pointers; n elements)
// ----------------------------------------------------------------------------------------------

// in: [n] f32; out: [n] bf16. Round to nearest even, NaN kept quiet: core.h's f32_to_bf16.
void cuda_convert_f32_to_bf16(const float* in, bf16_bits* out, int64_t n, CudaStream stream);
// in: [n] bf16; out: [n] f32 (exact).
void cuda_convert_bf16_to_f32(const bf16_bits* in, float* out, int64_t n, CudaStream stream);

// data [n] f32 or bf16, in place: x = x * factor (bf16 through f32, rounded once): the gradient
// scaling (1/dp, the clip's coefficient) on the device.
void cuda_scale(void* data, DType dtype, int64_t n, float factor, CudaStream stream);
// Zeroes bytes of device memory (zero_grad_buffer's pass).
void cuda_zero(void* data, size_t bytes, CudaStream stream);
// The NaN and Inf elements of data [n] (f32 or bf16), counted into *count_device (one int64 on the
// device, overwritten): core.h's all_finite(data) is a count of 0.
void cuda_count_nonfinite(const void* data, DType dtype, int64_t n, int64_t* count_device, CudaStream stream);
// The +0 and -0 elements of data [n] (f32 or bf16), ADDED to *count_device (one int64 on the device;
// zero it before the first of several runs): core.h's count_zeros(data).
void cuda_count_zeros(const void* data, DType dtype, int64_t n, int64_t* count_device, CudaStream stream);
// in/out main_grad [n] f32 += grad [n] (f32 or bf16): the post-accumulate-grad hook's add.
void cuda_accumulate(float* main_grad, const void* grad, DType grad_dtype, int64_t n, CudaStream stream);

// quant.h's mx_quantize / mx_dequantize on device views (same shapes, dtypes and options; the
// views' device must be CUDA). Bit-exact with the CPU's.
void cuda_mx_quantize(const TensorView& input, TensorView data, TensorView scales, const QuantizeOptions& options,
                      CudaStream stream);
void cuda_mx_dequantize(const TensorView& data, const TensorView& scales, TensorView output,
                        const QuantizeOptions& options, CudaStream stream);
// quant.h's mx_shard_scales / mx_shard_encode (FSDP's MXFP8 shards) on device views, bit-exact
// with the CPU's.
void cuda_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, TensorView scales,
                          const QuantizeOptions& options, CudaStream stream);
void cuda_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                          TensorView data, const QuantizeOptions& options, CudaStream stream);

// One AdamW step over a shard of n elements, as the distributed optimizer's CPU step does
// (src/optim/adamw_kernel.h, bit-exact): in grad [n] (f32 or bf16, grad_dtype); in/out main,
// exp_avg, exp_avg_sq [n] f32; out param [n] (f32 or bf16, param_dtype; nullptr: not staged).
// The scalars are compute.h's.
void cuda_adamw(const void* grad, DType grad_dtype, float* main, float* exp_avg, float* exp_avg_sq, void* param,
                DType param_dtype, int64_t n, const AdamWScalars& scalars, CudaStream stream);

// SGD with momentum, as the CPU's: in grad [n]; in/out main, momentum [n] f32; out param [n].
void cuda_sgd(const void* grad, DType grad_dtype, float* main, float* momentum, void* param, DType param_dtype,
              int64_t n, const SgdScalars& scalars, CudaStream stream);

// The sum of squares of grad [n] (f32 or bf16) in f64, in a fixed order (the same result on every
// run, stream and device): out_device is [kCudaSumOfSquaresNumel] doubles on the device (the
// per-block partials after the first), and the sum lands in out_device[0]. It differs from the CPU's
// eight-lane sum (optim_kernel::sum_of_squares) only by the order of f64 additions.
inline constexpr int64_t kCudaSumOfSquaresNumel = 1025;
void cuda_sum_of_squares(const void* grad, DType grad_dtype, int64_t n, double* out_device, CudaStream stream);

// ----------------------------------------------------------------------------------------------
// compute.h's implementation on a device
// ----------------------------------------------------------------------------------------------

// The current device's Compute: its memory from device_allocator(), its work enqueued on stream
// (the kernels above); all_finite and sum_of_squares wait for their result on the host. Its reduce
// takes at most 64 inputs and 64 outputs (a local group's ranks on one device). One per
// rank (each rank its own stream), used by the rank's thread, except that its reduce, copy_to_many
// and synchronize, which keep no state of their own, may also run on the rank's communicator
// thread (the local backend's share of a collective) meanwhile.
std::unique_ptr<Compute> make_cuda_compute(CudaStream stream);

}  // namespace mxddp
