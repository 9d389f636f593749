// Causal multi-head self-attention over a fused qkv [B*T, 3C] (q | k | v, head h at columns h*D
// of each third, D = C / heads), computing only what causality needs: the T dimension is cut into
// blocks of `block` rows, and query block [i0, i1) is multiplied only with keys [0, i1), so no
// score above the diagonal block is ever computed, stored or read (about (1 + block/T) / 2 of the
// full T x T products). Heads of the batch, (b, h) pairs, are spread over the calling thread's
// OpenMP threads, each running its products single-threaded.
//
// probs [B, heads, T, T] keeps the softmax for backward: row i holds 0..i, zeros up to the end of
// its block, and nothing beyond (those entries are never written or read).
//
// f32 trains; f64 (the same code) is what tests/model/gpt_grad_test.cc checks against finite
// differences, and tests/model/causal_attention_test.cc checks f32 against a full-matrix f64
// reference.
#pragma once

#include <cstdint>

namespace mxddp::model {

// The block when none is given: 64 rows, the fastest measured on the small preset's T = 256
// (bench/attention_bench: 0.72x the time of full products there; 32 and 128 were slower), or T/2
// for shorter sequences so the block above the diagonal is still skipped (at T = 64 one full
// product would be faster, since each product costs a fixed overhead, but computes the masked half).
int attention_block(int seq);

// y [B*T, C] from qkv; probs as above. block 0 means attention_block(seq).
template <typename T>
void attention_forward(const T* qkv, T* probs, T* y, int batch, int seq, int c, int heads,
                       int block = 0);

// Elements of the scratch attention_backward needs: a [T, T] score gradient per thread of the
// calling thread's OpenMP count.
int64_t attention_backward_scratch_numel(int seq);

// dqkv [B*T, 3C] (overwritten) from dy [B*T, C]; scratch of attention_backward_scratch_numel(seq).
template <typename T>
void attention_backward(const T* dy, const T* qkv, const T* probs, T* dqkv, T* scratch, int batch, int seq, int c,
                        int heads, int block = 0);

}  // namespace mxddp::model
