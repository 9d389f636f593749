// Fuzz target: the mxddp command's shape and list parsers and its numeric flag checks
// (apps/mxddp/cli_checks.cc), which see whatever a user types.
//
// The first byte picks the parser (its value mod 6; the seeds use '0'..'5'), the rest is the
// flag's text:
//   '0' parse_shape_list (layout --shapes)   '3' integer_in, bounds picked by the second byte
//   '1' parse_matrix_shape (quantize --shape) '4' unsigned_in (--seed), likewise
//   '2' split_keeping_empty at 'x' and ','   '5' real_in (float and double flags), likewise
// A parser either throws mxddp::Error (a validator returns its message instead) or returns a
// value that keeps its header's promise, checked below: shapes of 1 to 6 positive dimensions whose
// canonical text parses back to the same shapes, fields that join back to the text, and a
// validator's rewritten text that is in range and that the validator accepts unchanged. A crash,
// a sanitizer report, any other exception or a broken promise fails.
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.h"
#include "mxddp/cli_checks.h"

namespace {

using mxddp::Shape;
using namespace mxddp::app;

std::string shape_text(const Shape& s) {
  std::string t;
  for (int d = 0; d < s.ndim(); ++d) t += (d ? "x" : "") + std::to_string(s[d]);
  return t;
}

void check_shape_list(const std::string& text) {
  std::vector<Shape> shapes;
  try {
    shapes = parse_shape_list(text);
  } catch (const mxddp::Error&) {
    return;
  }
  size_t commas = 0;
  for (char c : text) commas += c == ',';
  MXDDP_FUZZ_ASSERT(shapes.size() == commas + 1, "'%s' gave %zu shapes", text.c_str(), shapes.size());
  std::string canonical;
  for (const Shape& s : shapes) {
    MXDDP_FUZZ_ASSERT(s.ndim() >= 1 && s.ndim() <= Shape::kMaxDims, "'%s' gave a %d-d shape", text.c_str(), s.ndim());
    for (int d = 0; d < s.ndim(); ++d) MXDDP_FUZZ_ASSERT(s[d] >= 1, "'%s' gave dimension %lld", text.c_str(), static_cast<long long>(s[d]));
    static_cast<void>(s.numel());  // accepted shapes have an element count that fits int64 (throws otherwise)
    canonical += (canonical.empty() ? "" : ",") + shape_text(s);
  }
  MXDDP_FUZZ_ASSERT(parse_shape_list(canonical) == shapes, "'%s' and its canonical text '%s' differ", text.c_str(),
                    canonical.c_str());
}

void check_matrix_shape(const std::string& text) {
  std::pair<int64_t, int64_t> rc;
  try {
    rc = parse_matrix_shape(text);
  } catch (const mxddp::Error&) {
    return;
  }
  MXDDP_FUZZ_ASSERT(rc.first >= 1 && rc.second >= 1, "'%s' gave %lldx%lld", text.c_str(),
                    static_cast<long long>(rc.first), static_cast<long long>(rc.second));
  const std::string canonical = std::to_string(rc.first) + "x" + std::to_string(rc.second);
  MXDDP_FUZZ_ASSERT(parse_matrix_shape(canonical) == rc, "'%s' and '%s' differ", text.c_str(), canonical.c_str());
}

void check_split(const std::string& text, char sep) {
  const std::vector<std::string> fields = split_keeping_empty(text, sep);
  size_t seps = 0;
  for (char c : text) seps += c == sep;
  MXDDP_FUZZ_ASSERT(fields.size() == seps + 1, "'%s' split into %zu fields", text.c_str(), fields.size());
  std::string joined;
  for (size_t i = 0; i < fields.size(); ++i) {
    MXDDP_FUZZ_ASSERT(fields[i].find(sep) == std::string::npos, "field '%s' holds the separator", fields[i].c_str());
    joined += (i ? std::string(1, sep) : "") + fields[i];
  }
  MXDDP_FUZZ_ASSERT(joined == text, "'%s' joins back as '%s'", text.c_str(), joined.c_str());
}

// A validator that accepts rewrites the text to its canonical form, which `in_range` must accept and
// the validator must accept again, unchanged.
template <typename InRange>
void check_validator(const CLI::Validator& v, const std::string& text, InRange in_range) {
  std::string value = text;
  if (!v(value).empty()) return;  // refused, with a message
  MXDDP_FUZZ_ASSERT(in_range(value), "'%s' was accepted as '%s', which is out of range", text.c_str(), value.c_str());
  std::string again = value;
  MXDDP_FUZZ_ASSERT(v(again).empty() && again == value, "'%s' was accepted as '%s', which reads back as '%s'",
                    text.c_str(), value.c_str(), again.c_str());
}

template <typename T>
bool parses_in(const std::string& s, T lo, T hi) {
  T x{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  return ec == std::errc() && end == s.data() + s.size() && x >= lo && x <= hi;
}

void check_integer(const std::string& text, uint8_t pick) {
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(), kMax = std::numeric_limits<int64_t>::max();
  const int64_t bounds[][2] = {{1, 65536}, {0, kMax}, {kMin, kMax}, {-5, 5}, {0, mxddp::app::kTimeoutMsMax}};
  const int64_t lo = bounds[pick % std::size(bounds)][0], hi = bounds[pick % std::size(bounds)][1];
  check_validator(integer_in(lo, hi), text, [&](const std::string& s) { return parses_in<int64_t>(s, lo, hi); });
}

void check_unsigned(const std::string& text, uint8_t pick) {
  const uint64_t bounds[][2] = {{0, std::numeric_limits<uint64_t>::max()}, {1, 1000}};
  const uint64_t lo = bounds[pick % std::size(bounds)][0], hi = bounds[pick % std::size(bounds)][1];
  check_validator(unsigned_in(lo, hi), text, [&](const std::string& s) { return parses_in<uint64_t>(s, lo, hi); });
}

void check_real(const std::string& text, uint8_t pick) {
  struct Range {
    double lo, hi;
    Storage storage;
    Ends ends;
  };
  const Range ranges[] = {{0.0, 1.0, Storage::kFloat, Ends::kOpenHigh},
                          {0.0, 1.0, Storage::kFloat, Ends::kOpenLow},
                          {0.0, 1e30, Storage::kDouble, Ends::kClosed},
                          {-1e300, 1e300, Storage::kDouble, Ends::kClosed},
                          {0.0, 3.4e38, Storage::kFloat, Ends::kClosed}};
  const Range& r = ranges[pick % std::size(ranges)];
  check_validator(real_in(r.lo, r.hi, r.storage, r.ends), text, [&](const std::string& s) {
    double x = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    if (ec != std::errc() || end != s.data() + s.size()) return false;
    const double stored = r.storage == Storage::kFloat ? static_cast<double>(static_cast<float>(x)) : x;
    return std::isfinite(stored) && (r.ends == Ends::kOpenLow ? stored > r.lo : stored >= r.lo) &&
           (r.ends == Ends::kOpenHigh ? stored < r.hi : stored <= r.hi);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t which = data[0] % 6;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // The validators take their bounds from the second byte and the flag's text from the rest.
  const uint8_t pick = size > 1 ? data[1] : 0;
  const std::string rest = size > 1 ? text.substr(1) : std::string();
  switch (which) {
    case 0: check_shape_list(text); break;
    case 1: check_matrix_shape(text); break;
    case 2:
      check_split(text, 'x');
      check_split(text, ',');
      break;
    case 3: check_integer(rest, pick); break;
    case 4: check_unsigned(rest, pick); break;
    default: check_real(rest, pick); break;
  }
  return 0;
}
