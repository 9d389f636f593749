// causal_attention.h: block-causal attention forward and backward, f32 and f64.
//
// Per head, with blocks [i0, i1) of the T dimension (the same cut for queries and keys):
//   forward   S = scale q[i0:i1] k[0:i1]^T;  P = causal softmax of S;  y[i0:i1] = P v[0:i1]
//   backward  dS = dy[i0:i1] v[0:i1]^T, then the softmax backward in place (times the scale);
//             dq[i0:i1] = dS k[0:i1]                       (query blocks: keys up to the block)
//             dv[j0:j1] = P[j0:T, j0:j1]^T dy[j0:T]         (key blocks: queries from the block on)
//             dk[j0:j1] = dS[j0:T, j0:j1]^T q[j0:T]
// Every entry those products read is at or below the diagonal block, where forward wrote it (or
// its zero above the diagonal inside the block).
#include "causal_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "blas.h"
#include "row_kernels.h"

namespace mxddp::model {

namespace {

// The f64 causal softmax rows, the reference of row_kernels' f32 ones (same contract).
void causal_softmax_rows(double* p, int ld, int first_row, int rows, int width) {
  for (int k = 0; k < rows; ++k) {
    double* row = p + static_cast<int64_t>(k) * ld;
    const int len = first_row + k + 1;
    double mx = row[0];
    for (int j = 1; j < len; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int j = 0; j < len; ++j) sum += (row[j] = std::exp(row[j] - mx));
    for (int j = 0; j < len; ++j) row[j] /= sum;
    for (int j = len; j < width; ++j) row[j] = 0;
  }
}

void causal_softmax_backward_rows(const double* p, double* ds, int ld, int first_row, int rows, int width,
                                  double scale) {
  for (int k = 0; k < rows; ++k) {
    const double* pk = p + static_cast<int64_t>(k) * ld;
    double* dk = ds + static_cast<int64_t>(k) * ld;
    const int len = first_row + k + 1;
    double dot = 0;
    for (int j = 0; j < len; ++j) dot += pk[j] * dk[j];
    for (int j = 0; j < len; ++j) dk[j] = scale * pk[j] * (dk[j] - dot);
    for (int j = len; j < width; ++j) dk[j] = 0;
  }
}

// f(b, h, thread) for every (batch, head) pair, spread over the calling thread's OpenMP threads.
// Products inside run on one thread each and in the caller's gemm dtype (a thread-local setting
// the OpenMP workers do not inherit).
template <typename F>
void for_each_head(int batch, int heads, F&& f) {
  const int pairs = batch * heads;
  const int threads = omp_in_parallel() ? 1 : std::min(omp_get_max_threads(), pairs);
  if (threads <= 1) {
    for (int i = 0; i < pairs; ++i) f(i / heads, i % heads, 0);
    return;
  }
  const GemmDType dtype = gemm_dtype();
#pragma omp parallel num_threads(threads)
  {
    const ScopedGemmDType same_dtype(dtype);
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic)
    for (int i = 0; i < pairs; ++i) f(i / heads, i % heads, thread);
  }
}

}  // namespace

int attention_block(int seq) { return std::max(1, std::min(64, seq / 2)); }

int64_t attention_backward_scratch_numel(int seq) {
  return static_cast<int64_t>(omp_get_max_threads()) * seq * seq;
}

template <typename T>
void attention_forward(const T* qkv, T* probs, T* y, int batch, int seq, int c, int heads, int block) {
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  if (block <= 0) block = attention_block(seq);
  for_each_head(batch, heads, [&](int b, int h, int) {
    const T* q = qkv + static_cast<int64_t>(b) * seq * ld + h * d;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* p = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
    T* yh = y + static_cast<int64_t>(b) * seq * c + h * d;
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      T* pb = p + static_cast<int64_t>(i0) * seq;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, q + static_cast<int64_t>(i0) * ld, ld, k, ld, T(0), pb, seq);
      causal_softmax_rows(pb, seq, i0, rows, i1);
      gemm(Op::kN, Op::kN, rows, d, i1, T(1), pb, seq, v, ld, T(0), yh + static_cast<int64_t>(i0) * c, c);
    }
  });
}

template <typename T>
void attention_backward(const T* dy, const T* qkv, const T* probs, T* dqkv, T* scratch, int batch, int seq, int c,
                        int heads, int block) {
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  if (block <= 0) block = attention_block(seq);
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const int64_t row0 = static_cast<int64_t>(b) * seq;
    const T* q = qkv + row0 * ld + h * d;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* dq = dqkv + row0 * ld + h * d;
    T* dk = dq + c;
    T* dv = dq + 2 * c;
    const T* dyh = dy + row0 * c + h * d;
    const T* p = probs + (static_cast<int64_t>(b) * heads + h) * seq * seq;
    T* ds = scratch + static_cast<int64_t>(thread) * seq * seq;
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      const int64_t off = static_cast<int64_t>(i0) * seq;
      gemm(Op::kN, Op::kT, rows, i1, d, T(1), dyh + static_cast<int64_t>(i0) * c, c, v, ld, T(0), ds + off, seq);
      causal_softmax_backward_rows(p + off, ds + off, seq, i0, rows, i1, scale);
      gemm(Op::kN, Op::kN, rows, d, i1, T(1), ds + off, seq, k, ld, T(0), dq + static_cast<int64_t>(i0) * ld, ld);
    }
    for (int j0 = 0; j0 < seq; j0 += block) {
      const int j1 = std::min(seq, j0 + block), cols = j1 - j0, below = seq - j0;
      const int64_t off = static_cast<int64_t>(j0) * seq + j0;
      gemm(Op::kT, Op::kN, cols, d, below, T(1), p + off, seq, dyh + static_cast<int64_t>(j0) * c, c, T(0),
           dv + static_cast<int64_t>(j0) * ld, ld);
      gemm(Op::kT, Op::kN, cols, d, below, T(1), ds + off, seq, q + static_cast<int64_t>(j0) * ld, ld, T(0),
           dk + static_cast<int64_t>(j0) * ld, ld);
    }
  });
}

template void attention_forward<float>(const float*, float*, float*, int, int, int, int, int);
template void attention_forward<double>(const double*, double*, double*, int, int, int, int, int);
template void attention_backward<float>(const float*, const float*, const float*, float*, float*, int, int, int, int,
                                        int);
template void attention_backward<double>(const double*, const double*, const double*, double*, double*, int, int, int,
                                         int, int);

}  // namespace mxddp::model
