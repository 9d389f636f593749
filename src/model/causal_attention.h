// Causal multi-head self-attention over a fused qkv [B*T, 3C] (q | k | v, head h at columns h*D
// of each third, D = C / heads), computing only what causality needs: the T dimension is cut into
// blocks of `block` rows, and query block [i0, i1) is multiplied only with keys [0, i1), so no
// score above the diagonal block is ever computed, stored or read (about (1 + block/T) / 2 of the
// full T x T products). Heads of the batch, (b, h) pairs, are spread over the calling thread's
// OpenMP threads, each running its products single-threaded.
//
// Flash-style memory: the probabilities are never kept. Forward saves each query row's softmax
// statistics, stats [B, heads, 2, T] (the row's max score, then 1 / the sum of its exponentials),
// and backward rebuilds a block's probabilities from its recomputed scores and those statistics,
// bit for bit what forward used. What lives between forward and backward is 2T numbers per head
// instead of T x T; the price is one more score product and exp per block in backward. Both
// passes work in a per-thread scratch of two [block, T] tiles.
//
// Under BF16 compute (--bf16: the thread's gemm dtype kBF16, on a CPU with native BF16) the
// products run in BF16 on dense operands: each head's q, k, v (and dy) rounded once into dense
// [T, D] BF16 copies, each block's P and dS rounded into dense [rows, i1], and every product's C
// dense (the scores with ld i1, a block's y or dq and the head's dk, dv sums in dense f32 tiles,
// copied into place after). oneDNN 2.6 runs these small products (64 query rows x D x up to T
// keys) on its AMX kernel only when every operand is dense: on the head's slices of qkv (ld 3C),
// or into a C with ld T, it picks gemm:jit, and BF16 attention on those measured slower than f32
// (docs/compute.md, issue 28). The softmax, its statistics and every sum stay f32. The dense
// copies live in a per-thread staging (like gemm's own BF16 staging: grown on the first step,
// reused after): 4 [T, D] BF16 operands, 2 [block, T] BF16 tiles and 2 [T, D] + 1 [block, D] f32
// tiles per thread, none of them T x T. Without native BF16, kBF16 runs the f32 path (its bits).
//
// f32 trains; f64 (the same code) is what tests/model/gpt_grad_test.cc checks against finite
// differences, and tests/model/causal_attention_test.cc checks f32 and BF16 products against a
// full-matrix f64 reference.
#pragma once

#include <cstdint>

namespace mxddp::model {

// The block when none is given: 64 rows, the fastest measured on the small preset's T = 256
// (bench/attention_bench; 32 and 128 were slower), or T/2 for shorter sequences so the block above
// the diagonal is still skipped (at T = 64 one full product would be faster, since each product
// costs a fixed overhead, but computes the masked half).
int attention_block(int seq);

// Elements of the statistics attention_forward saves for backward: [B, heads, 2, T].
int64_t attention_stats_numel(int batch, int seq, int heads);

// Elements of the scratch both passes need: two [block, T] tiles per thread that runs them, the
// calling thread's OpenMP count when threads is 0. block 0 means attention_block(seq), in this and
// the functions below.
int64_t attention_scratch_numel(int seq, int threads = 0, int block = 0);

// y [B*T, C] and stats from qkv; scratch of attention_scratch_numel(seq, block) (contents unused).
template <typename T>
void attention_forward(const T* qkv, T* stats, T* y, T* scratch, int batch, int seq, int c, int heads,
                       int block = 0);

// dqkv [B*T, 3C] (overwritten) from dy [B*T, C], the same qkv and forward's stats; scratch as
// forward's.
template <typename T>
void attention_backward(const T* dy, const T* qkv, const T* stats, T* dqkv, T* scratch, int batch, int seq, int c,
                        int heads, int block = 0);

}  // namespace mxddp::model
