// causal_attention.h: block-causal, flash-style attention forward and backward: f32 (with f32 or, under
// BF16 compute, BF16 products on dense staged operands) and f64.
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


// Under BF16 compute (the thread's gemm dtype kBF16 on a CPU with native BF16), f32 attention
// multiplies BF16 operands that are dense: each head's q, k, v (and dy) rounded once into
// [T, D] copies, each block's P and dS rounded into [rows, i1], and every product's C dense too
// (the scores with ld i1, the block outputs and the dk, dv sums [T, D]). Dense operands are what
// oneDNN 2.6 runs on its AMX kernel (brg:avx512_core_amx_bf16); the same products on the head's
// slices of qkv (ld 3C) or into a C with ld T run on gemm:jit at half that speed or less (measured,
// docs/compute.md). The staging is per thread, like gemm's own BF16 staging: grown on the first
// step, then reused (T D numbers per operand, not T x T).
struct Bf16Staging {
  std::vector<uint16_t> q, k, v, dy;  // [T, D] each, the head's operands rounded
  std::vector<uint16_t> p, ds;        // [rows, i1] dense, the block's P and dS rounded
  std::vector<float> out;             // [block, D] dense, a block's y or dq before its strided copy
  std::vector<float> dk, dv;          // [T, D] dense f32 sums over the query blocks

  void reserve(int seq, int d, int block) {
    const size_t td = static_cast<size_t>(seq) * d, bt = static_cast<size_t>(block) * seq;
    for (std::vector<uint16_t>* x : {&q, &k, &v, &dy}) if (x->size() < td) x->resize(td);
    for (std::vector<uint16_t>* x : {&p, &ds}) if (x->size() < bt) x->resize(bt);
    if (out.size() < static_cast<size_t>(block) * d) out.resize(static_cast<size_t>(block) * d);
    for (std::vector<float>* x : {&dk, &dv}) if (x->size() < td) x->resize(td);
  }
};

Bf16Staging& bf16_staging(int seq, int d, int block) {
  thread_local Bf16Staging staging;
  staging.reserve(seq, d, block);
  return staging;
}

bool bf16_products() { return gemm_dtype() == GemmDType::kBF16 && bf16_gemm_supported(); }

// dst [rows, d] dense = src [rows, d] (leading dimension ld) rounded to BF16, on this thread.
void round_rows(const float* src, int ld, uint16_t* dst, int rows, int d) { round_rows_to_bf16(src, ld, dst, rows, d); }

void round_dense(const float* src, uint16_t* dst, int64_t count) { round_to_bf16(src, dst, count); }

// dst [rows, d] (leading dimension ld) = src [rows, d] dense.
// Rows more than a page apart defeat the hardware prefetcher: the rows 8 ahead are asked for
// while this one is copied.
void copy_rows(const float* src, float* dst, int ld, int rows, int d) {
  constexpr int kAhead = 8, kFloatsPerLine = 16;
  for (int t = 0; t < rows; ++t) {
    if (t + kAhead < rows)
      for (int j = 0; j < d; j += kFloatsPerLine) __builtin_prefetch(dst + static_cast<int64_t>(t + kAhead) * ld + j, 1);
    std::copy_n(src + static_cast<int64_t>(t) * d, d, dst + static_cast<int64_t>(t) * ld);
  }
}

GemmOperand bf16_operand(const uint16_t* data, int ld) { return GemmOperand{data, ld, true}; }

// attention_forward / attention_backward with BF16 products (see Bf16Staging); the softmax, its
// statistics and every sum stay f32, and backward's scores are forward's bits (the same product
// on the same operands).
void attention_forward_bf16(const float* qkv, float* stats, float* y, float* scratch, int batch, int seq, int c,
                            int heads, int block) {
  const int d = c / heads, ld = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for_each_head(batch, heads, [&](int b, int h, int thread) {
    const float* q = qkv + static_cast<int64_t>(b) * seq * ld + h * d;
    float* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    float* row_inv_sum = row_max + seq;
    float* yh = y + static_cast<int64_t>(b) * seq * c + h * d;
    float* p = scratch + static_cast<int64_t>(thread) * 2 * std::min(block, seq) * seq;  // [rows, i1] per block
    Bf16Staging& st = bf16_staging(seq, d, std::min(block, seq));
    round_rows(q, ld, st.q.data(), seq, d);
    round_rows(q + c, ld, st.k.data(), seq, d);
    round_rows(q + 2 * c, ld, st.v.data(), seq, d);
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      gemm(Op::kN, Op::kT, rows, i1, d, scale, bf16_operand(st.q.data() + static_cast<int64_t>(i0) * d, d),
           bf16_operand(st.k.data(), d), 0.0f, p, i1);
      model::causal_softmax_rows(p, i1, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      round_dense(p, st.p.data(), static_cast<int64_t>(rows) * i1);
      gemm(Op::kN, Op::kN, rows, d, i1, 1.0f, bf16_operand(st.p.data(), i1), bf16_operand(st.v.data(), d), 0.0f,
           st.out.data(), d);
      copy_rows(st.out.data(), yh + static_cast<int64_t>(i0) * c, c, rows, d);
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
    const float* row_max = stats + (static_cast<int64_t>(b) * heads + h) * 2 * seq;
    const float* row_inv_sum = row_max + seq;
    float* p = scratch + static_cast<int64_t>(thread) * 2 * std::min(block, seq) * seq;  // [rows, i1] per block
    float* ds = p + static_cast<int64_t>(std::min(block, seq)) * seq;                     // [rows, i1] per block
    Bf16Staging& st = bf16_staging(seq, d, std::min(block, seq));
    round_rows(q, ld, st.q.data(), seq, d);
    round_rows(q + c, ld, st.k.data(), seq, d);
    round_rows(q + 2 * c, ld, st.v.data(), seq, d);
    round_rows(dy + row0 * c + h * d, c, st.dy.data(), seq, d);
    std::fill_n(st.dk.data(), static_cast<int64_t>(seq) * d, 0.0f);
    std::fill_n(st.dv.data(), static_cast<int64_t>(seq) * d, 0.0f);
    for (int i0 = 0; i0 < seq; i0 += block) {
      const int i1 = std::min(seq, i0 + block), rows = i1 - i0;
      const GemmOperand qb = bf16_operand(st.q.data() + static_cast<int64_t>(i0) * d, d);
      const GemmOperand dyb = bf16_operand(st.dy.data() + static_cast<int64_t>(i0) * d, d);
      gemm(Op::kN, Op::kT, rows, i1, d, scale, qb, bf16_operand(st.k.data(), d), 0.0f, p, i1);
      model::causal_softmax_rows_from_stats(p, i1, i0, rows, i1, row_max + i0, row_inv_sum + i0);
      gemm(Op::kN, Op::kT, rows, i1, d, 1.0f, dyb, bf16_operand(st.v.data(), d), 0.0f, ds, i1);
      model::causal_softmax_backward_rows(p, ds, i1, i0, rows, i1, scale);
      round_dense(p, st.p.data(), static_cast<int64_t>(rows) * i1);
      round_dense(ds, st.ds.data(), static_cast<int64_t>(rows) * i1);
      gemm(Op::kN, Op::kN, rows, d, i1, 1.0f, bf16_operand(st.ds.data(), i1), bf16_operand(st.k.data(), d), 0.0f,
           st.out.data(), d);
      copy_rows(st.out.data(), dq + static_cast<int64_t>(i0) * ld, ld, rows, d);
      gemm(Op::kT, Op::kN, i1, d, rows, 1.0f, bf16_operand(st.p.data(), i1), dyb, 1.0f, st.dv.data(), d);
      gemm(Op::kT, Op::kN, i1, d, rows, 1.0f, bf16_operand(st.ds.data(), i1), qb, 1.0f, st.dk.data(), d);
    }
    copy_rows(st.dk.data(), dq + c, ld, seq, d);
    copy_rows(st.dv.data(), dq + 2 * c, ld, seq, d);
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
  if constexpr (std::is_same_v<T, float>)
    if (bf16_products()) return attention_forward_bf16(qkv, stats, y, scratch, batch, seq, c, heads, block);
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
  if constexpr (std::is_same_v<T, float>)
    if (bf16_products()) return attention_backward_bf16(dy, qkv, stats, dqkv, scratch, batch, seq, c, heads, block);
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
