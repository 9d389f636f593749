// mxddp quant: the MXFP8 codec (OCP Microscaling Formats v1.0).
//
// A block of 32 consecutive elements shares one E8M0 scale (an unbiased power-of-two exponent
// X stored as X + 127; 0xFF is NaN). Each element is stored as FP8, E4M3 or E5M2, of x / 2^X,
// rounded to nearest (ties to even) and saturated to the format's largest finite value.
//   row-wise:    blocks of 1x32 along the last dimension; scales [M, ceil(N/32)]
//   column-wise: blocks of 32x1 along the first dimension; scales [ceil(M/32), N]
// Element data stays in the [M, N] row-major layout either way. Dimensions that are not
// multiples of 32 end in a partial block, scaled by its own elements.
//
// Scale modes:
//   rceil (default): X = ceil(log2(amax / max_elem)), the smallest power of two that fits the
//          block's largest element: no element saturates. TransformerEngine and cuBLAS use it.
//   floor: the spec's X = floor(log2(amax)) - emax_elem; up to the top binade of a block may
//          saturate to max_elem.
// Outcomes for special blocks: all zeros (or -0) -> scale byte 0 and zero elements; a NaN or
// Inf anywhere -> scale byte 0xFF, so the whole block dequantizes to NaN (a corrupted weight
// must be visible, never silently saturated); X is clamped to E8M0's range [-127, 127], so a
// block of f32 subnormals gets byte 0 and keeps what the elements can hold.
#pragma once

#include <cstdint>

#include <mxddp/core.h>
#include <mxddp/memory.h>

namespace mxddp {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };
enum class ScaleMode : uint8_t { kRceil, kFloor };
enum class QuantAxis : uint8_t { kRow, kCol };

std::string_view fp8_format_name(Fp8Format f);  // "e4m3", "e5m2"
std::string_view scale_mode_name(ScaleMode m);  // "rceil", "floor"
Fp8Format parse_fp8_format(std::string_view name);
ScaleMode parse_scale_mode(std::string_view name);
QuantAxis parse_quant_axis(std::string_view name);  // "row", "col"
std::string_view quant_axis_name(QuantAxis a);      // "row", "col"

inline constexpr int kMxBlockSize = 32;
inline constexpr uint8_t kE8M0Nan = 0xFF;

// ---- Elements ----
float fp8_max(Fp8Format f);  // 448 or 57344
// x rounded to nearest even and saturated to +-max; NaN -> the format's NaN code (sign kept).
uint8_t f32_to_fp8(float x, Fp8Format f);
float fp8_to_f32(uint8_t code, Fp8Format f);

// ---- Scales ----
// The E8M0 byte for a block whose largest magnitude is amax (NaN or Inf -> 0xFF, 0 -> 0).
uint8_t mx_scale_for_amax(float amax, Fp8Format f, ScaleMode m);
float e8m0_to_f32(uint8_t scale);  // 2^(scale - 127); NaN for 0xFF

// ---- Tensors ----
struct QuantizeOptions {
  Fp8Format elem = Fp8Format::kE4M3;
  ScaleMode scale_mode = ScaleMode::kRceil;
  QuantAxis axis = QuantAxis::kRow;
};

// Shape of the scale tensor for an [M, N] input.
Shape mx_scale_shape(int64_t rows, int64_t cols, QuantAxis axis);

// input  /*in*/:  f32 or bf16 [M, N]
// data   /*out*/: u8 [M, N]
// scales /*out*/: u8 mx_scale_shape(M, N, axis)
// Large inputs are split across the machine's cores.
void mx_quantize(const TensorView& input, TensorView data, TensorView scales, const QuantizeOptions& options);
// output /*out*/: f32 or bf16 [M, N] (exact: every MXFP8 value is representable in both).
void mx_dequantize(const TensorView& data, const TensorView& scales, TensorView output, const QuantizeOptions& options);

// ---- Shards: quantizing a tensor whose elements are split across ranks (FSDP's MXFP8 params) ----
// A shard is the flat elements [offset, offset + n) of a row-major [M, N] tensor; its boundaries
// need not fall on blocks, so a block may straddle two ranks. The scale is nondecreasing in the
// block's amax (and NaN/Inf give 0xFF, the largest byte), so the element-wise MAX over the ranks of
// each rank's mx_shard_scales is exactly mx_quantize's scales; with those, mx_shard_encode gives
// exactly mx_quantize's data for the shard's elements. Between the two: a u8 MAX all-reduce of
// the scales (TransformerEngine's master-weight cast shares amaxes the same way).
// shard  /*in*/:  f32 or bf16 [n]
// scales /*out*/: u8 mx_scale_shape(M, N, axis) (any shape of that numel): each block's scale
//                 from the shard's elements of it; 0 for a block the shard does not touch.
void mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, TensorView scales,
                     const QuantizeOptions& options);
// scales /*in*/:  u8 mx_scale_shape(M, N, axis): the whole tensor's scales.
// data   /*out*/: u8 [n]: the shard's elements, encoded.
void mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                     TensorView data, const QuantizeOptions& options);

// One orientation of an MXFP8 [M, N] tensor, as a model reads it (a view: it owns nothing).
struct Mxfp8View {
  TensorView data;    // u8 [M, N]
  TensorView scales;  // u8 mx_scale_shape(M, N, options.axis)
  QuantizeOptions options;
};

// MXFP8 storage of one [M, N] weight in both orientations: row-wise for forward GEMMs,
// column-wise for the data-gradient GEMM of backward. All bytes are charged as kMxfp8.
class Mxfp8Tensor {
 public:
  Mxfp8Tensor(int64_t rows, int64_t cols, Fp8Format elem, ScaleMode scale_mode, MemoryTracker& tracker);
  // Quantizes input (f32 or bf16 [M, N]) into both orientations.
  void quantize_from(const TensorView& input);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  QuantizeOptions options(QuantAxis axis) const { return {elem_, scale_mode_, axis}; }
  TensorView data(QuantAxis axis) const;    // u8 [M, N]
  TensorView scales(QuantAxis axis) const;  // u8 mx_scale_shape(M, N, axis)
  Mxfp8View view(QuantAxis axis) const;

 private:
  int64_t rows_, cols_;
  Fp8Format elem_;
  ScaleMode scale_mode_;
  HostBuffer row_data_, row_scales_, col_data_, col_scales_;
};

}  // namespace mxddp
