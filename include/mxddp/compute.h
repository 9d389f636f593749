// mxddp compute: the element work a rank does on its own buffers, behind one small interface per
// place of memory (ggml's backend idea), so that the code paths above it (the param and grad
// buffers, DDP's zeroing and NaN check, the MXFP8 copies of fp8_param_gather, FSDP's storage,
// gathers and shard quantization, the distributed optimizer's step, and the local backend's
// collectives) are written once and run on host memory or on a device's.
//
// Owns:
//   - Compute, the interface: allocate a rank's memory (charged to a MemoryTracker), zero, copy,
//     the f32 <-> bf16 casts, the NaN/Inf test, the grad norm's sum of squares, the AdamW and
//     SGD updates of one contiguous run of a shard, MXFP8 quantization, and the collectives'
//     data movement (the reduction of several ranks' buffers, one source copied to several),
//     which the local backend (comm.h) runs on its ranks' memory, host or device;
//   - cpu_compute(), the host's implementation: the CPU kernels every device kernel is tested
//     against, spread over the rank's threads so that results do not depend on the thread count;
//   - the scalars of one AdamW or SGD step (AdamWScalars, SgdScalars), shared with mxddp/cuda.h;
//   - the GlobalMemoryBuffer: a pool of named scratch tensors in a rank's memory (host or device),
//     whose storage is reused across steps instead of reallocated.
// The CUDA implementation is mxddp/cuda.h's make_cuda_compute(); tests/compute/compute_test.cc runs
// every operation on every implementation this process can use against cpu_compute().
//
// Ordering: an implementation may only enqueue work (a device's stream); an operation that returns
// a value (all_finite, sum_of_squares) waits for the work before it, and synchronize() waits for all.
// Pointers and views given to an implementation must be in its memory (device() says where).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <mxddp/core.h>
#include <mxddp/memory.h>
#include <mxddp/quant.h>

namespace mxddp {

// One AdamW step's scalars for a run of elements (torch's AdamW, Megatron's decoupled decay):
// weight_decay is the decoupled decay, l2 torch Adam's decay added to the grad.
struct AdamWScalars {
  float lr = 1e-3f, weight_decay = 0.0f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float step_size = 1e-3f;             // lr / (1 - beta1^step)
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^step)
  float clip_coeff = 1.0f;             // the factor the grads are scaled by (unscale, clip); 1: none
  float l2 = 0.0f;
};

// SGD with momentum (torch's): weight_decay is added to the grad.
struct SgdScalars {
  float lr = 1e-3f, weight_decay = 0.0f, momentum = 0.0f, clip_coeff = 1.0f;
};

// What one optimizer update reads and writes, over one contiguous run of n elements of a shard:
//   grads  in      [n] f32 or bf16
//   main   in/out  [n] f32 (the master params)
//   state0 in/out  [n] f32 (exp_avg, or SGD's momentum buffer)
//   state1 in/out  [n] f32 (exp_avg_sq; null for SGD)
//   params out     [n] f32 or bf16, the updated values staged for the all-gather; data null: not
//                  staged (MXFP8 reuse quantizes later). May be main itself only when f32 (then it
//                  is not written twice).
struct ShardUpdate {
  TensorView grads;
  float* main = nullptr;
  float* state0 = nullptr;
  float* state1 = nullptr;
  TensorView params;
};

// One reduction of a collective over n_inputs buffers of this implementation's memory (the local
// backend's all_reduce and reduce_scatter, across its ranks' buffers), for every i < count:
//   outputs[j][i] = op(inputs[0][i], ..., inputs[n_inputs - 1][i])   for every output j
// combined in input order, as core.h's ReduceOp defines for each dtype (f32, bf16, f64, u8, i32,
// i64, bool), so that the result is the same bits on every implementation. With prescale != 1 (sum
// and avg of floats) every input is multiplied by it as it is loaded.
//   inputs  in   [n_inputs] pointers, each [count] elements of dtype
//   outputs out  [n_outputs] pointers, each [count]; each may be exactly an input, no other overlap
struct ReduceRun {
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  float prescale = 1.0f;
  int64_t count = 0;
  std::span<const void* const> inputs;
  std::span<void* const> outputs;
};

// A block of one implementation's memory, charged to a tracker while it lives (a HostBuffer, or a
// DeviceBuffer). Move-only.
class ComputeBuffer {
 public:
  ComputeBuffer() = default;
  // owner keeps the block alive and frees it (and its charge) when the last reference goes.
  ComputeBuffer(std::shared_ptr<void> owner, void* data, size_t bytes, Device device)
      : owner_(std::move(owner)), data_(data), bytes_(bytes), device_(device) {}
  ComputeBuffer(ComputeBuffer&&) noexcept = default;
  ComputeBuffer& operator=(ComputeBuffer&&) noexcept = default;
  ComputeBuffer(const ComputeBuffer&) = delete;
  ComputeBuffer& operator=(const ComputeBuffer&) = delete;

  void* data() const { return data_; }
  size_t size_bytes() const { return bytes_; }
  Device device() const { return device_; }
  // A view of the first shape.numel() elements of dtype; throws if they do not fit.
  TensorView view(DType dtype, const Shape& shape) const;

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

// A point in one Compute's order of work (Compute::record_event): a CUDA event on a device's
// stream; on the host, whose work is done when each call returns, a point already reached.
class ComputeEvent {
 public:
  virtual ~ComputeEvent() = default;
  // Waits on the calling thread until the work enqueued before the event is done; throws an Error
  // naming a failure of that work.
  virtual void wait() = 0;
};

// One validated entry point per operation (NCCL's rule): each checks its arguments (sizes, dtypes,
// null pointers, views on another device) and throws an Error naming what is wrong, then calls its
// implementation's run_* below, which may assume them checked.
class Compute {
 public:
  virtual ~Compute() = default;
  virtual std::string_view name() const = 0;  // "cpu", "cuda"
  virtual Device device() const = 0;          // where its memory is
  virtual MemoryPlace place() const = 0;      // how the tracker counts it

  // bytes of this implementation's memory, charged to tracker under category; zeroed.
  // With zeroed false the contents are undefined: for a buffer the caller overwrites whole before
  // reading it (an all-gather's output), which saves a pass over its bytes.
  ComputeBuffer allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed = true);
  // bytes of host memory that this implementation copies to and from at its full speed (page-locked
  // for a device; ordinary memory for the host's), charged to tracker under category at the host's
  // place; zeroed unless zeroed is false. A copy_from_host out of it may still be reading it when it
  // returns: synchronize() before writing it again. The staging of collectives between processes.
  ComputeBuffer allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed = true);
  void zero(void* data, size_t bytes);
  // Within this implementation's memory; the ranges must not overlap.
  void copy(void* dst, const void* src, size_t bytes);
  // Between host memory and this implementation's: a checkpoint's reads and writes, a test's
  // inputs, a staged collective's. copy_to_host waits until host holds the bytes; copy_from_host has
  // read ordinary host memory when it returns (not memory of allocate_host: see there).
  void copy_from_host(void* dst, const void* host, size_t bytes);
  void copy_to_host(void* host, const void* src, size_t bytes);
  // copy_to_host into memory of allocate_host, only enqueued: the bytes are there once an event
  // recorded after it has been waited for. A staged collective copies its input in the caller's
  // order of work this way, without waiting for the work enqueued after it.
  void copy_to_host_async(void* host, const void* src, size_t bytes);
  // An event after everything enqueued so far (see ComputeEvent).
  std::unique_ptr<ComputeEvent> record_event();
  // out = in: the same number of elements, f32 -> bf16 (round to nearest even, NaN kept quiet),
  // bf16 -> f32 (exact), or a copy when the dtypes match.
  void convert(const TensorView& in, const TensorView& out);
  // Whether every element of data (f32 or bf16) is finite. Waits.
  bool all_finite(const TensorView& data);
  // The sum of the squares of every element of runs (each f32 or bf16) in f64, in an order fixed by
  // the runs' sizes alone (the same result on every run and at any thread count); implementations
  // differ only in that order. The grad norm's local part. Waits.
  double sum_of_squares(std::span<const TensorView> runs);
  // The elements of runs (each f32 or bf16) that are +0 or -0 (core.h's count_zeros): the count of
  // zeros in the grads that Megatron logs. Waits.
  int64_t count_zeros(std::span<const TensorView> runs);
  void adamw(const ShardUpdate& shard, const AdamWScalars& scalars);
  void sgd(const ShardUpdate& shard, const SgdScalars& scalars);
  // quant.h's mx_quantize into one orientation of an MXFP8 tensor in this memory (a model's MXFP8
  // copy of a gathered param), the same bits on every implementation:
  //   input     in   [M, N] f32 or bf16
  //   out.data  out  [M, N] u8; out.scales out: mx_scale_shape(M, N, out.options.axis) u8
  void mx_quantize(const TensorView& input, const Mxfp8View& out);
  // quant.h's shard codec (FSDP's MXFP8 shards), the same bits on every implementation:
  //   shard  in   [n] f32 or bf16: the flat elements [offset, offset + n) of an [M, N] tensor
  //   scales out (mx_shard_scales) / in (mx_shard_encode): u8, mx_scale_shape(M, N, options.axis)'s
  //          numel, the whole tensor's
  //   data   out  [n] u8
  void mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                       const QuantizeOptions& options);
  void mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                       const TensorView& data, const QuantizeOptions& options);
  // The collectives' two data movements: a reduction (ReduceRun), and dsts[j][0, bytes) = src[0,
  // bytes) for every destination (a gather's or broadcast's push; none may overlap src or another).
  void reduce(const ReduceRun& run);
  void copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes);
  // Waits for everything enqueued; throws an Error naming the failure of any of it.
  virtual void synchronize() = 0;

 protected:
  // The implementation's side, called with checked arguments (byte counts > 0 for the copies).
  virtual ComputeBuffer run_allocate(size_t bytes, MemoryCategory category, MemoryTracker& tracker, bool zeroed) = 0;
  virtual ComputeBuffer run_allocate_host(size_t bytes, MemoryCategory category, MemoryTracker& tracker,
                                          bool zeroed) = 0;
  virtual void run_zero(void* data, size_t bytes) = 0;
  virtual void run_copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void run_copy_from_host(void* dst, const void* host, size_t bytes) = 0;
  virtual void run_copy_to_host(void* host, const void* src, size_t bytes) = 0;
  virtual void run_copy_to_host_async(void* host, const void* src, size_t bytes) = 0;
  virtual std::unique_ptr<ComputeEvent> run_record_event() = 0;
  virtual void run_convert(const TensorView& in, const TensorView& out) = 0;  // of different dtypes, n > 0
  virtual bool run_all_finite(const TensorView& data) = 0;
  virtual double run_sum_of_squares(std::span<const TensorView> runs) = 0;
  virtual int64_t run_count_zeros(std::span<const TensorView> runs) = 0;  // at least one run
  virtual void run_adamw(const ShardUpdate& shard, const AdamWScalars& scalars) = 0;
  virtual void run_sgd(const ShardUpdate& shard, const SgdScalars& scalars) = 0;
  virtual void run_mx_quantize(const TensorView& input, const Mxfp8View& out) = 0;  // M, N > 0
  virtual void run_mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape,
                                   const TensorView& scales, const QuantizeOptions& options) = 0;  // M, N > 0
  virtual void run_mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape,
                                   const TensorView& scales, const TensorView& data,
                                   const QuantizeOptions& options) = 0;  // n > 0
  virtual void run_reduce(const ReduceRun& run) = 0;  // count > 0
  virtual void run_copy_to_many(const void* src, std::span<void* const> dsts, size_t bytes) = 0;  // bytes > 0
};

// The host's implementation (one per process; thread-safe: it holds no state).
Compute& cpu_compute();

// ----------------------------------------------------------------------------------------------
// The global memory buffer (Megatron's name): a rank's scratch tensors
// ----------------------------------------------------------------------------------------------

struct GlobalMemoryBufferOptions {
  // When a request exceeds a key's capacity: false grows to max(request, 2 x old capacity) so a
  // slowly growing request costs O(log n) reallocations; true grows to exactly the request.
  bool grow_exact = false;
  // Where the storage lives: the rank's compute (on a device, its memory, allocated through the
  // device allocator on the compute's stream). Null: host memory, cpu_compute(). It must outlive
  // the pool.
  Compute* compute = nullptr;
};

// A pool of scratch tensors keyed by (name, dtype), so that a training step in steady state
// allocates nothing. get_tensor returns a view of the key's storage (on the compute's device): the
// same pointer for every request that fits the capacity, new storage (the old views dangle) when
// it grows. Contents are never zeroed. All bytes are charged as kScratch, at the compute's place.
//
// Threading rule: the map is guarded by a mutex, but the pooled storage is shared by name: keep one
// pool per rank (the local backend runs ranks as threads), and within a rank do not hand the same
// (name, dtype) to two users that are live at once.
class GlobalMemoryBuffer {
 public:
  explicit GlobalMemoryBuffer(MemoryTracker& tracker, GlobalMemoryBufferOptions options = {});

  TensorView get_tensor(const Shape& shape, DType dtype, const std::string& name);

  Compute& compute() const { return compute_; }
  // Capacity of a key in elements (0 if never requested).
  int64_t capacity_numel(const std::string& name, DType dtype) const;
  int64_t total_bytes() const;
  // Number of (re)allocations since construction: a steady-state step should add none.
  int64_t allocation_count() const;

 private:
  MemoryTracker& tracker_;
  GlobalMemoryBufferOptions options_;
  Compute& compute_;
  mutable std::mutex mutex_;  // guards pool_ and allocation_count_
  std::map<std::pair<std::string, DType>, ComputeBuffer> pool_;
  int64_t allocation_count_ = 0;
};

}  // namespace mxddp
