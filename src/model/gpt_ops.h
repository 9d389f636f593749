// The reference GPT's kernels, forward and backward, on the CPU. Templated on the element type:
// f32 is what training runs, f64 is what the finite-difference test checks the backward against.
// Matrix products go through blas.h; everything here is the row-wise glue between them.
//
// Shapes use N = tokens in the micro-batch (B x T), C = hidden size, V = vocabulary size.
// Backward functions accumulate (+=) into weight gradients, because gradients of a param sum over
// micro-batches in the grad buffer; they overwrite or add into activation gradients as each says.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "blas.h"

namespace mxddp::model {

inline constexpr double kLayerNormEps = 1e-5;

// ---- Linear: y = x W^T + b, with W [out, in] (PyTorch's and Megatron's layout; row-wise MXFP8
// blocks then run along `in`, the forward product's reduction dimension). ----

// x [n, in], w [out, in], b [out] -> y [n, out]
template <typename T>
void linear_forward(const T* x, const T* w, const T* b, T* y, int n, int in, int out) {
  for (int i = 0; i < n; ++i) std::copy(b, b + out, y + static_cast<int64_t>(i) * out);
  gemm(Op::kN, Op::kT, n, out, in, T(1), x, in, w, in, T(1), y, out);
}

// dw [out, in] += dy^T x; db [out] += column sums of dy.
template <typename T>
void linear_backward_weight(const T* dy, const T* x, T* dw, T* db, int n, int in, int out) {
  gemm(Op::kT, Op::kN, out, in, n, T(1), dy, out, x, in, T(1), dw, in);
  for (int i = 0; i < n; ++i) {
    const T* row = dy + static_cast<int64_t>(i) * out;
    for (int o = 0; o < out; ++o) db[o] += row[o];
  }
}

// dx [n, in] = dy w (+ dx when accumulate).
template <typename T>
void linear_backward_data(const T* dy, const T* w, T* dx, int n, int in, int out, bool accumulate) {
  gemm(Op::kN, Op::kN, n, in, out, T(1), dy, out, w, in, accumulate ? T(1) : T(0), dx, in);
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

// ---- Causal multi-head self-attention over a fused qkv [B*T, 3C] (q | k | v, head h at columns
// h*D of each third), D = C / heads. probs [B, heads, T, T] keeps the softmax for backward. ----

template <typename T>
void attention_forward(const T* qkv, T* probs, T* y, int batch, int seq, int c, int heads) {
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      const T* q = qkv + static_cast<int64_t>(b) * seq * ld + h * d;
      const T* k = q + c;
      const T* v = q + 2 * c;
      T* p = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
      // p [T, T] = scale * q k^T, then a causal softmax per row (the masked entries become 0).
      gemm(Op::kN, Op::kT, seq, seq, d, scale, q, ld, k, ld, T(0), p, seq);
      for (int i = 0; i < seq; ++i) {
        T* row = p + static_cast<int64_t>(i) * seq;
        T mx = row[0];
        for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        T sum = 0;
        for (int j = 0; j <= i; ++j) sum += (row[j] = std::exp(row[j] - mx));
        const T inv = T(1) / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < seq; ++j) row[j] = 0;
      }
      // y [T, D] (head h's columns of [B*T, C]) = p v
      gemm(Op::kN, Op::kN, seq, d, seq, T(1), p, seq, v, ld, T(0), y + static_cast<int64_t>(b) * seq * c + h * d, c);
    }
}

// dqkv [B*T, 3C] (overwritten) from dy [B*T, C]; dp_scratch [T, T].
template <typename T>
void attention_backward(const T* dy, const T* qkv, const T* probs, T* dqkv, T* dp_scratch, int batch, int seq, int c,
                        int heads) {
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h) {
      const int64_t row0 = static_cast<int64_t>(b) * seq;
      const T* q = qkv + row0 * ld + h * d;
      const T* k = q + c;
      const T* v = q + 2 * c;
      T* dq = dqkv + row0 * ld + h * d;
      T* dk = dq + c;
      T* dv = dq + 2 * c;
      const T* dyh = dy + row0 * c + h * d;
      const T* p = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
      T* ds = dp_scratch;
      gemm(Op::kN, Op::kT, seq, seq, d, T(1), dyh, c, v, ld, T(0), ds, seq);  // dp = dy v^T
      gemm(Op::kT, Op::kN, seq, d, seq, T(1), p, seq, dyh, c, T(0), dv, ld);  // dv = p^T dy
      // Softmax backward, row by row: ds = p * (dp - sum_j p dp), times the score scale.
      for (int i = 0; i < seq; ++i) {
        const T* pi = p + static_cast<int64_t>(i) * seq;
        T* di = ds + static_cast<int64_t>(i) * seq;
        T dot = 0;
        for (int j = 0; j <= i; ++j) dot += pi[j] * di[j];
        for (int j = 0; j <= i; ++j) di[j] = scale * pi[j] * (di[j] - dot);
        for (int j = i + 1; j < seq; ++j) di[j] = 0;
      }
      gemm(Op::kN, Op::kN, seq, d, seq, T(1), ds, seq, k, ld, T(0), dq, ld);  // dq = ds k
      gemm(Op::kT, Op::kN, seq, d, seq, T(1), ds, seq, q, ld, T(0), dk, ld);  // dk = ds^T q
    }
}

// ---- Embedding: x [N, C] = wte[token] + wpe[position] ----

template <typename T>
void embedding_forward(const int32_t* tokens, const T* wte, const T* wpe, T* x, int batch, int seq, int c) {
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
// grad_scale, the gradient of grad_scale * (summed loss). ----
template <typename T>
double cross_entropy(T* logits, const int32_t* targets, int n, int v, T grad_scale) {
  double loss = 0;
  for (int i = 0; i < n; ++i) {
    T* row = logits + static_cast<int64_t>(i) * v;
    T mx = row[0];
    for (int j = 1; j < v; ++j) mx = std::max(mx, row[j]);
    T sum = 0;
    for (int j = 0; j < v; ++j) sum += std::exp(row[j] - mx);
    const T log_sum = std::log(sum) + mx;
    loss += static_cast<double>(log_sum - row[targets[i]]);
    if (grad_scale != T(0)) {
      for (int j = 0; j < v; ++j) row[j] = std::exp(row[j] - log_sum) * grad_scale;
      row[targets[i]] -= grad_scale;
    }
  }
  return loss;
}

}  // namespace mxddp::model
