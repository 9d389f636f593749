// What the model's products run on, shared by gemm.cc and compute_info.cc: the one oneDNN CPU
// engine of the process, how a row-major operand is described to oneDNN, and what the CPU's
// ISA (as oneDNN dispatches on it) can do.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

namespace mxddp::model {

const dnnl::engine& cpu_engine();

// op(X) [rows, cols] over row-major storage with leading dimension ld: X itself [rows, cols]
// (strides {ld, 1}), or, when transposed, X [cols, rows] read as its transpose (strides {1, ld}).
dnnl::memory::desc operand_desc(int rows, int cols, int ld, bool transposed, dnnl::memory::data_type type);

// Makes the calling thread's OpenMP regions come up with exactly compute_threads() threads (no
// dynamic adjustment, no count above OMP_THREAD_LIMIT): oneDNN splits a product's work for the
// count it reads and runs it in a region it assumes has that many, so a short region would skip
// work. set_compute_threads does it; gemm calls this for threads that never called that.
void make_thread_count_exact();

// oneDNN's ISA for this CPU multiplies BF16 natively (avx512_core_bf16, or AMX which includes it).
bool cpu_isa_has_bf16();

}  // namespace mxddp::model
