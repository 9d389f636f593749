// The per-element optimizer kernels over one contiguous run of a shard: AdamW and SGD with
// momentum, with the BF16 (or f32) staging of the result fused in. Templated on the grad and param
// element types so the inner loops are branch-free and vectorize; the scalar reference they are
// tested against is optim_reference.h in tests/.
#pragma once

#include <cmath>
#include <cstdint>

#include <mxddp/core.h>

namespace mxddp::optim_kernel {

// weight_decay is AdamW's decoupled decay; l2 is torch's Adam's weight decay (added to the grad).
struct AdamScalars {
  float lr, weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, clip_coeff;
  float l2 = 0.0f;
};
struct SgdScalars {
  float lr, weight_decay, momentum, clip_coeff;
};

// A staging target that stores nothing: the update without staging (MXFP8 reuse stages later).
struct NoStage {};
inline void store(NoStage*, int64_t, float) {}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16_bits* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(bf16_bits* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

template <typename G, typename P>
void adamw(const G* __restrict grad, float* __restrict main, float* __restrict exp_avg, float* __restrict exp_avg_sq,
           P* __restrict param, int64_t n, const AdamScalars& s) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const float g = load(grad, i) * s.clip_coeff + s.l2 * main[i];
    float p = main[i] * decay;
    const float m = s.beta1 * exp_avg[i] + (1.0f - s.beta1) * g;
    const float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
    p -= s.step_size * m / (std::sqrt(v) / s.bias_correction2_sqrt + s.eps);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    main[i] = p;
    store(param, i, p);
  }
}

template <typename G, typename P>
void sgd(const G* __restrict grad, float* __restrict main, float* __restrict momentum, P* __restrict param, int64_t n,
         const SgdScalars& s) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = main[i];
    const float g = load(grad, i) * s.clip_coeff + s.weight_decay * p;
    const float buf = s.momentum * momentum[i] + g;
    momentum[i] = buf;
    main[i] = p - s.lr * buf;
    store(param, i, main[i]);
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
