// reduce_arrays: see reduce.h. One f32 (or u32 for bytes) accumulator tile on the stack keeps the
// working set in L1 however many inputs there are.
#include "reduce.h"

#include <algorithm>
#include <cmath>

namespace mxddp {

namespace {

constexpr int64_t kTileNumel = 2048;  // 8 KiB of f32 accumulator

inline float max_nan(float acc, float x) { return (x > acc || x != x) ? x : acc; }

template <typename T>
inline float load_f32(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i];
  else return bf16_to_f32(p[i]);
}

template <typename T>
void reduce_float_tile(ReduceOp op, const void* const* inputs, int n_inputs, int64_t begin, int64_t n,
                       T* out, float prescale) {
  float acc[kTileNumel];
  const T* first = static_cast<const T*>(inputs[0]) + begin;
  for (int64_t i = 0; i < n; ++i) acc[i] = load_f32(first, i);
  if (prescale != 1.0f)
    for (int64_t i = 0; i < n; ++i) acc[i] *= prescale;
  for (int k = 1; k < n_inputs; ++k) {
    const T* in = static_cast<const T*>(inputs[k]) + begin;
    if (op == ReduceOp::kMax) {
      for (int64_t i = 0; i < n; ++i) acc[i] = max_nan(acc[i], load_f32(in, i));
    } else if (prescale == 1.0f) {
      for (int64_t i = 0; i < n; ++i) acc[i] += load_f32(in, i);
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] += load_f32(in, i) * prescale;
    }
  }
  if (op == ReduceOp::kAvg) {
    const auto divisor = static_cast<float>(n_inputs);
    for (int64_t i = 0; i < n; ++i) acc[i] /= divisor;
  }
  T* dst = out + begin;
  if constexpr (std::is_same_v<T, float>) {
    std::copy(acc, acc + n, dst);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(acc[i]);
  }
}

void reduce_u8_tile(ReduceOp op, const void* const* inputs, int n_inputs, int64_t begin, int64_t n,
                    uint8_t* out) {
  uint32_t acc[kTileNumel];
  const auto* first = static_cast<const uint8_t*>(inputs[0]) + begin;
  for (int64_t i = 0; i < n; ++i) acc[i] = first[i];
  for (int k = 1; k < n_inputs; ++k) {
    const auto* in = static_cast<const uint8_t*>(inputs[k]) + begin;
    if (op == ReduceOp::kMax) {
      for (int64_t i = 0; i < n; ++i) acc[i] = std::max<uint32_t>(acc[i], in[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) acc[i] += in[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) out[begin + i] = static_cast<uint8_t>(acc[i]);
}

}  // namespace

void reduce_arrays(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                   void* out, float prescale) {
  MXDDP_ASSERT(n_inputs >= 1);
  MXDDP_ASSERT(prescale == 1.0f || (op != ReduceOp::kMax && dtype != DType::kU8));
  for (int64_t begin = 0; begin < count; begin += kTileNumel) {
    const int64_t n = std::min(kTileNumel, count - begin);
    switch (dtype) {
      case DType::kF32:
        reduce_float_tile(op, inputs, n_inputs, begin, n, static_cast<float*>(out), prescale);
        break;
      case DType::kBF16:
        reduce_float_tile(op, inputs, n_inputs, begin, n, static_cast<bf16_bits*>(out), prescale);
        break;
      case DType::kU8:
        MXDDP_ASSERT(op != ReduceOp::kAvg);
        reduce_u8_tile(op, inputs, n_inputs, begin, n, static_cast<uint8_t*>(out));
        break;
      default:
        MXDDP_FAIL("reductions support f32, bf16 and u8; got {}", dtype_name(dtype));
    }
  }
}

void finish_in_place(float* buffer, int64_t count, ReduceOp op, int size, float prescale) {
  if (op == ReduceOp::kAvg) {
    const auto d = static_cast<float>(size);
    for (int64_t i = 0; i < count; ++i) buffer[i] /= d;
  }
  if (prescale != 1.0f)
    for (int64_t i = 0; i < count; ++i) buffer[i] *= prescale;
}

}  // namespace mxddp
