// The per-ISA float reduction and copy kernels behind reduce_arrays and copy_to_many (reduce.h). One source
// (reduce_simd.inc) is compiled three times, for x86-64-v2 (the build's baseline), AVX2 and
// AVX-512F, and reduce.cc picks the widest the CPU runs, once, at run time. The interface uses only
// plain types so those translation units include no inline code of the library's headers: an
// inline function compiled with -mavx512f there could be the copy the linker keeps for everyone.
#pragma once

#include <cstdint>

namespace mxddp::reduce_kernels {

enum class Elem : int { kF32, kBF16 };
enum class Combine : int { kSum, kAvg, kMax };

// outputs[j][i] = combine(inputs[0][i], ..., inputs[n_inputs-1][i]) for i < count and every
// j < n_outputs; see reduce_arrays for the arithmetic. An output may be exactly an input (the same
// address); no other overlap is allowed.
struct FloatReduce {
  Elem elem = Elem::kF32;
  Combine combine = Combine::kSum;
  const void* const* inputs = nullptr;  // [n_inputs], each [count] elements of elem
  int n_inputs = 0;
  int64_t count = 0;
  void* const* outputs = nullptr;  // [n_outputs], each [count] elements of elem
  int n_outputs = 0;
  float prescale = 1.0f;  // sum and avg only
};

void reduce_float_base(const FloatReduce& r);
void reduce_float_avx2(const FloatReduce& r);
void reduce_float_avx512(const FloatReduce& r);

// dsts[j][0..bytes) = src[0..bytes) for every j < n_dsts, a chunk of src at a time (read from
// memory once, from cache for the other destinations). With nontemporal, the stores stream past
// the caches: no read for ownership of the destination lines, and the caller's working set stays
// cached, at the price of the destination not being cached afterwards.
struct CopyMany {
  const void* src = nullptr;    // [bytes]
  void* const* dsts = nullptr;  // [n_dsts], each [bytes]; none overlaps src or another
  int n_dsts = 0;
  uint64_t bytes = 0;
  bool nontemporal = false;
};

void copy_many_base(const CopyMany& c);
void copy_many_avx2(const CopyMany& c);
void copy_many_avx512(const CopyMany& c);

}  // namespace mxddp::reduce_kernels
