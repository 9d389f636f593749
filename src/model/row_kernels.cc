// row_kernels.h: picks the widest ISA table once and splits rows (or elements, or columns) over
// the calling thread's OpenMP threads. The arithmetic is all in row_kernels_simd.inc.
#include "row_kernels.h"

#include "../core/parallel_elements.h"
#include "step_profile.h"

#include <omp.h>

#include <algorithm>

namespace mxddp::model {

namespace row_kernels {

namespace {
// The avx512 table is compiled for F and BW (BW: 16-bit lanes, for the BF16 casts), every
// AVX-512 CPU but the Xeon Phi has both; the avx512bf16 table adds VL and BF16.
bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
bool has_avx512bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
}  // namespace

const RowKernelTable& active() {
  static const RowKernelTable& table = [] () -> const RowKernelTable& {
    if (has_avx512bf16()) return row_kernels_avx512bf16();
    if (has_avx512()) return row_kernels_avx512();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return row_kernels_avx2();
    return row_kernels_base();
  }();
  return table;
}

std::vector<const RowKernelTable*> supported() {
  std::vector<const RowKernelTable*> tables{&row_kernels_base()};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) tables.push_back(&row_kernels_avx2());
  if (has_avx512()) tables.push_back(&row_kernels_avx512());
  if (has_avx512bf16()) tables.push_back(&row_kernels_avx512bf16());
  return tables;
}

}  // namespace row_kernels

namespace {

using row_kernels::active;
using row_kernels::RowKernelTable;

// Rows ahead that round_rows_to_bf16 prefetches, and a cache line's floats.
constexpr int64_t kPrefetchRows = 16;
constexpr int kFloatsPerLine = 16;

// Below this many elements of work a parallel region costs more than it saves.
constexpr int64_t kMinParallelElements = 1 << 14;

// f(begin, end) over [0, items), one contiguous range per thread (up to one per item) once the
// work reaches kMinParallelElements. Which thread runs a range never changes what is computed for
// it.
template <typename F>
void parallel_ranges(int64_t items, int64_t elements_per_item, F&& f) {
  const int64_t threads =
      items * elements_per_item < kMinParallelElements ? 1 : std::min<int64_t>(omp_get_max_threads(), items);
  parallel_split(items, threads, /*align=*/1, f);
}

// Columns in blocks of 16 (a cache line of f32, an AVX-512 register), for the column-order sums.
constexpr int kColumnBlock = 16;

template <typename F>
void parallel_column_blocks(int rows, int cols, F&& f) {
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  parallel_ranges(blocks, int64_t{rows} * kColumnBlock, [&](int64_t b0, int64_t b1) {
    f(static_cast<int>(b0 * kColumnBlock), static_cast<int>(std::min<int64_t>(b1 * kColumnBlock, cols)));
  });
}

}  // namespace

void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd, int n,
                       int c) {
  const profile::Scope timed(profile::Part::kLayerNorm);
  const RowKernelTable& k = active();
  parallel_ranges(n, c, [&](int64_t r0, int64_t r1) {
    k.layernorm_forward(x + r0 * c, w, b, y + r0 * c, mean + r0, rstd + r0, r1 - r0, c, static_cast<float>(kLayerNormEps));
  });
}

void layernorm_forward_bf16(const float* x, const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                            int n, int c) {
  const profile::Scope timed(profile::Part::kLayerNorm);
  const RowKernelTable& k = active();
  parallel_ranges(n, c, [&](int64_t r0, int64_t r1) {
    k.layernorm_forward_bf16(x + r0 * c, w, b, y + r0 * c, mean + r0, rstd + r0, r1 - r0, c,
                             static_cast<float>(kLayerNormEps));
  });
}

void layernorm_backward(const float* dy, const float* x, const float* w, const float* mean, const float* rstd,
                        float* dx, float* dw, float* db, int n, int c) {
  const profile::Scope timed(profile::Part::kLayerNorm);
  const RowKernelTable& k = active();
  parallel_ranges(n, c, [&](int64_t r0, int64_t r1) {
    k.layernorm_backward_data(dy + r0 * c, x + r0 * c, w, mean + r0, rstd + r0, dx + r0 * c, r1 - r0, c);
  });
  parallel_column_blocks(n, c, [&](int j0, int j1) { k.layernorm_param_grads(dy, x, mean, rstd, dw, db, n, c, j0, j1); });
}

void gelu_forward(const float* x, float* y, int64_t count) {
  const profile::Scope timed(profile::Part::kGelu);
  const RowKernelTable& k = active();
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) { k.gelu_forward(x + i0, y + i0, i1 - i0); });
}

void gelu_forward_bf16(const float* x, uint16_t* y, int64_t count) {
  const profile::Scope timed(profile::Part::kGelu);
  const RowKernelTable& k = active();
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) { k.gelu_forward_bf16(x + i0, y + i0, i1 - i0); });
}

void gelu_backward(const float* x, const float* dy, float* dx, int64_t count) {
  const profile::Scope timed(profile::Part::kGelu);
  const RowKernelTable& k = active();
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) { k.gelu_backward(x + i0, dy + i0, dx + i0, i1 - i0); });
}

void gelu_forward_backward_bf16(const float* x, const float* dy, uint16_t* y16, float* dx, uint16_t* dx16,
                                int64_t count) {
  const profile::Scope timed(profile::Part::kGelu);
  const RowKernelTable& k = active();
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) {
    k.gelu_forward_backward_bf16(x + i0, dy + i0, y16 + i0, dx + i0, dx16 + i0, i1 - i0);
  });
}

double cross_entropy(float* logits, const int32_t* targets, float* row_loss, int n, int v, float grad_scale) {
  const profile::Scope timed(profile::Part::kCrossEntropy);
  const RowKernelTable& k = active();
  parallel_ranges(n, v, [&](int64_t r0, int64_t r1) {
    k.cross_entropy(logits + r0 * v, targets + r0, row_loss + r0, r1 - r0, v, grad_scale);
  });
  double loss = 0;
  for (int i = 0; i < n; ++i) loss += static_cast<double>(row_loss[i]);
  return loss;
}

void add_column_sums(const float* x, int rows, int cols, float* out) {
  const profile::Scope timed(profile::Part::kElementwise);
  const RowKernelTable& k = active();
  parallel_column_blocks(rows, cols, [&](int j0, int j1) { k.column_sums(x, rows, cols, j0, j1, out); });
}

void add_in_place(float* y, const float* x, int64_t count) {
  const profile::Scope timed(profile::Part::kElementwise);
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) y[i] += x[i];
  });
}

void round_to_bf16(const float* x, uint16_t* y, int64_t count) {
  const profile::Scope timed(profile::Part::kCasts);
  const RowKernelTable& k = active();
  parallel_ranges(count, 1, [&](int64_t i0, int64_t i1) { k.round_to_bf16(x + i0, y + i0, i1 - i0); });
}

void round_rows_to_bf16(const float* x, int64_t ld, uint16_t* y, int64_t rows, int cols) {
  const profile::Scope timed(profile::Part::kCasts);
  const RowKernelTable& k = active();
  // Rows more than a page apart (a head's slice of qkv: 3C floats) defeat the hardware prefetcher,
  // so each row would be a demand miss: ask for rows ahead while rounding this one.
  for (int64_t i = 0; i < rows; ++i) {
    if (i + kPrefetchRows < rows)
      for (int j = 0; j < cols; j += kFloatsPerLine) __builtin_prefetch(x + (i + kPrefetchRows) * ld + j, 0);
    k.round_to_bf16(x + i * ld, y + i * cols, cols);
  }
}

void causal_softmax_rows(float* p, int ld, int first_row, int rows, int width, float* row_max, float* row_inv_sum) {
  const profile::Scope timed(profile::Part::kAttentionSoftmax);
  active().causal_softmax(p, ld, first_row, rows, width, row_max, row_inv_sum);
}

void causal_softmax_rows_from_stats(float* p, int ld, int first_row, int rows, int width, const float* row_max,
                                    const float* row_inv_sum) {
  const profile::Scope timed(profile::Part::kAttentionSoftmax);
  active().causal_softmax_from_stats(p, ld, first_row, rows, width, row_max, row_inv_sum);
}

void causal_softmax_backward_rows(const float* p, float* ds, int ld, int first_row, int rows, int width, float scale) {
  const profile::Scope timed(profile::Part::kAttentionSoftmax);
  active().causal_softmax_backward(p, ds, ld, first_row, rows, width, scale);
}

}  // namespace mxddp::model
