// The per-element optimizer kernels over one contiguous run of a shard: AdamW and SGD with
// momentum, with the BF16 (or f32) staging of the result fused in; each element's update is
// optim_element.h's, which the CUDA kernels share. Templated on the grad and param
// element types so the inner loops are branch-free and vectorize; the scalar reference they are
// tested against is optim_reference.h in tests/.
#pragma once

#include <cmath>
#include <cstdint>

#include <mxddp/core.h>

#include "optim_element.h"

namespace mxddp::optim_kernel {

template <typename G, typename P>
void adamw(const G* __restrict grad, float* __restrict main, float* __restrict exp_avg, float* __restrict exp_avg_sq,
           P* __restrict param, int64_t n, const AdamScalars& s) {
  const AdamScalars sc = s;  // a local copy: the stores below cannot alias it
  const float decay = 1.0f - sc.lr * sc.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const AdamElement e = adamw_element(load(grad, i), main[i], exp_avg[i], exp_avg_sq[i], sc, decay);
    exp_avg[i] = e.exp_avg;
    exp_avg_sq[i] = e.exp_avg_sq;
    main[i] = e.main;
    store(param, i, e.main);
  }
}

template <typename G, typename P>
void sgd(const G* __restrict grad, float* __restrict main, float* __restrict momentum, P* __restrict param, int64_t n,
         const SgdScalars& s) {
  const SgdScalars sc = s;
  for (int64_t i = 0; i < n; ++i) {
    const SgdElement e = sgd_element(load(grad, i), main[i], momentum[i], sc);
    momentum[i] = e.momentum;
    main[i] = e.main;
    store(param, i, e.main);
  }
}

// Eight independent partial sums: a single f64 accumulator is one long dependency chain (the
// compiler may not reorder FP adds), which made this pass slower than the whole AdamW update.
template <typename G>
double sum_of_squares(const G* __restrict grad, int64_t n) {
  double part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) {
      const double g = load(grad, i + k);
      part[k] += g * g;
    }
  for (; i < n; ++i) {
    const double g = load(grad, i);
    part[0] += g * g;
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

}  // namespace mxddp::optim_kernel
