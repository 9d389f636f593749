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
#include <type_traits>
#include <vector>

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

// ---- BF16 compute (f32 attention under kBF16 on a CPU with native BF16) ----
// Rounding each product's operands as it runs would round a head's k and v once per query block
// (T / block times) and dS twice, each through a oneDNN reorder whose fixed cost is a fair part of
// these small products. Instead each head's q, k, v (and dy) are rounded once into the thread's
// BF16 staging, and P and dS once per block, and every product reads BF16 in place. The products
// see the same BF16 values as rounding them one by one would give (RNE both ways), so the result
// is what the per-product path computes, up to the order oneDNN accumulates in.

bool attention_in_bf16() { return gemm_dtype() == GemmDType::kBF16 && bf16_gemm_supported(); }

// The calling thread's BF16 staging, at least `numel` elements; grows once, then is reused.
uint16_t* bf16_staging(size_t numel) {
  thread_local std::vector<uint16_t> staging;
  if (staging.size() < numel) staging.resize(numel);
  return staging.data();
}

GemmOperand in_bf16(const uint16_t* x, int ld) { return GemmOperand{x, ld, true}; }

void attention_forward_bf16(const float* qkv, float* stats, float* y, float* scratch, int batch, int seq, int c,
                            int heads, int block) {
  const int d = c / heads, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const float* q = qkv + static_cast<int64_t>(b) * seq * ld + h * d;
    float* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    float* row_inv_sum = row_max + seq;
    float* yh = y + static_cast<int64_t>(b) * seq * c + h * d;
    float* p = scratch + static_cast<int64_t>(thread) * 2 * std::min(block, seq) * seq;  // [block, T]
    // q16, k16, v16 [T, D] each, then p16 [block, T].
    uint16_t* q16 = bf16_staging(3 * static_cast<size_t>(seq) * d + static_cast<size_t>(std::min(block, seq)) * seq);
    uint16_t* k16 = q16 + static_cast<int64_t>(seq) * d;
    uint16_t* v16 = k16 + static_cast<int64_t>(seq) * d;
    uint16_t* p16 = v16 + static_cast<int64_t>(seq) * d;
    for (int part = 0; part < 3; ++part) round_rows_to_bf16(q + part * c, ld, q16 + part * seq * d, d, seq, d);
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, in_bf16(q16 + static_cast<int64_t>(i0) * d, d), in_bf16(k16, d), 0.0f,
           p, seq);
      model::causal_softmax_rows(p, seq, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      round_rows_to_bf16(p, seq, p16, i1, rows, i1);
      gemm(Op::kN, Op::kN, rows, d, i1, 1.0f, in_bf16(p16, i1), in_bf16(v16, d), 0.0f,
           yh + static_cast<int64_t>(i0) * c, c);
    }
  });
}

void attention_backward_bf16(const float* dy, const float* qkv, const float* stats, float* dqkv, float* scratch,
                             int batch, int seq, int c, int heads, int block) {
  const int d = c / heads, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const int64_t row0 = static_cast<int64_t>(b) * seq;
    const float* q = qkv + row0 * ld + h * d;
    float* dq = dqkv + row0 * ld + h * d;
    float* dk = dq + c;
    float* dv = dq + 2 * c;
    const float* dyh = dy + row0 * c + h * d;
    const float* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    const float* row_inv_sum = row_max + seq;
    const int tile_rows = std::min(block, seq);
    float* p = scratch + static_cast<int64_t>(thread) * 2 * tile_rows * seq;  // [block, T]
    float* ds = p + static_cast<int64_t>(tile_rows) * seq;                     // [block, T]
    // q16, k16, v16, dy16 [T, D] each, then p16 and ds16 [block, T].
    uint16_t* q16 = bf16_staging(4 * static_cast<size_t>(seq) * d + 2 * static_cast<size_t>(tile_rows) * seq);
    uint16_t* k16 = q16 + static_cast<int64_t>(seq) * d;
    uint16_t* v16 = k16 + static_cast<int64_t>(seq) * d;
    uint16_t* dy16 = v16 + static_cast<int64_t>(seq) * d;
    uint16_t* p16 = dy16 + static_cast<int64_t>(seq) * d;
    uint16_t* ds16 = p16 + static_cast<int64_t>(tile_rows) * seq;
    for (int part = 0; part < 3; ++part) round_rows_to_bf16(q + part * c, ld, q16 + part * seq * d, d, seq, d);
    round_rows_to_bf16(dyh, c, dy16, d, seq, d);
    {
      const profile::Scope zeroing(profile::Part::kAttentionOther);
      for (int t = 0; t < seq; ++t)
        for (int j = 0; j < d; ++j) dk[static_cast<int64_t>(t) * ld + j] = dv[static_cast<int64_t>(t) * ld + j] = 0.0f;
    }
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      const uint16_t* qb = q16 + static_cast<int64_t>(i0) * d;
      const uint16_t* dyb = dy16 + static_cast<int64_t>(i0) * d;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, in_bf16(qb, d), in_bf16(k16, d), 0.0f, p, seq);
      model::causal_softmax_rows_from_stats(p, seq, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      gemm(Op::kN, Op::kT, rows, i1, d, 1.0f, in_bf16(dyb, d), in_bf16(v16, d), 0.0f, ds, seq);
      model::causal_softmax_backward_rows(p, ds, seq, i0, rows, i1, scale);
      round_rows_to_bf16(p, seq, p16, i1, rows, i1);
      round_rows_to_bf16(ds, seq, ds16, i1, rows, i1);
      gemm(Op::kN, Op::kN, rows, d, i1, 1.0f, in_bf16(ds16, i1), in_bf16(k16, d), 0.0f,
           dq + static_cast<int64_t>(i0) * ld, ld);
      gemm(Op::kT, Op::kN, i1, d, rows, 1.0f, in_bf16(p16, i1), in_bf16(dyb, d), 1.0f, dv, ld);
      gemm(Op::kT, Op::kN, i1, d, rows, 1.0f, in_bf16(ds16, i1), in_bf16(qb, d), 1.0f, dk, ld);
    }
  });
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
  if (block <= 0) block = attention_block(seq);
  if constexpr (std::is_same_v<T, float>) {
    if (attention_in_bf16()) return attention_forward_bf16(qkv, stats, y, scratch, batch, seq, c, heads, block);
  }
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
  if (block <= 0) block = attention_block(seq);
  if constexpr (std::is_same_v<T, float>) {
    if (attention_in_bf16())
      return attention_backward_bf16(dy, qkv, stats, dqkv, scratch, batch, seq, c, heads, block);
  }
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
