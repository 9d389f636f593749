// The host's data-moving kernels of the collectives: the reduction behind cpu_compute()'s reduce
// (the local backend's, across peers' buffers) and the MPI backend's (what MPI cannot reduce
// itself), and the one-to-many copy behind its copy_to_many (the local backend's gathers and
// broadcasts): the CPU references of the device's (compute.h). f32 and bf16 reductions run
// vectorized for the widest ISA the CPU has (chosen at run time); tests/comm/reduce_test.cc checks
// them element for element against a scalar reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <mxddp/core.h>

namespace mxddp {

// out[i] = op(inputs[0][i], inputs[1][i], ..., inputs[n_inputs-1][i]) for i < count, combining in
// input order (so the result is bitwise reproducible). f32 and bf16 accumulate in f32 and round
// once; f64 accumulates in f64; u8, i32 and i64 sums wrap modulo 2^bits; bool's sum and max are a
// logical or. With prescale != 1 (sum and avg of f32, bf16 and f64), each input is multiplied by
// it (in f32; f64 in f64) as it is loaded. out may be exactly any input (the same address).
void reduce_arrays(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                   void* out, float prescale = 1.0f);

// The same reduction written to every one of outputs[0..n_outputs) (all_reduce's write-back to
// every rank, fused: each element is read once per input and written once per output). Each output
// may be exactly an input; outputs must not overlap one another otherwise.
void reduce_arrays_to(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                      void* const* outputs, int n_outputs, float prescale = 1.0f);

// Copies bytes from src to each of dsts[0..n_dsts) (none may overlap src or each other), a chunk
// at a time so src is read from memory once and from cache for the other destinations. When the
// copy writes kNontemporalCopyBytesMin or more in all, the stores bypass the caches: each
// destination line is written without first being read (a plain store reads it for ownership, a
// third more traffic) and the caller's cached working set survives. Smaller copies (an FSDP unit of
// a small model, whose values are read right away) keep plain stores and land in cache.
void copy_to_many(const void* src, void* const* dsts, int n_dsts, size_t bytes);

// 4 MiB: more than a core's L2 and its share of the L3 on the x86 CPUs we run on (AMD Zen 3: 512
// KiB L2, 4 MiB of L3 per core; Intel Xeon: 1-2 MiB L2, 1.5-2 MiB of L3 per core). On this
// project's AMD EPYC VM the all_gather at 16-256 MiB ran 1.1-1.6x faster with streaming stores.
inline constexpr size_t kNontemporalCopyBytesMin = size_t{4} << 20;

// The float kernel's ISA on this CPU: "avx512f", "avx2" or "x86-64-v2" (benches print it).
std::string_view reduce_kernel_isa();

// For engines that can only sum: turns an f32 sum over `size` ranks into the op's result, dividing
// for avg and applying prescale to the result (bf16 is finished in f32 too, before its single
// rounding).
void finish_in_place(float* buffer, int64_t count, ReduceOp op, int size, float prescale);
// The same for an f64 sum, in f64.
void finish_in_place(double* buffer, int64_t count, ReduceOp op, int size, float prescale);

}  // namespace mxddp
