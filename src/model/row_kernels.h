// The f32 row-wise kernels the model trains with: vectorized GELU, LayerNorm, cross-entropy and the
// causal softmax, forward and backward, spread over the rank's OpenMP threads. They overload the
// templates of gpt_ops.h (a non-template function wins over a template for the same arguments), so
// GptGraph<float> runs these and GptGraph<double> keeps the plain f64 loops of gpt_ops.h, which
// are the reference tests/model/row_kernels_test.cc checks these against (bounds stated there).
//
// Threads: rows are split into one contiguous range per thread of the calling thread's OpenMP
// count (set per rank by set_compute_threads); small calls stay on the calling thread. Every
// sum runs over one row (or, for weight gradients, over one column in row order), so results
// do not depend on the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "row_kernels_isa.h"

namespace mxddp::model {

inline constexpr double kLayerNormEps = 1e-5;

// x [n, c] -> y [n, c], mean [n], rstd [n]
void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int n,
                       int c);
// The same with y [n, c] stored as BF16 bits (for the BF16 products that are its only readers).
void layernorm_forward_bf16(const float* x, const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                            int n, int c);
// dx [n, c] += dL/dx; dw, db [c] +=.
void layernorm_backward(const float* dy, const float* x, const float* w, const float* mean, const float* rstd,
                        float* dx, float* dw, float* db, int n, int c);

void gelu_forward(const float* x, float* y, int64_t count);
// gelu_forward rounded to BF16 bits (the BF16 products' operand), in one pass.
void gelu_forward_bf16(const float* x, uint16_t* y, int64_t count);
// dx = dy * gelu'(x); dx may alias dy.
void gelu_backward(const float* x, const float* dy, float* dx, int64_t count);
// GELU's backward under BF16 products in one pass (RowKernelTable::gelu_forward_backward_bf16):
// y16 = gelu(x) in BF16 (fc2's weight-gradient operand), dx = dy gelu'(x) (may alias dy) and
// dx16 = dx in BF16 (fc1's product operand).
void gelu_forward_backward_bf16(const float* x, const float* dy, uint16_t* y16, float* dx, uint16_t* dx16,
                                int64_t count);

// Summed loss over logits [n, v] (row_loss [n] is scratch: each row's loss, summed in f64 in row
// order); with grad_scale != 0 the logits become (softmax - onehot) * grad_scale.
double cross_entropy(float* logits, const int32_t* targets, float* row_loss, int n, int v, float grad_scale);

// out [cols] += column sums of x [rows, cols] (a bias gradient).
void add_column_sums(const float* x, int rows, int cols, float* out);
// y [count] += x [count] (a residual connection).
void add_in_place(float* y, const float* x, int64_t count);

// y [count] = x [count] rounded to BF16 bits (RNE, core.h's f32_to_bf16), over the rank's threads.
void round_to_bf16(const float* x, uint16_t* y, int64_t count);
// y [rows, cols] dense = x [rows, cols] (leading dimension ld) rounded as round_to_bf16, on the
// calling thread only: a head's slice of qkv gathered into the dense BF16 operand attention's
// products read (one call, not one per row: a call per 64-element row cost more than the row).
void round_rows_to_bf16(const float* x, int64_t ld, uint16_t* y, int64_t rows, int cols);

// The causal softmax of attention rows, on the calling thread only (attention parallelizes over
// heads itself); see RowKernelTable::causal_softmax(_from_stats, _backward).
void causal_softmax_rows(float* p, int ld, int first_row, int rows, int width, float* row_max, float* row_inv_sum);
void causal_softmax_rows_from_stats(float* p, int ld, int first_row, int rows, int width, const float* row_max,
                                    const float* row_inv_sum);
void causal_softmax_backward_rows(const float* p, float* ds, int ld, int first_row, int rows, int width, float scale);

namespace row_kernels {
// The widest table this CPU runs (chosen once), and every table it can run (for the tests).
const RowKernelTable& active();
std::vector<const RowKernelTable*> supported();
}  // namespace row_kernels

}  // namespace mxddp::model
