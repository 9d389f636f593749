// The memory-plan tests' comparison of a planned MemoryUsage with a measured one: every category's
// live and peak bytes and the totals, each named, so a mismatch says which; in all and per place
// (host, device).
#pragma once

#include <string>

#include <gtest/gtest.h>

#include <mxddp/memory.h>

namespace mxddp::testing {

inline void expect_same_amounts(const MemoryAmounts& planned, const MemoryAmounts& measured, const std::string& what) {
  for (int k = 0; k < kNumMemoryCategories; ++k) {
    const auto c = static_cast<MemoryCategory>(k);
    EXPECT_EQ(planned.live(c), measured.live(c)) << what << ": live " << memory_category_name(c);
    EXPECT_EQ(planned.peak(c), measured.peak(c)) << what << ": peak " << memory_category_name(c);
  }
  EXPECT_EQ(planned.total_live_bytes, measured.total_live_bytes) << what << ": live total";
  EXPECT_EQ(planned.total_peak_bytes, measured.total_peak_bytes) << what << ": peak total";
}

inline void expect_same_usage(const MemoryUsage& planned, const MemoryUsage& measured, const std::string& what) {
  expect_same_amounts(planned, measured, what);
  for (MemoryPlace place : {MemoryPlace::kHost, MemoryPlace::kDevice})
    expect_same_amounts(planned.at(place), measured.at(place), what + " (" + std::string(memory_place_name(place)) + ")");
}

}  // namespace mxddp::testing
