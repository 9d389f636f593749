// The reference GPT's kernels, forward and backward, on the CPU. Templated on the element type:
// f32 is what training runs, f64 is what the finite-difference test checks the backward against.
// Matrix products go through blas.h; everything here is the row-wise glue between them. The f32
// row kernels are row_kernels.h's vectorized, threaded overloads of these templates (declared
// before the templates' callers, so GptGraph<float> picks them); attention is causal_attention.h.
//
// Shapes use N = tokens in the micro-batch (B x T), C = hidden size, V = vocabulary size.
// Backward functions accumulate (+=) into weight gradients, because gradients of a param sum over
// micro-batches in the grad buffer; they overwrite or add into activation gradients as each says.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "blas.h"
#include "causal_attention.h"
#include "row_kernels.h"
#include "step_profile.h"

namespace mxddp::model {

// out [cols] += column sums of x [rows, cols], row by row.
template <typename T>
void add_column_sums(const T* x, int rows, int cols, T* out) {
  for (int i = 0; i < rows; ++i) {
    const T* row = x + static_cast<int64_t>(i) * cols;
    for (int j = 0; j < cols; ++j) out[j] += row[j];
  }
}

// y [count] = 0
template <typename T>
void fill_zero(T* y, int64_t count) {
  const profile::Scope timed(profile::Part::kElementwise);
  std::fill(y, y + count, T(0));
}

// y [count] += x [count]
template <typename T>
void add_in_place(T* y, const T* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] += x[i];
}

// ---- Linear: y = x W^T + b, with W [out, in] (PyTorch's and Megatron's layout; row-wise MXFP8
// blocks then run along `in`, the forward product's reduction dimension). ----

// An operand of the linear layers' products: its values in T, and/or, for the f32 GPT computing in
// BF16, its BF16 bits, which the products then read in place. A BF16 param is passed as its own
// bits (no f32 copy of the param, no rounding pass: the copy would round back to these bits); a
// gradient that two products read is rounded once for both; GELU's output is only kept in BF16.
template <typename T>
struct Operand;
// An Operand parameter whose T comes from the other arguments, so a plain pointer converts.
template <typename T>
using OperandOf = std::type_identity_t<Operand<T>>;

template <typename T>
struct Operand {
  Operand(const T* v = nullptr, const uint16_t* b = nullptr) : values(v), bf16(b) {}  // NOLINT: a plain pointer is an operand
  const T* values;
  const uint16_t* bf16;
};

// C [m, n] = alpha op(A) op(B) + beta C, reading each operand's BF16 bits where it has them.
template <typename T>
void gemm_operands(Op op_a, Op op_b, int m, int n, int k, OperandOf<T> a, int lda, OperandOf<T> b, int ldb, T beta, T* c,
                   int ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (a.bf16 != nullptr || b.bf16 != nullptr) {
      const GemmOperand ga = a.bf16 != nullptr ? GemmOperand{a.bf16, lda, true} : GemmOperand{a.values, lda, false};
      const GemmOperand gb = b.bf16 != nullptr ? GemmOperand{b.bf16, ldb, true} : GemmOperand{b.values, ldb, false};
      gemm(op_a, op_b, m, n, k, 1.0f, ga, gb, beta, c, ldc);
      return;
    }
  }
  gemm(op_a, op_b, m, n, k, T(1), a.values, lda, b.values, ldb, beta, c, ldc);
}

// The calling thread's products run in BF16 (the f32 GPT under --bf16 on a CPU that has it).
inline bool products_in_bf16() { return gemm_dtype() == GemmDType::kBF16 && bf16_gemm_supported(); }

// x [n, in], w [out, in], b [out] -> y [n, out]
template <typename T>
void linear_forward(OperandOf<T> x, OperandOf<T> w, const T* b, T* y, int n, int in, int out) {
  if constexpr (std::is_same_v<T, float>) {  // the bias is added inside the product
    const GemmOperand gx = x.bf16 != nullptr ? GemmOperand{x.bf16, in, true} : GemmOperand{x.values, in, false};
    const GemmOperand gw = w.bf16 != nullptr ? GemmOperand{w.bf16, in, true} : GemmOperand{w.values, in, false};
    gemm(Op::kN, Op::kT, n, out, in, 1.0f, gx, gw, 0.0f, y, out, b);
    return;
  }
  {
    const profile::Scope timed(profile::Part::kElementwise);
    for (int i = 0; i < n; ++i) std::copy(b, b + out, y + static_cast<int64_t>(i) * out);
  }
  gemm_operands(Op::kN, Op::kT, n, out, in, x, in, w, in, T(1), y, out);
}

// dw [out, in] += dy^T x; db [out] += column sums of dy (its values: the bias gradient stays f32).
template <typename T>
void linear_backward_weight(OperandOf<T> dy, OperandOf<T> x, T* dw, T* db, int n, int in, int out) {
  gemm_operands(Op::kT, Op::kN, out, in, n, dy, out, x, in, T(1), dw, in);
  add_column_sums(dy.values, n, out, db);
}

// dx [n, in] = dy w (+ dx when accumulate).
template <typename T>
void linear_backward_data(OperandOf<T> dy, OperandOf<T> w, T* dx, int n, int in, int out, bool accumulate) {
  gemm_operands(Op::kN, Op::kN, n, in, out, dy, out, w, in, accumulate ? T(1) : T(0), dx, in);
}

// ---- LayerNorm over the last dimension: y = (x - mean) * rstd * w + b ----

// x [n, c] -> y [n, c], mean [n], rstd [n]
template <typename T>
void layernorm_forward(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int n, int c) {
  for (int i = 0; i < n; ++i) {
    const T* xi = x + static_cast<int64_t>(i) * c;
    T* yi = y + static_cast<int64_t>(i) * c;
    T m = 0;
    for (int j = 0; j < c; ++j) m += xi[j];
    m /= static_cast<T>(c);
    T v = 0;
    for (int j = 0; j < c; ++j) v += (xi[j] - m) * (xi[j] - m);
    v /= static_cast<T>(c);
    const T r = T(1) / std::sqrt(v + static_cast<T>(kLayerNormEps));
    for (int j = 0; j < c; ++j) yi[j] = (xi[j] - m) * r * w[j] + b[j];
    mean[i] = m;
    rstd[i] = r;
  }
}

// dx [n, c] += dL/dx; dw, db [c] +=.
template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw, T* db, int n,
                        int c) {
  for (int i = 0; i < n; ++i) {
    const T* dyi = dy + static_cast<int64_t>(i) * c;
    const T* xi = x + static_cast<int64_t>(i) * c;
    T* dxi = dx + static_cast<int64_t>(i) * c;
    const T m = mean[i], r = rstd[i];
    T mean_dxhat = 0, mean_dxhat_xhat = 0;
    for (int j = 0; j < c; ++j) {
      const T xhat = (xi[j] - m) * r;
      const T dxhat = dyi[j] * w[j];
      mean_dxhat += dxhat;
      mean_dxhat_xhat += dxhat * xhat;
      dw[j] += dyi[j] * xhat;
      db[j] += dyi[j];
    }
    mean_dxhat /= static_cast<T>(c);
    mean_dxhat_xhat /= static_cast<T>(c);
    for (int j = 0; j < c; ++j) {
      const T xhat = (xi[j] - m) * r;
      dxi[j] += r * (dyi[j] * w[j] - mean_dxhat - xhat * mean_dxhat_xhat);
    }
  }
}

// ---- GELU, tanh approximation (GPT-2's) ----

template <typename T>
void gelu_forward(const T* x, T* y, int64_t count) {
  const T k = static_cast<T>(0.7978845608028654);  // sqrt(2 / pi)
  for (int64_t i = 0; i < count; ++i) {
    const T v = x[i];
    y[i] = T(0.5) * v * (T(1) + std::tanh(k * (v + static_cast<T>(0.044715) * v * v * v)));
  }
}

// dx = dy * gelu'(x); dx may alias dy.
template <typename T>
void gelu_backward(const T* x, const T* dy, T* dx, int64_t count) {
  const T k = static_cast<T>(0.7978845608028654);
  const T a = static_cast<T>(0.044715);
  for (int64_t i = 0; i < count; ++i) {
    const T v = x[i];
    const T t = std::tanh(k * (v + a * v * v * v));
    const T grad = T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * k * (T(1) + T(3) * a * v * v);
    dx[i] = dy[i] * grad;
  }
}

// ---- Embedding: x [N, C] = wte[token] + wpe[position] ----

template <typename T>
void embedding_forward(const int32_t* tokens, const T* wte, const T* wpe, T* x, int batch, int seq, int c) {
  const profile::Scope timed(profile::Part::kElementwise);
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < seq; ++t) {
      const int64_t n = static_cast<int64_t>(b) * seq + t;
      const T* e = wte + static_cast<int64_t>(tokens[n]) * c;
      const T* p = wpe + static_cast<int64_t>(t) * c;
      T* out = x + n * c;
      for (int j = 0; j < c; ++j) out[j] = e[j] + p[j];
    }
}

template <typename T>
void embedding_backward(const int32_t* tokens, const T* dx, T* dwte, T* dwpe, int batch, int seq, int c) {
  const profile::Scope timed(profile::Part::kElementwise);
  for (int b = 0; b < batch; ++b)
    for (int t = 0; t < seq; ++t) {
      const int64_t n = static_cast<int64_t>(b) * seq + t;
      const T* g = dx + n * c;
      T* e = dwte + static_cast<int64_t>(tokens[n]) * c;
      T* p = dwpe + static_cast<int64_t>(t) * c;
      for (int j = 0; j < c; ++j) {
        e[j] += g[j];
        p[j] += g[j];
      }
    }
}

// ---- Softmax cross-entropy over logits [N, V]; returns the summed loss (in f64). With
// grad_scale != 0 the logits are overwritten by dL/dlogits * grad_scale = (softmax - onehot) *
// grad_scale, the gradient of grad_scale * (summed loss). row_loss [n] is scratch: each row's loss
// in T, summed in f64 in row order. ----
template <typename T>
double cross_entropy(T* logits, const int32_t* targets, T* row_loss, int n, int v, T grad_scale) {
  for (int i = 0; i < n; ++i) {
    T* row = logits + static_cast<int64_t>(i) * v;
    T mx = row[0];
    for (int j = 1; j < v; ++j) mx = std::max(mx, row[j]);
    T sum = 0;
    for (int j = 0; j < v; ++j) sum += std::exp(row[j] - mx);
    const T log_sum = std::log(sum) + mx;
    row_loss[i] = log_sum - row[targets[i]];
    if (grad_scale != T(0)) {
      for (int j = 0; j < v; ++j) row[j] = std::exp(row[j] - log_sum) * grad_scale;
      row[targets[i]] -= grad_scale;
    }
  }
  double loss = 0;
  for (int i = 0; i < n; ++i) loss += static_cast<double>(row_loss[i]);
  return loss;
}

}  // namespace mxddp::model
