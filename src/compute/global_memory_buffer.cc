// The global memory buffer (Megatron's name): named scratch tensors in a rank's memory (host, or
// its compute's device), reused across steps, so a training step in steady state allocates nothing.
#include <algorithm>

#include <mxddp/compute.h>

namespace mxddp {

GlobalMemoryBuffer::GlobalMemoryBuffer(MemoryTracker& tracker, GlobalMemoryBufferOptions options)
    : tracker_(tracker), options_(options), compute_(options.compute ? *options.compute : cpu_compute()) {}

TensorView GlobalMemoryBuffer::get_tensor(const Shape& shape, DType dtype, const std::string& name) {
  const int64_t numel = shape.numel();
  const size_t elem_bytes = dtype_size_bytes(dtype);
  std::lock_guard lock(mutex_);
  ComputeBuffer& storage = pool_[{name, dtype}];
  const auto capacity = static_cast<int64_t>(storage.size_bytes() / elem_bytes);
  if (numel > capacity) {
    const int64_t grown = options_.grow_exact ? numel : std::max(numel, 2 * capacity);
    const auto bytes = static_cast<size_t>(
        checked_mul(grown, static_cast<int64_t>(elem_bytes), fmt::format("scratch tensor '{}' in bytes", name)));
    // Free first, then allocate: the old contents are not kept (scratch is never preserved), and
    // the peak should not count both blocks. Not zeroed: scratch is written before it is read.
    storage = ComputeBuffer();
    storage = compute_.allocate(bytes, MemoryCategory::kScratch, tracker_, /*zeroed=*/false);
    ++allocation_count_;
  }
  return storage.view(dtype, shape);
}

int64_t GlobalMemoryBuffer::capacity_numel(const std::string& name, DType dtype) const {
  std::lock_guard lock(mutex_);
  auto it = pool_.find({name, dtype});
  return it == pool_.end() ? 0 : static_cast<int64_t>(it->second.size_bytes() / dtype_size_bytes(dtype));
}

int64_t GlobalMemoryBuffer::total_bytes() const {
  std::lock_guard lock(mutex_);
  int64_t total = 0;
  for (const auto& [key, storage] : pool_) total += static_cast<int64_t>(storage.size_bytes());
  return total;
}

int64_t GlobalMemoryBuffer::allocation_count() const {
  std::lock_guard lock(mutex_);
  return allocation_count_;
}

}  // namespace mxddp
