// mxddp core: the vocabulary every other layer speaks.
//
// Owns: element types (DType) and their scalar conversions (round-to-nearest-even), the Device a
// tensor lives on, the non-owning TensorView, mxddp::Error with the check macros that carry
// file:line up to the user, and the integer alignment math the buffer layout is built from.
// Nothing here allocates or communicates.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include <mxddp/host_device.h>

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Errors
// ----------------------------------------------------------------------------------------------

// Thrown for anything a user can cause (bad config, bad file, a rank that never arrives) and for
// violated invariants. The message names the bad value and what would be valid; where() is the
// "file:line" of the check that fired.
class Error : public std::runtime_error {
 public:
  Error(std::string message, std::string where);
  const std::string& where() const noexcept { return where_; }
  // The message without the location prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
  std::string where_;
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, std::string message);
}  // namespace detail

}  // namespace mxddp

// MXDDP_CHECK(cond, fmt, args...): throws mxddp::Error("file:line: <formatted message>") when cond
// is false. The message should name the offending value and the valid range.
#define MXDDP_CHECK(cond, ...)                                                  \
  do {                                                                          \
    if (!(cond)) [[unlikely]]                                                   \
      ::mxddp::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
  } while (0)

// MXDDP_FAIL(fmt, args...): unconditional MXDDP_CHECK(false, ...).
#define MXDDP_FAIL(...) ::mxddp::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

// MXDDP_ASSERT(cond): an internal invariant; a failure is a bug in mxddp, never the user's input.
// It throws (library code never exits) so the caller still gets a chance to report it.
#define MXDDP_ASSERT(cond)                                                                   \
  do {                                                                                       \
    if (!(cond)) [[unlikely]]                                                                \
      ::mxddp::detail::throw_error(__FILE__, __LINE__, "internal invariant violated: " #cond); \
  } while (0)

namespace mxddp {

// ----------------------------------------------------------------------------------------------
// Element types
// ----------------------------------------------------------------------------------------------

enum class DType : uint8_t {
  kF32,   // IEEE binary32
  kBF16,  // bfloat16: binary32's top 16 bits
  kF16,   // IEEE binary16
  kE4M3,  // OCP FP8 E4M3 (bias 7, max 448, no Inf, S.1111.111 = NaN)
  kE5M2,  // OCP FP8 E5M2 (bias 15, max 57344, IEEE-like)
  kE8M0,  // OCP MX scale: an unsigned biased exponent (bias 127, 0xFF = NaN)
  kU8,    // raw bytes
  // What torch users reduce besides floats (counts, metrics, flags); collectives only. Appended so
  // the values above, which call headers and files carry as numbers, keep their meaning.
  kF64,   // IEEE binary64
  kI64,   // two's-complement int64
  kI32,   // two's-complement int32
  kBool,  // one byte, 0 or 1 (torch.bool); a nonzero byte reads as true
};
inline constexpr std::array<DType, 11> kAllDTypes = {DType::kF32,  DType::kBF16, DType::kF16, DType::kE4M3,
                                                     DType::kE5M2, DType::kE8M0, DType::kU8,  DType::kF64,
                                                     DType::kI64,  DType::kI32,  DType::kBool};

size_t dtype_size_bytes(DType dtype);
// "f32", "bf16", "f16", "e4m3", "e5m2", "e8m0", "u8", "f64", "i64", "i32", "bool".
std::string_view dtype_name(DType dtype);
// Inverse of dtype_name; throws Error naming the string and the valid names.
DType parse_dtype(std::string_view name);

// How a reduction combines its inputs (the collectives', comm.h, and their kernels', compute.h).
// avg is refused for the integer types and bool, as torch refuses it for them.
enum class ReduceOp : uint8_t {
  kSum,  // f32: summed in f32; bf16: summed in f32, rounded once; f64: in f64; u8, i32 and i64
         // wrap modulo 2^bits; bool: logical or (a flag set on any rank)
  kAvg,  // sum / size: f32 and bf16 in f32, f64 in f64; floats only
  kMax,  // floats: NaN wins (a NaN on any rank gives NaN); bool: logical or
};
std::string_view reduce_op_name(ReduceOp op);  // "sum", "avg", "max"

// Scalar conversions (bf16_bits, f32_to_bf16, bf16_to_f32) are in host_device.h, shared with the
// CUDA kernels.
using f16_bits = uint16_t;

float f16_to_f32(f16_bits h);
f16_bits f32_to_f16(float f);

// Bulk conversions over contiguous arrays (the hot loops of casts between buffers).
void convert_bf16_to_f32(const bf16_bits* in, float* out, size_t n);
void convert_f32_to_bf16(const float* in, bf16_bits* out, size_t n);

// ----------------------------------------------------------------------------------------------
// Devices and tensor views
// ----------------------------------------------------------------------------------------------

struct Device {
  enum class Kind : uint8_t { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {}; }
  static Device cuda(int index) { return {Kind::kCuda, index}; }
  bool is_cpu() const { return kind == Kind::kCpu; }
  bool operator==(const Device&) const = default;
};
std::string to_string(Device device);  // "cpu", "cuda:0"

// A shape of at most kMaxDims dimensions, stored inline so views never allocate.
class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  // Dimensions read from a file or another library; the same checks (at most kMaxDims, each >= 0).
  explicit Shape(std::span<const int64_t> dims);

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  bool operator==(const Shape& other) const;
  std::string to_string() const;  // "[95, 95]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

// A non-owning, contiguous (row-major) view: where the bytes are, what they hold, and where they
// live. Copying a view never copies data; the owner must outlive every view of it.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Device device;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size_bytes(dtype); }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data); }

  // A 1-D view of `count` elements starting `offset` elements in; throws when out of range.
  TensorView slice(int64_t offset, int64_t count) const;
  // A 1-D view of the same bytes.
  TensorView flat() const { return TensorView{data, dtype, Shape{numel()}, device}; }
  std::string to_string() const;  // "bf16[95, 95] on cpu"
};

// True when no element of an f32 or bf16 view is NaN or Inf (the gradient checks' question).
bool all_finite(const TensorView& v);
// The elements of an f32 or bf16 view that are +0 or -0, by their bits (a denormal is not zero,
// whatever the CPU's flush-to-zero mode): Megatron's count of zeros in the gradients.
int64_t count_zeros(const TensorView& v);

// ----------------------------------------------------------------------------------------------
// Alignment math (elements or bytes, the caller's choice of unit)
// ----------------------------------------------------------------------------------------------

// Overflow-checked arithmetic for sizes computed from user input (shapes, element and byte
// counts): signed overflow is undefined behaviour and unsigned wrap-around gives a wrong, small
// size, so both throw an Error naming `what` (e.g. "--shape 4294967296x4294967296 in bytes") and
// the operands. Every such computation goes through these two.
int64_t checked_mul(int64_t a, int64_t b, std::string_view what);
int64_t checked_add(int64_t a, int64_t b, std::string_view what);

// The smallest multiple of `multiple` that is >= value; throws on overflow or a zero multiple.
int64_t round_up(int64_t value, int64_t multiple);
// Least common multiple of positive values; throws on overflow or a non-positive argument.
int64_t lcm(int64_t a, int64_t b);
inline bool is_aligned(const void* ptr, size_t alignment_bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % alignment_bytes == 0;
}

}  // namespace mxddp
