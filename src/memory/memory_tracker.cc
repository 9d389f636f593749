// MemoryTracker: lock-free live/peak counters per category, for every place together and for the
// host and the device apart. Peaks are raised with a CAS loop so concurrent charges from a rank's
// compute and progress threads never lose a maximum.
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

std::string_view memory_place_name(MemoryPlace place) {
  switch (place) {
    case MemoryPlace::kHost: return "host";
    case MemoryPlace::kDevice: return "device";
  }
  MXDDP_FAIL("unknown memory place {}", static_cast<int>(place));
}

namespace {
void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

size_t place_index(MemoryPlace place) {
  const auto p = static_cast<size_t>(place);
  MXDDP_CHECK(p < kNumMemoryPlaces, "memory place {} is not one of host (0) or device (1)", p);
  return p;
}
}  // namespace

void MemoryTracker::Counters::add(size_t category, int64_t bytes) {
  raise_to(peak[category], live[category].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_to(total_peak, total_live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}

void MemoryTracker::Counters::subtract(size_t category, int64_t bytes) {
  const int64_t before = live[category].fetch_sub(bytes, std::memory_order_relaxed);
  total_live.fetch_sub(bytes, std::memory_order_relaxed);
  MXDDP_ASSERT(before >= bytes);
}

MemoryAmounts MemoryTracker::Counters::read() const {
  MemoryAmounts a;
  for (size_t c = 0; c < kNumMemoryCategories; ++c) {
    a.live_bytes[c] = live[c].load(std::memory_order_relaxed);
    a.peak_bytes[c] = peak[c].load(std::memory_order_relaxed);
  }
  a.total_live_bytes = total_live.load(std::memory_order_relaxed);
  a.total_peak_bytes = total_peak.load(std::memory_order_relaxed);
  return a;
}

void MemoryTracker::Counters::reset_peaks() {
  for (size_t c = 0; c < kNumMemoryCategories; ++c)
    peak[c].store(live[c].load(std::memory_order_relaxed), std::memory_order_relaxed);
  total_peak.store(total_live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void MemoryTracker::on_allocate(MemoryCategory category, int64_t bytes, MemoryPlace place) {
  const auto c = static_cast<size_t>(category);
  by_place_[place_index(place)].add(c, bytes);
  all_.add(c, bytes);
}

void MemoryTracker::on_free(MemoryCategory category, int64_t bytes, MemoryPlace place) {
  const auto c = static_cast<size_t>(category);
  by_place_[place_index(place)].subtract(c, bytes);
  all_.subtract(c, bytes);
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

namespace {
MemoryAmounts max_peaks_of(const MemoryAmounts& earlier, const MemoryAmounts& later) {
  MemoryAmounts m = later;
  for (size_t c = 0; c < m.peak_bytes.size(); ++c) m.peak_bytes[c] = std::max(earlier.peak_bytes[c], later.peak_bytes[c]);
  m.total_peak_bytes = std::max(earlier.total_peak_bytes, later.total_peak_bytes);
  return m;
}
}  // namespace

MemoryUsage max_peaks(const MemoryUsage& earlier, const MemoryUsage& later) {
  MemoryUsage m;
  static_cast<MemoryAmounts&>(m) = max_peaks_of(earlier, later);
  for (size_t p = 0; p < kNumMemoryPlaces; ++p) m.by_place[p] = max_peaks_of(earlier.by_place[p], later.by_place[p]);
  return m;
}

MemoryUsage MemoryTracker::usage() const {
  MemoryUsage u;
  static_cast<MemoryAmounts&>(u) = all_.read();
  for (size_t p = 0; p < kNumMemoryPlaces; ++p) u.by_place[p] = by_place_[p].read();
  return u;
}

void MemoryTracker::reset_peaks() {
  all_.reset_peaks();
  for (Counters& c : by_place_) c.reset_peaks();
}

std::string MemoryTracker::summary() const {
  const MemoryUsage u = usage();
  const MemoryAmounts& device = u.at(MemoryPlace::kDevice);
  const MemoryAmounts& host = u.at(MemoryPlace::kHost);
  if (device.total_peak_bytes == 0) {  // a host-only run: one pair of columns
    std::string s = fmt::format("{:<16} {:>14} {:>14}\n", "category", "live_bytes", "peak_bytes");
    for (size_t c = 0; c < kNumMemoryCategories; ++c)
      s += fmt::format("{:<16} {:>14} {:>14}\n", memory_category_name(static_cast<MemoryCategory>(c)), u.live_bytes[c],
                       u.peak_bytes[c]);
    return s + fmt::format("{:<16} {:>14} {:>14}\n", "total", u.total_live_bytes, u.total_peak_bytes);
  }
  std::string s = fmt::format("{:<16} {:>14} {:>14} {:>14} {:>14}\n", "category", "device_live", "device_peak",
                              "host_live", "host_peak");
  for (size_t c = 0; c < kNumMemoryCategories; ++c)
    s += fmt::format("{:<16} {:>14} {:>14} {:>14} {:>14}\n", memory_category_name(static_cast<MemoryCategory>(c)),
                     device.live_bytes[c], device.peak_bytes[c], host.live_bytes[c], host.peak_bytes[c]);
  return s + fmt::format("{:<16} {:>14} {:>14} {:>14} {:>14}\n", "total", device.total_live_bytes,
                         device.total_peak_bytes, host.total_live_bytes, host.total_peak_bytes);
}

}  // namespace mxddp
