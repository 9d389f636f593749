// Flag checks: see cli_checks.h.
#include "cli_checks.h"

#include <charconv>
#include <cmath>
#include <limits>

namespace mxddp::app {

namespace {

// Parses the whole of text as a decimal integer of type T; nullopt-like false on any deviation
// (from_chars takes no '+', spaces or base prefix, and reports out-of-range instead of clamping).
template <typename T>
bool parse_decimal(std::string_view text, T& value) {
  if (text.empty()) return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 10);
  return ec == std::errc() && end == text.data() + text.size();
}

template <typename T>
std::string integer_problem(std::string& text, T lo, T hi) {
  T value{};
  if (!parse_decimal(text, value) || value < lo || value > hi)
    return fmt::format("'{}' is not valid: give an integer in [{}, {}]", text, lo, hi);
  text = std::to_string(value);  // canonical: no leading zeros CLI11 would read as octal
  return {};
}

}  // namespace

int64_t parse_integer(std::string_view text, std::string_view what, int64_t lo, int64_t hi) {
  int64_t value = 0;
  MXDDP_CHECK(parse_decimal(text, value) && value >= lo && value <= hi,
              "{} '{}' is not valid: give an integer in [{}, {}]", what, text, lo, hi);
  return value;
}

void check_no_empty_arguments(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.empty()) {
      const std::string_view before = i > 1 ? argv[i - 1] : "";
      MXDDP_CHECK(!before.starts_with("-"), "{}: '' is not valid: give a value (an empty one names nothing)", before);
      MXDDP_FAIL("argument {} is empty (''): no argument of mxddp is empty; remove it", i);
    }
    const size_t eq = arg.find('=');
    MXDDP_CHECK(!(arg.starts_with("--") && eq != std::string_view::npos && eq + 1 == arg.size()),
                "argument {} '{}' has an empty value after '=': give a value, or write the flag alone for an on/off "
                "flag", i, arg);
  }
}

std::vector<std::string> split_keeping_empty(std::string_view text, char sep) {
  std::vector<std::string> fields(1);
  for (char ch : text) {
    if (ch == sep) fields.emplace_back();
    else fields.back() += ch;
  }
  return fields;
}

std::vector<Shape> parse_shape_list(const std::string& shapes) {
  MXDDP_CHECK(!shapes.empty(), "--shapes is empty; give e.g. 95x95,95");
  std::vector<Shape> parsed;
  for (const std::string& item : split_keeping_empty(shapes, ',')) {
    const std::vector<std::string> fields = split_keeping_empty(item, 'x');
    MXDDP_CHECK(!item.empty() && fields.size() <= static_cast<size_t>(Shape::kMaxDims),
                "--shapes '{}': shape '{}' is not valid: give 1 to {} positive dimensions joined by 'x', like 95x95",
                shapes, item, Shape::kMaxDims);
    std::vector<int64_t> dims;
    for (const std::string& dim : fields)
      dims.push_back(parse_integer(dim, fmt::format("--shapes '{}': dimension of shape '{}'", shapes, item), 1,
                                   std::numeric_limits<int64_t>::max()));
    Shape shape;
    switch (dims.size()) {
      case 1: shape = Shape{dims[0]}; break;
      case 2: shape = Shape{dims[0], dims[1]}; break;
      case 3: shape = Shape{dims[0], dims[1], dims[2]}; break;
      case 4: shape = Shape{dims[0], dims[1], dims[2], dims[3]}; break;
      case 5: shape = Shape{dims[0], dims[1], dims[2], dims[3], dims[4]}; break;
      default: shape = Shape{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5]}; break;
    }
    static_cast<void>(shape.numel());  // throws, naming the shape, when its element count overflows
    parsed.push_back(shape);
  }
  return parsed;
}

std::pair<int64_t, int64_t> parse_matrix_shape(const std::string& text) {
  const std::vector<std::string> dims = split_keeping_empty(text, 'x');
  MXDDP_CHECK(dims.size() == 2, "--shape '{}' is not valid: give MxN with positive M and N (e.g. 4096x1024)", text);
  const std::string what = fmt::format("--shape '{}': dimension", text);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return {parse_integer(dims[0], what, 1, kMax), parse_integer(dims[1], what, 1, kMax)};
}

CLI::Validator integer_in(int64_t lo, int64_t hi) {
  return CLI::Validator([lo, hi](std::string& text) { return integer_problem(text, lo, hi); },
                        fmt::format("[{}, {}]", lo, hi));
}

CLI::Validator unsigned_in(uint64_t lo, uint64_t hi) {
  return CLI::Validator([lo, hi](std::string& text) { return integer_problem(text, lo, hi); },
                        fmt::format("[{}, {}]", lo, hi));
}

CLI::Validator real_in(double lo, double hi, Storage storage, Ends ends) {
  const std::string range = fmt::format("{}{}, {}{}", ends == Ends::kOpenLow ? "(" : "[", lo, hi,
                                        ends == Ends::kOpenHigh ? ")" : "]");
  const char* type = storage == Storage::kFloat ? "a finite 32-bit float" : "a finite number";
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const std::string problem = fmt::format("'{}' is not valid: give {} in {}", text, type, range);
        double value = 0;
        // from_chars takes no hex floats or leading spaces; it does parse "inf" and "nan", which
        // the finiteness check refuses.
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return problem;
        const double stored = storage == Storage::kFloat ? static_cast<double>(static_cast<float>(value)) : value;
        if (!std::isfinite(stored)) return problem;
        const bool low_ok = ends == Ends::kOpenLow ? stored > lo : stored >= lo;
        const bool high_ok = ends == Ends::kOpenHigh ? stored < hi : stored <= hi;
        if (!low_ok || !high_ok) return problem;
        text = fmt::format("{}", value);  // shortest text that reads back as exactly this double
        return {};
      },
      range);
}

CLI::Validator non_empty_path() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "'' is not valid: give a path (an empty one names nothing)" : "";
      },
      "not empty");
}

}  // namespace mxddp::app
