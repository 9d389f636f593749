// Shapes, tensor views and alignment math: small value types with checked arithmetic, because a
// silently wrapped element count becomes an out-of-bounds write three layers down.
#include <mxddp/core.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

namespace mxddp {

std::string to_string(Device device) {
  return device.is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", device.index);
}

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  MXDDP_CHECK(dims.size() <= static_cast<size_t>(kMaxDims),
              "a shape has at most {} dimensions; got {}", kMaxDims, dims.size());
  for (int64_t d : dims) {
    MXDDP_CHECK(d >= 0, "shape dimensions must be >= 0; got {}", d);
    dims_[static_cast<size_t>(ndim_++)] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) {
    const int64_t d = dims_[static_cast<size_t>(i)];
    MXDDP_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d,
                "shape {} has more elements than int64 holds", to_string());
    n *= d;
  }
  return n;
}

bool Shape::operator==(const Shape& other) const {
  if (ndim_ != other.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[static_cast<size_t>(i)] != other.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim_; ++i) s += fmt::format("{}{}", i ? ", " : "", dims_[static_cast<size_t>(i)]);
  return s + "]";
}

TensorView TensorView::slice(int64_t offset, int64_t count) const {
  const int64_t n = numel();
  MXDDP_CHECK(offset >= 0 && count >= 0 && offset <= n && count <= n - offset,
              "slice [{}, {}) is outside the {} elements of {}", offset, offset + count, n, to_string());
  char* base = static_cast<char*>(data) + static_cast<size_t>(offset) * dtype_size_bytes(dtype);
  return TensorView{base, dtype, Shape{count}, device};
}

bool all_finite(const TensorView& v) {
  const auto n = static_cast<size_t>(v.numel());
  if (v.dtype == DType::kF32) {
    const float* x = v.data_as<const float>();
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(x[i])) return false;
    return true;
  }
  MXDDP_CHECK(v.dtype == DType::kBF16, "all_finite takes f32 or bf16; got {}", v.to_string());
  const bf16_bits* x = v.data_as<const bf16_bits>();
  for (size_t i = 0; i < n; ++i)
    if ((x[i] & 0x7f80u) == 0x7f80u) return false;  // exponent all ones: Inf or NaN
  return true;
}

int64_t count_zeros(const TensorView& v) {
  const auto n = static_cast<size_t>(v.numel());
  int64_t zeros = 0;
  if (v.dtype == DType::kF32) {
    const float* x = v.data_as<const float>();
    for (size_t i = 0; i < n; ++i) zeros += (std::bit_cast<uint32_t>(x[i]) & 0x7fffffffu) == 0;
    return zeros;
  }
  MXDDP_CHECK(v.dtype == DType::kBF16, "count_zeros takes f32 or bf16; got {}", v.to_string());
  const bf16_bits* x = v.data_as<const bf16_bits>();
  for (size_t i = 0; i < n; ++i) zeros += (x[i] & 0x7fffu) == 0;
  return zeros;
}

std::string TensorView::to_string() const {
  return fmt::format("{}{} on {}", dtype_name(dtype), shape.to_string(), mxddp::to_string(device));
}

int64_t round_up(int64_t value, int64_t multiple) {
  MXDDP_CHECK(multiple > 0, "round_up needs a positive multiple; got {}", multiple);
  MXDDP_CHECK(value >= 0, "round_up needs a non-negative value; got {}", value);
  const int64_t rem = value % multiple;
  if (rem == 0) return value;
  MXDDP_CHECK(value <= std::numeric_limits<int64_t>::max() - (multiple - rem),
              "round_up({}, {}) overflows int64", value, multiple);
  return value + (multiple - rem);
}

int64_t lcm(int64_t a, int64_t b) {
  MXDDP_CHECK(a > 0 && b > 0, "lcm needs positive arguments; got {} and {}", a, b);
  const int64_t g = std::gcd(a, b);
  MXDDP_CHECK(a / g <= std::numeric_limits<int64_t>::max() / b, "lcm({}, {}) overflows int64", a, b);
  return a / g * b;
}

}  // namespace mxddp
