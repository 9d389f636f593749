// mxddp config fields: one description of each config's fields, from which the command line, the
// training report and the checkpoint manifest are derived (so that a field cannot reach one of
// them and miss another).
//
// Owns: ConfigField (a field's name, command-line flags, help text, member and accepted range),
// FieldEnum (the names of an enum-valued field), FieldValue (a field's value as the report and the
// manifest write it) and for_each_field. The descriptions themselves live beside their configs:
// describe_fields(std::type_identity<DdpConfig>) in ddp.h, ...<FsdpConfig> in fsdp.h,
// ...<OptimizerConfig> in optim.h, ...<GptConfig> in model.h. Each returns a std::tuple of
// ConfigField, in declaration order, except that DdpConfig's and FsdpConfig's begin with the
// fields they share, described once in data_parallel_fields.h.
//
// Adding a field to a described config: add the member, then one ConfigField line to its
// describe_fields(); the flag, the report and the manifest follow, and config_fields_test fails
// until every described field reaches all three.
#pragma once

#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <mxddp/core.h>
#include <mxddp/quant.h>

namespace mxddp {

// The values a numeric field accepts where it is typed (a command-line flag): [lo, hi], either
// end open. An infinite end stands for the limit of the member's type (for a float, the largest
// finite float: a value must stay finite once stored).
struct FieldRange {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool open_low = false;
  bool open_high = false;
};
inline constexpr FieldRange kAnyValue{};
inline constexpr FieldRange kNonNegative{.lo = 0};
inline constexpr FieldRange kPositive{.lo = 1};  // integers

// One field of Config, of type T.
template <typename Config, typename T>
struct ConfigField {
  using config_type = Config;
  using value_type = T;
  // snake_case, Megatron's name: the key in the report's and the manifest's config sections.
  std::string_view name;
  // The command-line spellings, CLI11 style: Megatron's first, then aliases
  // ("--bucket-size,--ddp-bucket-size"). "" when the command sets the field itself (it is derived
  // from other flags or fixed) rather than taking it from a flag of its own; it is still reported.
  std::string_view flags;
  std::string_view help;
  T Config::*member;
  FieldRange range = kAnyValue;  // numeric fields with a flag

  T& of(Config& config) const { return config.*member; }
  const T& of(const Config& config) const { return config.*member; }
  bool has_flag() const { return !flags.empty(); }
};

// The names of an enum that a config field holds: specialize with
//   static std::string_view name(E);            // what reports and manifests write
//   static E parse(std::string_view);           // the inverse; throws Error naming the value and the valid ones
//   static std::vector<std::string> names();    // every valid name, in order
template <typename E>
struct FieldEnum;

template <>
struct FieldEnum<Fp8Format> {
  static std::string_view name(Fp8Format f) { return fp8_format_name(f); }
  static Fp8Format parse(std::string_view s) { return parse_fp8_format(s); }
  static std::vector<std::string> names() { return {"e4m3", "e5m2"}; }
};
template <>
struct FieldEnum<ScaleMode> {
  static std::string_view name(ScaleMode m) { return scale_mode_name(m); }
  static ScaleMode parse(std::string_view s) { return parse_scale_mode(s); }
  static std::vector<std::string> names() { return {"rceil", "floor"}; }
};
template <>
struct FieldEnum<DType> {
  static std::string_view name(DType d) { return dtype_name(d); }
  static DType parse(std::string_view s) { return parse_dtype(s); }
  static std::vector<std::string> names() {
    std::vector<std::string> out;
    for (DType d : kAllDTypes) out.emplace_back(dtype_name(d));
    return out;
  }
};

template <typename E>
concept NamedEnum = std::is_enum_v<E> && requires(E e) {
  { FieldEnum<E>::name(e) } -> std::convertible_to<std::string_view>;
};

// A field's value as the report and the manifest write it: null (an unset optional), a bool, an
// integer, a real (a float widened to double, exactly) or a name (an enum).
using FieldValue = std::variant<std::nullptr_t, bool, int64_t, double, std::string>;

template <typename T>
inline constexpr bool kIsOptional = false;
template <typename T>
inline constexpr bool kIsOptional<std::optional<T>> = true;

template <typename T>
FieldValue field_value(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value;
  } else if constexpr (NamedEnum<T>) {
    return std::string(FieldEnum<T>::name(value));
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<int64_t>(value);
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<double>(value);
  } else if constexpr (kIsOptional<T>) {
    return value ? field_value(*value) : FieldValue(nullptr);
  } else {
    static_assert(sizeof(T) == 0, "a config field of a type FieldValue cannot hold");
  }
}

// The description of Config's fields: a std::tuple of ConfigField<Config, ...>.
template <typename Config>
constexpr auto config_fields() {
  return describe_fields(std::type_identity<Config>{});
}

// Calls visit(field) for every described field of Config, in order.
template <typename Config, typename Visitor>
constexpr void for_each_field(Visitor&& visit) {
  std::apply([&](const auto&... field) { (visit(field), ...); }, config_fields<Config>());
}

// Calls visit(field, value) for every described field of config, value being a reference to the
// member (const when config is).
template <typename Config, typename Visitor>
constexpr void for_each_field(Config& config, Visitor&& visit) {
  using Plain = std::remove_const_t<Config>;
  for_each_field<Plain>([&](const auto& field) { visit(field, config.*field.member); });
}

// Every described field of config as (name, value), in order.
template <typename Config>
std::vector<std::pair<std::string_view, FieldValue>> field_values(const Config& config) {
  std::vector<std::pair<std::string_view, FieldValue>> out;
  for_each_field(config, [&](const auto& field, const auto& value) { out.emplace_back(field.name, field_value(value)); });
  return out;
}

}  // namespace mxddp
