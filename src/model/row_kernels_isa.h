// The per-ISA f32 row kernels behind row_kernels.h: one source (row_kernels_simd.inc) compiled for
// x86-64-v2 (the build's baseline), AVX2+FMA, AVX-512 (F, BW) and AVX-512 with BF16, each exporting a table of the same
// functions; row_kernels.cc picks the widest table the CPU runs, once, and spreads rows over the
// rank's OpenMP threads. Each function here works on a range of rows (or elements) on the calling
// thread only. The interface uses plain types only, so the ISA translation units include no
// inline code of other headers (an inline function compiled with -mavx512f there could become the
// copy the linker keeps for every caller).
#pragma once

#include <cstdint>

namespace mxddp::model::row_kernels {

struct RowKernelTable {
  const char* isa;  // "avx512bf16", "avx512f", "avx2", "x86-64-v2"

  // y[i] = e^x[i]: within 2 ulp relative for x in [-87.3, 88.3]; 0 below -87.3 (the true value is
  // < 1.2e-38 there); e^88.3 above 88.3. Only the tests call it directly.
  void (*exp)(const float* x, float* y, int64_t count);

  // GELU, tanh form: y = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), computed as x * sigmoid(2u).
  void (*gelu_forward)(const float* x, float* y, int64_t count);
  // gelu_forward's y rounded to BF16 (round_to_bf16's bits) without an f32 pass: the BF16
  // products' input (fc2's operand).
  void (*gelu_forward_bf16)(const float* x, uint16_t* y, int64_t count);
  // dx = dy * gelu'(x); dx may alias dy.
  void (*gelu_backward)(const float* x, const float* dy, float* dx, int64_t count);
  // GELU's backward under BF16 products, from one sigmoid per element: y16 = gelu_forward_bf16's
  // bits (fc2's weight-gradient operand, rebuilt from x), dx = gelu_backward's bits and dx16 = dx
  // rounded to BF16 (round_to_bf16's bits; the fc1 products' operand). dx may alias dy; y16 and
  // dx16 alias nothing.
  void (*gelu_forward_backward_bf16)(const float* x, const float* dy, uint16_t* y16, float* dx, uint16_t* dx16,
                                     int64_t count);

  // LayerNorm of `rows` rows of c: y, mean, rstd as gpt_ops.h's layernorm_forward.
  void (*layernorm_forward)(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                            int64_t rows, int c, float eps);
  // layernorm_forward with y stored as BF16 bits (its f32 values rounded): the products' operand.
  void (*layernorm_forward_bf16)(const float* x, const float* w, const float* b, uint16_t* y, float* mean,
                                 float* rstd, int64_t rows, int c, float eps);
  // dx [rows, c] += dL/dx (no weight gradients: see layernorm_param_grads).
  void (*layernorm_backward_data)(const float* dy, const float* x, const float* w, const float* mean,
                                  const float* rstd, float* dx, int64_t rows, int c);
  // Columns [j0, j1) of the weight gradients, summed over all `rows` rows in row order:
  // dw[j] += sum_i dy[i, j] xhat[i, j], db[j] += sum_i dy[i, j].
  void (*layernorm_param_grads)(const float* dy, const float* x, const float* mean, const float* rstd, float* dw,
                                float* db, int64_t rows, int c, int j0, int j1);

  // out[j] += sum_i x[i, j] over rows in row order, for columns [j0, j1) of x [rows, ld].
  void (*column_sums)(const float* x, int64_t rows, int ld, int j0, int j1, float* out);

  // Causal softmax in place over rows first_row .. first_row + rows - 1 of a score matrix (row r
  // at p + (r - first_row) * ld): entries 0..r become softmax, entries r+1 .. width-1 become 0.
  // row_max [rows] and row_inv_sum [rows] get each row's statistics: its max over 0..r and
  // 1 / sum_j e^(s_j - max), all a backward needs to rebuild the row from its scores.
  void (*causal_softmax)(float* p, int ld, int first_row, int rows, int width, float* row_max, float* row_inv_sum);
  // The same rows rebuilt from the same scores and those statistics: causal_softmax's output bit
  // for bit (the same exp and the same product, without the max and the sum).
  void (*causal_softmax_from_stats)(float* p, int ld, int first_row, int rows, int width, const float* row_max,
                                    const float* row_inv_sum);
  // Its backward, in place on ds (which holds dL/dp on entry): ds = scale * p * (ds - sum_j p ds)
  // over 0..r, 0 over r+1 .. width-1.
  void (*causal_softmax_backward)(const float* p, float* ds, int ld, int first_row, int rows, int width, float scale);

  // y[i] = x[i] rounded to BF16 (the bits), to nearest even; NaN stays NaN (quiet): core.h's
  // f32_to_bf16, vectorized (the BF16 products' operand casts).
  void (*round_to_bf16)(const float* x, uint16_t* y, int64_t count);

  // Softmax cross-entropy over `rows` rows of logits [rows, v]: row_loss[i] = logsumexp - logit of
  // target. With grad_scale != 0 the row becomes (softmax - onehot) * grad_scale.
  void (*cross_entropy)(float* logits, const int32_t* targets, float* row_loss, int64_t rows, int v, float grad_scale);
};

const RowKernelTable& row_kernels_base();
const RowKernelTable& row_kernels_avx2();
const RowKernelTable& row_kernels_avx512();
const RowKernelTable& row_kernels_avx512bf16();

}  // namespace mxddp::model::row_kernels
