// MemoryTracker: lock-free live/peak counters per category. Peaks are raised with a CAS loop so
// concurrent charges from a rank's compute and progress threads never lose a maximum.
#include <algorithm>
#include <iterator>

#include <mxddp/memory.h>

namespace mxddp {

std::string_view memory_category_name(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::kParams: return "params";
    case MemoryCategory::kGrads: return "grads";
    case MemoryCategory::kMainParams: return "main_params";
    case MemoryCategory::kOptimizerState: return "optimizer_state";
    case MemoryCategory::kMxfp8: return "mxfp8";
    case MemoryCategory::kScratch: return "scratch";
    case MemoryCategory::kComm: return "comm";
    case MemoryCategory::kGathered: return "gathered";
  }
  MXDDP_FAIL("unknown memory category {}", static_cast<int>(category));
}

namespace {
void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

void MemoryTracker::on_allocate(MemoryCategory category, int64_t bytes) {
  const auto c = static_cast<size_t>(category);
  raise_to(peak_[c], live_[c].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_to(total_peak_, total_live_.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}

void MemoryTracker::on_free(MemoryCategory category, int64_t bytes) {
  const auto c = static_cast<size_t>(category);
  const int64_t before = live_[c].fetch_sub(bytes, std::memory_order_relaxed);
  total_live_.fetch_sub(bytes, std::memory_order_relaxed);
  MXDDP_ASSERT(before >= bytes);
}

std::string format_bytes(double bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  size_t u = 0;
  while (bytes >= 1024.0 && u + 1 < std::size(kUnits)) {
    bytes /= 1024.0;
    ++u;
  }
  if (u == 0 || bytes >= 100) return fmt::format("{:.0f} {}", bytes, kUnits[u]);
  return fmt::format("{:.3g} {}", bytes, kUnits[u]);
}

MemoryUsage max_peaks(const MemoryUsage& earlier, const MemoryUsage& later) {
  MemoryUsage m = later;
  for (size_t c = 0; c < m.peak_bytes.size(); ++c) m.peak_bytes[c] = std::max(earlier.peak_bytes[c], later.peak_bytes[c]);
  m.total_peak_bytes = std::max(earlier.total_peak_bytes, later.total_peak_bytes);
  return m;
}

MemoryUsage MemoryTracker::usage() const {
  MemoryUsage u;
  for (size_t c = 0; c < kNumMemoryCategories; ++c) {
    u.live_bytes[c] = live_[c].load(std::memory_order_relaxed);
    u.peak_bytes[c] = peak_[c].load(std::memory_order_relaxed);
  }
  u.total_live_bytes = total_live_.load(std::memory_order_relaxed);
  u.total_peak_bytes = total_peak_.load(std::memory_order_relaxed);
  return u;
}

void MemoryTracker::reset_peaks() {
  for (size_t c = 0; c < kNumMemoryCategories; ++c)
    peak_[c].store(live_[c].load(std::memory_order_relaxed), std::memory_order_relaxed);
  total_peak_.store(total_live_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::string MemoryTracker::summary() const {
  const MemoryUsage u = usage();
  std::string s = fmt::format("{:<16} {:>14} {:>14}\n", "category", "live_bytes", "peak_bytes");
  for (size_t c = 0; c < kNumMemoryCategories; ++c)
    s += fmt::format("{:<16} {:>14} {:>14}\n", memory_category_name(static_cast<MemoryCategory>(c)),
                     u.live_bytes[c], u.peak_bytes[c]);
  s += fmt::format("{:<16} {:>14} {:>14}\n", "total", u.total_live_bytes, u.total_peak_bytes);
  return s;
}

}  // namespace mxddp
