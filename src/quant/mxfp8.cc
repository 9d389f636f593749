// MXFP8 block quantization and dequantization over [M, N] tensors, row-wise and column-wise.
//
// Row-wise, each row's 32-element runs are contiguous: amax, scale, then encode each run.
// Column-wise, a block is 32 rows of one column; the loops run across the columns of a 32-row
// band (contiguous), keeping one amax per column, so both passes vectorize over N.
// Work is split across threads by rows (row-wise) or by 32-row bands (column-wise).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "fp8_codec.h"
#include "mxfp8_checks.h"

namespace mxddp {

namespace {

constexpr int64_t kParallelMinNumel = int64_t{1} << 18;

// Reads [rows, cols] input rows as f32: bf16 is widened into `scratch` one row at a time.
struct RowReader {
  const TensorView& in;
  std::vector<float> scratch;
  const float* row(int64_t r) {
    const int64_t cols = in.shape[1];
    if (in.dtype == DType::kF32) return in.data_as<const float>() + r * cols;
    convert_bf16_to_f32(in.data_as<const bf16_bits>() + r * cols, scratch.data(), static_cast<size_t>(cols));
    return scratch.data();
  }
};

// 1/2^X as a float (exact). X in [-127, 127]; 2^127 is the largest power of two f32 holds.
inline float inv_scale(uint8_t scale) { return fp8::e8m0_inverse(scale); }

// The bits of |x|: for non-negative floats integer order is float order, and NaN and Inf sort
// above every finite value, so an integer max (which vectorizes, unlike a float max under IEEE NaN
// rules) finds amax and spots specials at once.
inline uint32_t abs_bits(float x) { return std::bit_cast<uint32_t>(x) & 0x7fffffffu; }
constexpr uint32_t kInfBits = 0x7f800000u;
inline float amax_from_bits(uint32_t bits) { return bits >= kInfBits ? INFINITY : std::bit_cast<float>(bits); }

// amax over n values; NaN or Inf anywhere makes it Inf (the block's scale becomes NaN).
inline float block_amax(const float* x, int64_t n) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, abs_bits(x[i]));
  return amax_from_bits(amax);
}

// The element format is a template parameter so the encoder's constants fold and its loops
// vectorize (a Spec passed by reference is reloaded every iteration: the u8 stores may alias it).

// Encodes n values scaled by inv; a NaN-scaled block stores zeros (its scale alone says NaN).
template <Fp8Format F>
void encode_run(const float* __restrict x, int64_t n, float inv, bool nan_block, uint8_t* __restrict out) {
  if (nan_block) {
    std::memset(out, 0, static_cast<size_t>(n));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = fp8::encode(x[i] * inv, fp8::kSpec<F>);
}

template <Fp8Format F>
void quantize_rows(const TensorView& in, uint8_t* data, uint8_t* scales, const QuantizeOptions& o, int64_t r0, int64_t r1) {
  const int64_t cols = in.shape[1];
  const int64_t blocks = (cols + kMxBlockSize - 1) / kMxBlockSize;
  RowReader reader{in, std::vector<float>(in.dtype == DType::kF32 ? 0 : static_cast<size_t>(cols))};
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = reader.row(r);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kMxBlockSize, n = std::min<int64_t>(kMxBlockSize, cols - c0);
      const uint8_t scale = mx_scale_for_amax(block_amax(x + c0, n), o.elem, o.scale_mode);
      scales[r * blocks + b] = scale;
      encode_run<F>(x + c0, n, inv_scale(scale), scale == kE8M0Nan, data + r * cols + c0);
    }
  }
}

template <Fp8Format F>
void quantize_cols(const TensorView& in, uint8_t* data, uint8_t* scales, const QuantizeOptions& o, int64_t band0,
                   int64_t band1) {
  const int64_t rows = in.shape[0], cols = in.shape[1];
  std::vector<uint32_t> amax(static_cast<size_t>(cols));
  std::vector<float> inv(static_cast<size_t>(cols));
  std::vector<float> band(static_cast<size_t>(kMxBlockSize * cols));  // the band's rows as f32
  RowReader reader{in, std::vector<float>(in.dtype == DType::kF32 ? 0 : static_cast<size_t>(cols))};
  for (int64_t band_index = band0; band_index < band1; ++band_index) {
    const int64_t r0 = band_index * kMxBlockSize, n_rows = std::min<int64_t>(kMxBlockSize, rows - r0);
    std::fill(amax.begin(), amax.end(), 0u);
    for (int64_t k = 0; k < n_rows; ++k) {
      float* dst = band.data() + k * cols;
      std::memcpy(dst, reader.row(r0 + k), static_cast<size_t>(cols) * sizeof(float));
      for (int64_t c = 0; c < cols; ++c) amax[static_cast<size_t>(c)] = std::max(amax[static_cast<size_t>(c)], abs_bits(dst[c]));
    }
    uint8_t* scale_row = scales + band_index * cols;
    for (int64_t c = 0; c < cols; ++c) {
      scale_row[c] = mx_scale_for_amax(amax_from_bits(amax[static_cast<size_t>(c)]), o.elem, o.scale_mode);
      inv[static_cast<size_t>(c)] = scale_row[c] == kE8M0Nan ? 0.0f : inv_scale(scale_row[c]);
    }
    for (int64_t k = 0; k < n_rows; ++k) {
      const float* __restrict x = band.data() + k * cols;
      const float* __restrict inv_c = inv.data();
      uint8_t* __restrict out = data + (r0 + k) * cols;
      for (int64_t c = 0; c < cols; ++c) out[c] = fp8::encode(x[c] * inv_c[c], fp8::kSpec<F>);
      // A NaN-scaled column stores zeros: x * 0 is NaN for the NaN/Inf elements themselves.
      for (int64_t c = 0; c < cols; ++c)
        if (scale_row[c] == kE8M0Nan) out[c] = 0;
    }
  }
}

// Runs fn(begin, end) over [0, count) split across up to hardware_concurrency threads.
template <typename Fn>
void parallel_for(int64_t count, int64_t numel, Fn&& fn) {
  const auto hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const int64_t workers = numel < kParallelMinNumel ? 1 : std::min(hw, count);
  if (workers <= 1) return fn(int64_t{0}, count);
  std::vector<std::thread> threads;
  for (int64_t w = 1; w < workers; ++w)
    threads.emplace_back([&, w] { fn(count * w / workers, count * (w + 1) / workers); });
  fn(int64_t{0}, count / workers);
  for (auto& t : threads) t.join();
}


// The shard's elements, as f32 runs along rows: fn(row, col0, x [len], len, offset in the shard).
template <typename Fn>
void for_each_row_run(const TensorView& shard, int64_t offset, int64_t cols, Fn&& fn) {
  const int64_t n = shard.numel();
  std::vector<float> widened(shard.dtype == DType::kF32 ? 0 : static_cast<size_t>(std::min(cols, n)));
  for (int64_t i = 0; i < n;) {
    const int64_t at = offset + i, r = at / cols, c0 = at % cols, len = std::min(cols - c0, n - i);
    const float* x = shard.data_as<const float>() + (shard.dtype == DType::kF32 ? i : 0);
    if (shard.dtype != DType::kF32) {
      convert_bf16_to_f32(shard.data_as<const bf16_bits>() + i, widened.data(), static_cast<size_t>(len));
      x = widened.data();
    }
    fn(r, c0, x, len, i);
    i += len;
  }
}

// The scale index of element (r, c) of a [rows, cols] tensor.
inline int64_t scale_index(int64_t r, int64_t c, int64_t cols, QuantAxis axis) {
  return axis == QuantAxis::kRow ? r * ((cols + kMxBlockSize - 1) / kMxBlockSize) + c / kMxBlockSize
                                 : (r / kMxBlockSize) * cols + c;
}

template <Fp8Format F>
void encode_shard(const TensorView& shard, int64_t offset, int64_t cols, const uint8_t* scales, QuantAxis axis,
                  uint8_t* data) {
  for_each_row_run(shard, offset, cols, [&](int64_t r, int64_t c0, const float* x, int64_t len, int64_t at) {
    uint8_t* __restrict out = data + at;
    for (int64_t k = 0; k < len; ++k) {
      const uint8_t s = scales[scale_index(r, c0 + k, cols, axis)];
      out[k] = s == kE8M0Nan ? 0 : fp8::encode(x[k] * inv_scale(s), fp8::kSpec<F>);
    }
  });
}

}  // namespace

void check_mx_views(const TensorView& values, const TensorView& data, const TensorView& scales,
                    const QuantizeOptions& o, std::string_view op, Device::Kind device) {
  MXDDP_CHECK(values.shape.ndim() == 2, "{}: expects a 2-D [M, N] tensor; got {}", op, values.shape.to_string());
  MXDDP_CHECK(values.dtype == DType::kF32 || values.dtype == DType::kBF16, "{}: values must be f32 or bf16; got {}", op,
              dtype_name(values.dtype));
  const bool on_device = values.device.kind == device && data.device.kind == device && scales.device.kind == device;
  if (device == Device::Kind::kCpu) {
    MXDDP_CHECK(on_device, "{}: the codec runs on cpu tensors", op);
  } else {
    MXDDP_CHECK(on_device, "{}: the CUDA codec runs on cuda tensors; got values on {}, data on {}, scales on {}", op,
                to_string(values.device), to_string(data.device), to_string(scales.device));
  }
  MXDDP_CHECK(data.dtype == DType::kU8 && data.shape == values.shape, "{}: data must be u8 {}; got {}", op,
              values.shape.to_string(), data.to_string());
  const Shape want = mx_scale_shape(values.shape[0], values.shape[1], o.axis);
  MXDDP_CHECK(scales.dtype == DType::kU8 && scales.shape == want, "{}: scales must be u8 {} for {}-wise blocks; got {}",
              op, want.to_string(), o.axis == QuantAxis::kRow ? "row" : "column", scales.to_string());
}

void check_mx_shard(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                    const QuantizeOptions& o, std::string_view op) {
  MXDDP_CHECK(shape.ndim() == 2, "{}: the full tensor must be 2-D [M, N]; got {}", op, shape.to_string());
  MXDDP_CHECK(shard.dtype == DType::kF32 || shard.dtype == DType::kBF16, "{}: values must be f32 or bf16; got {}", op,
              dtype_name(shard.dtype));
  MXDDP_CHECK(offset >= 0 && shard.numel() <= shape.numel() - offset,
              "{}: a shard of {} elements at offset {} does not fit a {} tensor", op, shard.numel(), offset,
              shape.to_string());
  const Shape want = mx_scale_shape(shape[0], shape[1], o.axis);
  MXDDP_CHECK(scales.dtype == DType::kU8 && scales.numel() == want.numel(),
              "{}: scales must be u8 {} for {}-wise blocks; got {}", op, want.to_string(),
              o.axis == QuantAxis::kRow ? "row" : "column", scales.to_string());
}

Shape mx_scale_shape(int64_t rows, int64_t cols, QuantAxis axis) {
  const auto blocks = [](int64_t n) { return (n + kMxBlockSize - 1) / kMxBlockSize; };
  return axis == QuantAxis::kRow ? Shape{rows, blocks(cols)} : Shape{blocks(rows), cols};
}

void mx_quantize(const TensorView& input, TensorView data, TensorView scales, const QuantizeOptions& o) {
  check_mx_views(input, data, scales, o, "mx_quantize", Device::Kind::kCpu);
  auto* d = data.data_as<uint8_t>();
  auto* s = scales.data_as<uint8_t>();
  const bool e4m3 = o.elem == Fp8Format::kE4M3;
  if (o.axis == QuantAxis::kRow)
    parallel_for(input.shape[0], input.numel(), [&](int64_t a, int64_t b) {
      e4m3 ? quantize_rows<Fp8Format::kE4M3>(input, d, s, o, a, b) : quantize_rows<Fp8Format::kE5M2>(input, d, s, o, a, b);
    });
  else
    parallel_for(scales.shape[0], input.numel(), [&](int64_t a, int64_t b) {
      e4m3 ? quantize_cols<Fp8Format::kE4M3>(input, d, s, o, a, b) : quantize_cols<Fp8Format::kE5M2>(input, d, s, o, a, b);
    });
}

void mx_dequantize(const TensorView& data, const TensorView& scales, TensorView output, const QuantizeOptions& o) {
  check_mx_views(output, data, scales, o, "mx_dequantize", Device::Kind::kCpu);
  const int64_t rows = output.shape[0], cols = output.shape[1];
  const int64_t blocks = scales.shape[1];
  const auto* d = data.data_as<const uint8_t>();
  const auto* s = scales.data_as<const uint8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t scale = o.axis == QuantAxis::kRow ? s[r * blocks + c / kMxBlockSize] : s[(r / kMxBlockSize) * cols + c];
      const float v = fp8_to_f32(d[r * cols + c], o.elem) * e8m0_to_f32(scale);
      if (output.dtype == DType::kF32) output.data_as<float>()[r * cols + c] = v;
      else output.data_as<bf16_bits>()[r * cols + c] = f32_to_bf16(v);
    }
}

Mxfp8Tensor::Mxfp8Tensor(int64_t rows, int64_t cols, Fp8Format elem, ScaleMode scale_mode, MemoryTracker& tracker)
    : rows_(rows), cols_(cols), elem_(elem), scale_mode_(scale_mode) {
  MXDDP_CHECK(rows > 0 && cols > 0, "an MXFP8 tensor needs positive dimensions; got [{}, {}]", rows, cols);
  const auto numel = static_cast<size_t>(rows * cols);
  row_data_ = HostBuffer(numel, MemoryCategory::kMxfp8, tracker);
  col_data_ = HostBuffer(numel, MemoryCategory::kMxfp8, tracker);
  row_scales_ = HostBuffer(static_cast<size_t>(mx_scale_shape(rows, cols, QuantAxis::kRow).numel()), MemoryCategory::kMxfp8, tracker);
  col_scales_ = HostBuffer(static_cast<size_t>(mx_scale_shape(rows, cols, QuantAxis::kCol).numel()), MemoryCategory::kMxfp8, tracker);
}

TensorView Mxfp8Tensor::data(QuantAxis axis) const {
  return (axis == QuantAxis::kRow ? row_data_ : col_data_).view(DType::kU8, Shape{rows_, cols_});
}

TensorView Mxfp8Tensor::scales(QuantAxis axis) const {
  return (axis == QuantAxis::kRow ? row_scales_ : col_scales_).view(DType::kU8, mx_scale_shape(rows_, cols_, axis));
}

void Mxfp8Tensor::quantize_from(const TensorView& input) {
  for (QuantAxis axis : {QuantAxis::kRow, QuantAxis::kCol}) mx_quantize(input, data(axis), scales(axis), options(axis));
}

void mx_shard_scales(const TensorView& shard, int64_t offset, const Shape& shape, TensorView scales,
                     const QuantizeOptions& o) {
  check_mx_shard(shard, offset, shape, scales, o, "mx_shard_scales");
  const int64_t cols = shape[1];
  // Each block's amax over the shard's elements of it, as |x|'s bits (NaN and Inf sort above all).
  std::vector<uint32_t> amax(static_cast<size_t>(scales.numel()), 0u);
  for_each_row_run(shard, offset, cols, [&](int64_t r, int64_t c0, const float* x, int64_t len, int64_t) {
    for (int64_t k = 0; k < len; ++k) {
      uint32_t& a = amax[static_cast<size_t>(scale_index(r, c0 + k, cols, o.axis))];
      a = std::max(a, abs_bits(x[k]));
    }
  });
  auto* s = scales.data_as<uint8_t>();
  for (size_t k = 0; k < amax.size(); ++k) s[k] = mx_scale_for_amax(amax_from_bits(amax[k]), o.elem, o.scale_mode);
}

void mx_shard_encode(const TensorView& shard, int64_t offset, const Shape& shape, const TensorView& scales,
                     TensorView data, const QuantizeOptions& o) {
  check_mx_shard(shard, offset, shape, scales, o, "mx_shard_encode");
  MXDDP_CHECK(data.dtype == DType::kU8 && data.numel() == shard.numel(), "mx_shard_encode: data must be u8 [{}]; got {}",
              shard.numel(), data.to_string());
  const auto* s = scales.data_as<const uint8_t>();
  auto* d = data.data_as<uint8_t>();
  if (o.elem == Fp8Format::kE4M3) encode_shard<Fp8Format::kE4M3>(shard, offset, shape[1], s, o.axis, d);
  else encode_shard<Fp8Format::kE5M2>(shard, offset, shape[1], s, o.axis, d);
}

Mxfp8View Mxfp8Tensor::view(QuantAxis axis) const { return {data(axis), scales(axis), options(axis)}; }

}  // namespace mxddp
