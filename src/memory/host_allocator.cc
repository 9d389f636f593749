// HostBuffer: the one place host memory is allocated, so the tracker sees every byte; OutOfMemory,
// what an allocation that fails throws; the address-space limit allocations run into; and handing
// the heap's free pages back to the system.
#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>

#include <mxddp/memory.h>

namespace mxddp {

OutOfMemory::OutOfMemory(size_t bytes, std::string_view what_for) noexcept : bytes_(bytes) {
  std::snprintf(message_, sizeof(message_), "out of memory: could not allocate %zu bytes%s%.*s", bytes,
                what_for.empty() ? "" : " for ", static_cast<int>(what_for.size()), what_for.data());
}

std::optional<AddressSpace> address_space_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
  double pages = 0;  // /proc/self/statm's first field: the pages mapped, what the limit counts
  std::ifstream("/proc/self/statm") >> pages;
  return AddressSpace{static_cast<double>(limit.rlim_cur), pages * static_cast<double>(::sysconf(_SC_PAGESIZE))};
}

bool release_free_heap_pages() noexcept {
#if defined(__GLIBC__)
  return ::malloc_trim(0) != 0;
#else
  return false;
#endif
}

HostBuffer::HostBuffer(size_t bytes, MemoryCategory category, MemoryTracker& tracker)
    : bytes_(bytes), category_(category), tracker_(&tracker) {
  if (bytes == 0) return;
  // aligned_alloc wants a size that is a multiple of the alignment.
  const size_t padded = static_cast<size_t>(round_up(static_cast<int64_t>(bytes), kHostAlignmentBytes));
  data_ = std::aligned_alloc(kHostAlignmentBytes, padded);
  if (data_ == nullptr) throw OutOfMemory(bytes, memory_category_name(category));
  tracker_->on_allocate(category_, static_cast<int64_t>(bytes_), MemoryPlace::kHost);
}

HostBuffer::~HostBuffer() { release(); }

HostBuffer::HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    category_ = other.category_;
    tracker_ = std::exchange(other.tracker_, nullptr);
  }
  return *this;
}

void HostBuffer::release() noexcept {
  if (data_ == nullptr) return;
  std::free(data_);
  tracker_->on_free(category_, static_cast<int64_t>(bytes_), MemoryPlace::kHost);
  data_ = nullptr;
  bytes_ = 0;
}

TensorView HostBuffer::view(DType dtype, const Shape& shape) const {
  const size_t need = static_cast<size_t>(shape.numel()) * dtype_size_bytes(dtype);
  MXDDP_CHECK(need <= bytes_, "a {} {} view needs {} bytes; the buffer holds {}", dtype_name(dtype),
              shape.to_string(), need, bytes_);
  return TensorView{data_, dtype, shape, Device::cpu()};
}

}  // namespace mxddp
