// reduce_arrays, copy_to_many: see reduce.h. Floats go to the per-ISA kernels (reduce_kernels.h),
// picked once from the CPU's features; u8 stays a plain tiled loop and f64, i64, i32 and bool (rare:
// flags, counts, metrics) a scalar one.
#include "reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "reduce_kernels.h"

namespace mxddp {

namespace {

using FloatKernel = void (*)(const reduce_kernels::FloatReduce&);
using CopyKernel = void (*)(const reduce_kernels::CopyMany&);

struct KernelChoice {
  FloatKernel kernel;
  CopyKernel copy;
  std::string_view isa;
};

KernelChoice choose_kernel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    return {reduce_kernels::reduce_float_avx512, reduce_kernels::copy_many_avx512, "avx512f"};
  if (__builtin_cpu_supports("avx2")) return {reduce_kernels::reduce_float_avx2, reduce_kernels::copy_many_avx2, "avx2"};
  return {reduce_kernels::reduce_float_base, reduce_kernels::copy_many_base, "x86-64-v2"};
}

const KernelChoice& kernel_choice() {
  static const KernelChoice choice = choose_kernel();
  return choice;
}

constexpr int64_t kU8TileNumel = 4096;  // 16 KiB of u32 accumulator, in L1 however many inputs

void reduce_u8(ReduceOp op, const void* const* inputs, int n_inputs, int64_t count, void* const* outputs,
               int n_outputs) {
  uint32_t acc[kU8TileNumel];
  for (int64_t begin = 0; begin < count; begin += kU8TileNumel) {
    const int64_t n = std::min(kU8TileNumel, count - begin);
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
    for (int j = 0; j < n_outputs; ++j) {
      auto* out = static_cast<uint8_t*>(outputs[j]) + begin;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(acc[i]);
    }
  }
}

// f64, i64, i32 and bool (counts, metrics and flags: small buffers, so a scalar loop). Element by
// element, all inputs are read before any output is written, so an output that is an input is safe.
// f64 accumulates in f64 in input order; integers add in their unsigned twin (wrapping modulo 2^bits
// rather than signed overflow, which is undefined); bool is a logical or for sum and max, written as
// 0 or 1.
template <typename T>
void reduce_scalar(ReduceOp op, const void* const* inputs, int n_inputs, int64_t count, void* const* outputs,
                   int n_outputs, double prescale) {
  const auto in = [&](int k, int64_t i) { return static_cast<const T*>(inputs[k])[i]; };
  for (int64_t i = 0; i < count; ++i) {
    T acc;
    if constexpr (std::is_same_v<T, bool>) {
      // Read as bytes: a torch bool tensor holds 0 or 1, but any nonzero byte counts as set.
      uint8_t any = 0;
      for (int k = 0; k < n_inputs; ++k) any |= static_cast<const uint8_t*>(inputs[k])[i];
      acc = any != 0;
    } else if constexpr (std::is_floating_point_v<T>) {
      acc = in(0, i) * prescale;
      for (int k = 1; k < n_inputs; ++k) {
        const T x = in(k, i);
        if (op == ReduceOp::kMax) acc = (x > acc || x != x) ? x : acc;
        else acc += x * prescale;
      }
      if (op == ReduceOp::kAvg) acc /= static_cast<T>(n_inputs);
    } else {
      using U = std::make_unsigned_t<T>;
      acc = in(0, i);
      for (int k = 1; k < n_inputs; ++k) {
        const T x = in(k, i);
        acc = op == ReduceOp::kMax ? std::max(acc, x) : static_cast<T>(static_cast<U>(acc) + static_cast<U>(x));
      }
    }
    for (int j = 0; j < n_outputs; ++j) static_cast<T*>(outputs[j])[i] = acc;
  }
}

reduce_kernels::Combine combine_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return reduce_kernels::Combine::kSum;
    case ReduceOp::kAvg: return reduce_kernels::Combine::kAvg;
    case ReduceOp::kMax: return reduce_kernels::Combine::kMax;
  }
  MXDDP_FAIL("unknown reduce op {}", static_cast<int>(op));
}

}  // namespace

void reduce_arrays_to(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                      void* const* outputs, int n_outputs, float prescale) {
  MXDDP_ASSERT(n_inputs >= 1 && n_outputs >= 1 && count >= 0);
  MXDDP_ASSERT(prescale == 1.0f || (op != ReduceOp::kMax && dtype != DType::kU8));
  // One input written back onto itself unscaled (every collective of a group of one, e.g. the
  // gradient reduce-scatter at dp 1): sum, avg and max of one value are that value, so there is
  // nothing to move. Without this the pass read and wrote the whole grad buffer every step.
  if (n_inputs == 1 && prescale == 1.0f &&
      std::all_of(outputs, outputs + n_outputs, [&](void* out) { return out == inputs[0]; }))
    return;
  switch (dtype) {
    case DType::kF32:
    case DType::kBF16: {
      reduce_kernels::FloatReduce r;
      r.elem = dtype == DType::kF32 ? reduce_kernels::Elem::kF32 : reduce_kernels::Elem::kBF16;
      r.combine = combine_of(op);
      r.inputs = inputs;
      r.n_inputs = n_inputs;
      r.count = count;
      r.outputs = outputs;
      r.n_outputs = n_outputs;
      r.prescale = prescale;
      kernel_choice().kernel(r);
      return;
    }
    case DType::kU8:
      MXDDP_ASSERT(op != ReduceOp::kAvg);
      reduce_u8(op, inputs, n_inputs, count, outputs, n_outputs);
      return;
    case DType::kF64:
      reduce_scalar<double>(op, inputs, n_inputs, count, outputs, n_outputs, prescale);
      return;
    case DType::kI64:
    case DType::kI32:
    case DType::kBool:
      MXDDP_ASSERT(op != ReduceOp::kAvg && prescale == 1.0f);
      if (dtype == DType::kI64) reduce_scalar<int64_t>(op, inputs, n_inputs, count, outputs, n_outputs, 1.0);
      else if (dtype == DType::kI32) reduce_scalar<int32_t>(op, inputs, n_inputs, count, outputs, n_outputs, 1.0);
      else reduce_scalar<bool>(op, inputs, n_inputs, count, outputs, n_outputs, 1.0);
      return;
    case DType::kF16:
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0: break;
  }
  MXDDP_FAIL("reductions support f32, bf16, u8, f64, i64, i32 and bool; got {}", dtype_name(dtype));
}

void reduce_arrays(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                   void* out, float prescale) {
  void* const outputs[1] = {out};
  reduce_arrays_to(dtype, op, inputs, n_inputs, count, outputs, 1, prescale);
}

void copy_to_many(const void* src, void* const* dsts, int n_dsts, size_t bytes) {
  reduce_kernels::CopyMany c;
  c.src = src;
  c.dsts = dsts;
  c.n_dsts = n_dsts;
  c.bytes = bytes;
  c.nontemporal = bytes * static_cast<size_t>(n_dsts) >= kNontemporalCopyBytesMin;
  kernel_choice().copy(c);
}

std::string_view reduce_kernel_isa() { return kernel_choice().isa; }

void finish_in_place(double* buffer, int64_t count, ReduceOp op, int size, float prescale) {
  if (op == ReduceOp::kAvg) {
    const auto d = static_cast<double>(size);
    for (int64_t i = 0; i < count; ++i) buffer[i] /= d;
  }
  if (prescale != 1.0f)
    for (int64_t i = 0; i < count; ++i) buffer[i] *= prescale;
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
