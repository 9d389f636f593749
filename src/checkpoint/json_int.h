// Integers read from untrusted JSON (a manifest, a safetensors header). nlohmann's get<int64_t>()
// casts whatever number is there: 1e30 or 92233720368547758070 (a float to the parser) becomes
// undefined behaviour, 2^64 - 1 a negative value, 2^40 a truncated int. Every integer field goes
// through json_int instead, with the range its use allows.
#pragma once

#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include <mxddp/core.h>

namespace mxddp::ckpt {

// j as an integer in [min, max]; throws Error naming `what`, the value and the range otherwise
// (a float, a string, anything out of range).
inline int64_t json_int(const nlohmann::json& j, int64_t min, int64_t max, std::string_view what) {
  bool in_range = false;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const auto u = j.get<uint64_t>();
    in_range = u <= static_cast<uint64_t>(max) && static_cast<int64_t>(u) >= min;
    v = static_cast<int64_t>(u);
  } else if (j.is_number_integer()) {
    v = j.get<int64_t>();
    in_range = v >= min && v <= max;
  }
  MXDDP_CHECK(j.is_number_integer() && in_range, "{} is {}; expected an integer in [{}, {}]", what, j.dump(), min, max);
  return v;
}

}  // namespace mxddp::ckpt
