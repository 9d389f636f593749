// Shared by the benchmark programs: medians, wall-clock timing, and the single-thread memcpy
// bandwidth every figure is compared against (measured in the same run, on the same machine).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <mxddp/memory.h>

namespace mxddp::bench {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Bytes copied per second by one thread's memcpy of `bytes` (counting each byte once, as a
// collective's algorithm bandwidth does), median of `runs`.
inline double memcpy_bandwidth_bytes_per_s(size_t bytes, int runs = 7) {
  MemoryTracker tracker;
  HostBuffer src(bytes, MemoryCategory::kScratch, tracker), dst(bytes, MemoryCategory::kScratch, tracker);
  std::memset(src.data(), 1, bytes);
  std::memset(dst.data(), 0, bytes);
  std::vector<double> rates;
  for (int r = 0; r < runs; ++r) {
    const double t0 = now_s();
    std::memcpy(dst.data(), src.data(), bytes);
    rates.push_back(static_cast<double>(bytes) / (now_s() - t0));
  }
  return median(rates);
}

inline std::string mib(size_t bytes) { return fmt::format("{} MiB", bytes >> 20); }

// "2,4,8" -> {2, 4, 8} (a command-line list of sizes).
inline std::vector<int64_t> parse_int_list(const std::string& text) {
  std::vector<int64_t> v;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t comma = text.find(',', pos);
    v.push_back(std::stoll(text.substr(pos, comma - pos)));
    pos = comma == std::string::npos ? text.size() : comma + 1;
  }
  return v;
}

}  // namespace mxddp::bench
