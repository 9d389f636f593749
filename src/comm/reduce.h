// The reduction kernel shared by the local backend (across peers' buffers) and the MPI backend
// (for what MPI cannot reduce itself). CPU reference and implementation in one: plain loops over
// cache-sized tiles that the compiler vectorizes.
#pragma once

#include <cstdint>

#include <mxddp/comm.h>

namespace mxddp {

// out[i] = op(inputs[0][i], inputs[1][i], ..., inputs[n_inputs-1][i]) for i < count, combining in
// input order (so the result is bitwise reproducible). f32 and bf16 accumulate in f32 and round
// once; u8 sums wrap modulo 256. With prescale != 1 (sum and avg of f32 and bf16), each input is
// multiplied by it in f32 as it is loaded. out may alias any input: each tile is fully read before
// it is written.
void reduce_arrays(DType dtype, ReduceOp op, const void* const* inputs, int n_inputs, int64_t count,
                   void* out, float prescale = 1.0f);

// For engines that can only sum: turns an f32 sum over `size` ranks into the op's result, dividing
// for avg and applying prescale to the result (bf16 is finished in f32 too, before its single
// rounding).
void finish_in_place(float* buffer, int64_t count, ReduceOp op, int size, float prescale);

}  // namespace mxddp
