// The reduction kernel shared by the local backend (across peers' buffers) and the MPI backend
// (for what MPI cannot reduce itself). CPU reference and implementation in one: plain loops over
// cache-sized tiles that the compiler vectorizes.
#pragma once

#include <cstdint>

#include <mxddp/comm.h>

namespace mxddp {

// out[i] = op(inputs[0][i], inputs[1][i], ..., inputs[n_inputs-1][i]) for i < count, combining in
// input order (so the result is bitwise reproducible). f32 and bf16 accumulate in f32 and round
// once; u8 sums wrap modulo 256. out may alias any input: each tile is fully read before written.
void reduce_arrays(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                   void* out);

// buffer[i] /= divisor: the avg finish of an f32 sum (bf16 averages are finished in f32 too, before
// their single rounding).
void divide_in_place(float* buffer, int64_t count, int divisor);

}  // namespace mxddp
