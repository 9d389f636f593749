// causal_attention.h: block-causal, flash-style attention forward and backward, f32 and f64.
//
// Per head, with blocks [i0, i1) of the T dimension (the same cut for queries and keys), P_blk and
// dS_blk [i1 - i0, i1] in the thread's two tiles:
//   forward   S = scale q[i0:i1] k[0:i1]^T;  P = causal softmax of S (saving its statistics);
//             y[i0:i1] = P v[0:i1]
//   backward  dk, dv = 0; per query block:
//             S again, P = softmax of S from the saved statistics (forward's P bit for bit);
//             dS = dy[i0:i1] v[0:i1]^T, then the softmax backward in place (times the scale);
//             dq[i0:i1] = dS k[0:i1];  dv[0:i1] += P^T dy[i0:i1];  dk[0:i1] += dS^T q[i0:i1]
// Every tile entry a product reads is at or below the diagonal block, where the softmax wrote it
// (or its zero above the diagonal inside the block).
#include "causal_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "blas.h"
#include "row_kernels.h"
#include "step_profile.h"

namespace mxddp::model {

namespace {

// The f64 causal softmax rows, the reference of row_kernels' f32 ones (same contract).
void causal_softmax_row(double* row, int len, int width, double mx, double inv) {
  for (int j = 0; j < len; ++j) row[j] = std::exp(row[j] - mx) * inv;
  for (int j = len; j < width; ++j) row[j] = 0;
}

void causal_softmax_rows(double* p, int ld, int first_row, int rows, int width, double* row_max,
                         double* row_inv_sum) {
  for (int k = 0; k < rows; ++k) {
    double* row = p + static_cast<int64_t>(k) * ld;
    const int len = first_row + k + 1;
    double mx = row[0];
    for (int j = 1; j < len; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int j = 0; j < len; ++j) sum += std::exp(row[j] - mx);
    row_max[k] = mx;
    row_inv_sum[k] = 1 / sum;
    causal_softmax_row(row, len, width, mx, row_inv_sum[k]);
  }
}

void causal_softmax_rows_from_stats(double* p, int ld, int first_row, int rows, int width, const double* row_max,
                                    const double* row_inv_sum) {
  for (int k = 0; k < rows; ++k)
    causal_softmax_row(p + static_cast<int64_t>(k) * ld, first_row + k + 1, width, row_max[k], row_inv_sum[k]);
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

int64_t attention_stats_numel(int batch, int seq, int heads) {
  return static_cast<int64_t>(batch) * heads * 2 * seq;
}

int64_t attention_scratch_numel(int seq, int threads, int block) {
  if (threads <= 0) threads = omp_get_max_threads();
  if (block <= 0) block = attention_block(seq);
  return static_cast<int64_t>(threads) * 2 * std::min(block, seq) * seq;
}

template <typename T>
void attention_forward(const T* qkv, T* stats, T* y, T* scratch, int batch, int seq, int c, int heads, int block) {
  const profile::Scope timed(profile::Part::kAttentionOther);
  const ScopedGemmDType f32_products(GemmDType::kF32);  // see causal_attention.h
  if (block <= 0) block = attention_block(seq);
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const T* q = qkv + static_cast<int64_t>(b) * seq * ld + h * d;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    T* row_inv_sum = row_max + seq;
    T* yh = y + static_cast<int64_t>(b) * seq * c + h * d;
    T* p = scratch + static_cast<int64_t>(thread) * 2 * std::min(block, seq) * seq;  // [block, T]
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, q + static_cast<int64_t>(i0) * ld, ld, k, ld, T(0), p, seq);
      causal_softmax_rows(p, seq, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      gemm(Op::kN, Op::kN, rows, d, i1, T(1), p, seq, v, ld, T(0), yh + static_cast<int64_t>(i0) * c, c);
    }
  });
}

template <typename T>
void attention_backward(const T* dy, const T* qkv, const T* stats, T* dqkv, T* scratch, int batch, int seq, int c,
                        int heads, int block) {
  const profile::Scope timed(profile::Part::kAttentionOther);
  const ScopedGemmDType f32_products(GemmDType::kF32);  // see causal_attention.h
  if (block <= 0) block = attention_block(seq);
  const int d = c / heads, ld = 3 * c;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const int64_t row0 = static_cast<int64_t>(b) * seq;
    const T* q = qkv + row0 * ld + h * d;
    const T* k = q + c;
    const T* v = q + 2 * c;
    T* dq = dqkv + row0 * ld + h * d;
    T* dk = dq + c;
    T* dv = dq + 2 * c;
    const T* dyh = dy + row0 * c + h * d;
    const T* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    const T* row_inv_sum = row_max + seq;
    T* p = scratch + static_cast<int64_t>(thread) * 2 * std::min(block, seq) * seq;  // [block, T]
    T* ds = p + static_cast<int64_t>(std::min(block, seq)) * seq;                     // [block, T]
    for (int t = 0; t < seq; ++t)
      for (int j = 0; j < d; ++j) dk[static_cast<int64_t>(t) * ld + j] = dv[static_cast<int64_t>(t) * ld + j] = T(0);
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      const T* qb = q + static_cast<int64_t>(i0) * ld;
      const T* dyb = dyh + static_cast<int64_t>(i0) * c;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, qb, ld, k, ld, T(0), p, seq);
      causal_softmax_rows_from_stats(p, seq, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      gemm(Op::kN, Op::kT, rows, i1, d, T(1), dyb, c, v, ld, T(0), ds, seq);
      causal_softmax_backward_rows(p, ds, seq, i0, rows, i1, scale);
      gemm(Op::kN, Op::kN, rows, d, i1, T(1), ds, seq, k, ld, T(0), dq + static_cast<int64_t>(i0) * ld, ld);
      gemm(Op::kT, Op::kN, i1, d, rows, T(1), p, seq, dyb, c, T(1), dv, ld);
      gemm(Op::kT, Op::kN, i1, d, rows, T(1), ds, seq, qb, ld, T(1), dk, ld);
    }
  });
}

template void attention_forward<float>(const float*, float*, float*, float*, int, int, int, int, int);
template void attention_forward<double>(const double*, double*, double*, double*, int, int, int, int, int);
template void attention_backward<float>(const float*, const float*, const float*, float*, float*, int, int, int, int,
                                        int);
template void attention_backward<double>(const double*, const double*, const double*, double*, double*, int, int, int,
                                         int, int);

}  // namespace mxddp::model
