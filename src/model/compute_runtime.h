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

// oneDNN's ISA for this CPU multiplies BF16 natively (avx512_core_bf16, or AMX which includes it).
bool cpu_isa_has_bf16();

}  // namespace mxddp::model
