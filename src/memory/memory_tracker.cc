// MemoryTracker: lock-free live/peak counters per category, for every place together and for the
// host and the device apart. Peaks are raised with a CAS loop so concurrent charges from a rank's
// compute and progress threads never lose a maximum.
#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

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
  by_place_[static_cast<size_t>(place)].add(c, bytes);
  all_.add(c, bytes);
}

void MemoryTracker::on_free(MemoryCategory category, int64_t bytes, MemoryPlace place) {
  const auto c = static_cast<size_t>(category);
  by_place_[static_cast<size_t>(place)].subtract(c, bytes);
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
  // A host-only tracker has one pair of columns; once device bytes were charged, a pair per place.
  std::vector<std::pair<std::string_view, const MemoryAmounts*>> columns{{"", &u}};
  if (u.at(MemoryPlace::kDevice).total_peak_bytes > 0)
    columns = {{"device_", &u.at(MemoryPlace::kDevice)}, {"host_", &u.at(MemoryPlace::kHost)}};
  const size_t width = columns.size() == 1 ? 14 : 18;  // "device_live_bytes" needs 17
  std::string s = fmt::format("{:<16}", "category");
  for (const auto& [prefix, amounts] : columns)
    s += fmt::format(" {:>{}} {:>{}}", fmt::format("{}live_bytes", prefix), width, fmt::format("{}peak_bytes", prefix),
                     width);
  s += '\n';
  auto row = [&](std::string_view name, auto live, auto peak) {
    s += fmt::format("{:<16}", name);
    for (const auto& column : columns)
      s += fmt::format(" {:>{}} {:>{}}", live(*column.second), width, peak(*column.second), width);
    s += '\n';
  };
  for (size_t c = 0; c < kNumMemoryCategories; ++c)
    row(memory_category_name(static_cast<MemoryCategory>(c)), [c](const MemoryAmounts& a) { return a.live_bytes[c]; },
        [c](const MemoryAmounts& a) { return a.peak_bytes[c]; });
  row("total", [](const MemoryAmounts& a) { return a.total_live_bytes; },
      [](const MemoryAmounts& a) { return a.total_peak_bytes; });
  return s;
}

}  // namespace mxddp
