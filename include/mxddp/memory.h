// mxddp memory: every byte the library holds, and who holds it.
//
// Owns: aligned host allocation (HostBuffer, an owning RAII block) and the MemoryTracker that every
// library allocation is charged to (live and peak bytes per category, per place: host or device).
// The global memory buffer, a pool of scratch tensors in a rank's memory, is compute.h's.
//
// Threading rule: a MemoryTracker may be charged from any thread (its counters are atomic).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <mxddp/core.h>

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Accounting
// ----------------------------------------------------------------------------------------------

enum class MemoryCategory : uint8_t {
  kParams,          // model params (BF16 param buffer)
  kGrads,           // grad buffer
  kMainParams,      // FP32 master shards of the distributed optimizer
  kOptimizerState,  // Adam moments, momentum
  kMxfp8,           // MXFP8 param storage (data and scales)
  kScratch,         // the global memory buffer
  kComm,            // communication staging (e.g. f32 accumulation of a bf16 collective)
  kGathered,        // FSDP's transient unsharded params and grads, live only around their unit's use
};
inline constexpr int kNumMemoryCategories = 8;
std::string_view memory_category_name(MemoryCategory category);  // "params", "grads", ...

// Where tracked bytes live: host memory (HostBuffer) or a device's (DeviceBuffer, mxddp/cuda.h).
enum class MemoryPlace : uint8_t { kHost, kDevice };
inline constexpr int kNumMemoryPlaces = 2;
std::string_view memory_place_name(MemoryPlace place);  // "host", "device"

// Live and peak bytes per category, and of their sum.
struct MemoryAmounts {
  std::array<int64_t, kNumMemoryCategories> live_bytes{};
  std::array<int64_t, kNumMemoryCategories> peak_bytes{};
  int64_t total_live_bytes = 0;
  int64_t total_peak_bytes = 0;  // peak of the sum, not the sum of per-category peaks

  int64_t live(MemoryCategory c) const { return live_bytes[static_cast<size_t>(c)]; }
  int64_t peak(MemoryCategory c) const { return peak_bytes[static_cast<size_t>(c)]; }
};

// A tracker's figures: every place together (the base, what a CPU run's reports show) and each
// place's own, whose peaks are their own (a device's peak need not fall when the host's does).
struct MemoryUsage : MemoryAmounts {
  std::array<MemoryAmounts, kNumMemoryPlaces> by_place{};

  const MemoryAmounts& at(MemoryPlace place) const { return by_place[static_cast<size_t>(place)]; }
};

// "512 B", "3.1 GiB", "1010 TiB", "1200 PiB": binary units, the one a reader expects for the size.
std::string format_bytes(double bytes);

// Two consecutive periods as one: the later one's live bytes, the larger of each peak.
MemoryUsage max_peaks(const MemoryUsage& earlier, const MemoryUsage& later);

// Live and peak bytes per category for one rank, in all and per place. Thread-safe; never
// allocates.
class MemoryTracker {
 public:
  void on_allocate(MemoryCategory category, int64_t bytes, MemoryPlace place);
  void on_free(MemoryCategory category, int64_t bytes, MemoryPlace place);
  // At the category's default place: the host, unless set_default_place said otherwise (a plan's
  // tracker puts a data-parallel object's state where its buffers would live).
  void on_allocate(MemoryCategory category, int64_t bytes) { on_allocate(category, bytes, default_place(category)); }
  void on_free(MemoryCategory category, int64_t bytes) { on_free(category, bytes, default_place(category)); }
  // Call before any charge of the category (not thread-safe against those).
  void set_default_place(MemoryCategory category, MemoryPlace place) {
    default_place_[static_cast<size_t>(category)] = place;
  }
  MemoryPlace default_place(MemoryCategory category) const { return default_place_[static_cast<size_t>(category)]; }
  MemoryUsage usage() const;
  // Restarts peak tracking from the current live bytes (e.g. to measure a steady state).
  void reset_peaks();
  // A one-line-per-category table, for reports and logs; with a device and a host column each
  // once device bytes were charged.
  std::string summary() const;

 private:
  struct Counters {
    std::array<std::atomic<int64_t>, kNumMemoryCategories> live{};
    std::array<std::atomic<int64_t>, kNumMemoryCategories> peak{};
    std::atomic<int64_t> total_live{0};
    std::atomic<int64_t> total_peak{0};

    void add(size_t category, int64_t bytes);
    void subtract(size_t category, int64_t bytes);
    MemoryAmounts read() const;
    void reset_peaks();
  };
  Counters all_;
  std::array<Counters, kNumMemoryPlaces> by_place_;
  std::array<MemoryPlace, kNumMemoryCategories> default_place_{};  // all kHost
};

// ----------------------------------------------------------------------------------------------
// Host allocation
// ----------------------------------------------------------------------------------------------

// What a failed allocation throws: a std::bad_alloc, so every handler of one still applies, whose
// what() names the request: "out of memory: could not allocate 1073741824 bytes for params". The
// text is formatted into the object itself, since there may be no memory left for a string.
class OutOfMemory : public std::bad_alloc {
 public:
  // what_for: what the bytes were for (a memory category's name); empty when unknown.
  explicit OutOfMemory(size_t bytes, std::string_view what_for = {}) noexcept;
  const char* what() const noexcept override { return message_; }
  size_t bytes() const noexcept { return bytes_; }

 private:
  size_t bytes_ = 0;
  char message_[128] = {};
};

// The address-space limit (ulimit -v, RLIMIT_AS) and what this process has mapped already: the
// limit counts every mapping (libraries, thread stacks, malloc's reserved arenas), not only
// allocated bytes. nullopt when unlimited.
struct AddressSpace {
  double limit_bytes = 0;
  double mapped_bytes = 0;
};
std::optional<AddressSpace> address_space_limit();

// Hands the pages of the heap's free blocks back to the system: glibc's malloc_trim(0); elsewhere
// nothing, and false. Why: glibc returns freed heap memory only from the heap's top, so the holes a
// training step's freed activations leave stay resident until the process ends, and the next step's
// peak comes on top of them (issue 44: 1.2 GiB of them per rank on a small GPT-2). Later allocations
// there fault the pages back in. Returns whether any memory was released; costs a walk of the free
// lists and an madvise per free block (70 ms for 1.2 GiB).
bool release_free_heap_pages() noexcept;

// Alignment of every host allocation: a cache line, and the vector width of AVX-512 loads.
inline constexpr size_t kHostAlignmentBytes = 64;

// One owning, aligned, tracked block of host memory. Move-only; frees (and un-charges) itself.
// Contents are uninitialized. Throws OutOfMemory, naming the bytes and the category, when the
// allocation fails.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(size_t bytes, MemoryCategory category, MemoryTracker& tracker);
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return data_; }
  size_t size_bytes() const { return bytes_; }
  MemoryCategory category() const { return category_; }
  // A view of the first numel elements of dtype; throws if they do not fit.
  TensorView view(DType dtype, const Shape& shape) const;

 private:
  void release() noexcept;

  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::kScratch;
  MemoryTracker* tracker_ = nullptr;
};

}  // namespace mxddp
