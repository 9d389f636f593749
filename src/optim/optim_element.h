// One element of the optimizer updates, shared by the CPU kernels (adamw_kernel.h) and the CUDA
// ones (optim_cuda.cu): compiled for both, so a device step equals the CPU step bit for bit (the
// device code is built without fused multiply-adds, and f32 division and sqrt are correctly
// rounded on both). Plain C++ on host_device.h only (the .cu files cannot read core.h).
#pragma once

#include <cmath>
#include <cstdint>

#include <mxddp/host_device.h>

namespace mxddp::optim_kernel {

// weight_decay is AdamW's decoupled decay; l2 is torch's Adam's weight decay (added to the grad).
struct AdamScalars {
  float lr, weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, clip_coeff;
  float l2 = 0.0f;
};
struct SgdScalars {
  float lr, weight_decay, momentum, clip_coeff;
};

MXDDP_HOST_DEVICE inline float load(const float* p, int64_t i) { return p[i]; }
MXDDP_HOST_DEVICE inline float load(const bf16_bits* p, int64_t i) { return bf16_to_f32(p[i]); }
MXDDP_HOST_DEVICE inline void store(float* p, int64_t i, float x) { p[i] = x; }
MXDDP_HOST_DEVICE inline void store(bf16_bits* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

// AdamW on element i: g the (unclipped) grad; main, exp_avg, exp_avg_sq updated in place; returns
// the new param value. decay = 1 - lr * weight_decay, computed once by the caller.
MXDDP_HOST_DEVICE inline float adamw_element(float grad, float& main, float& exp_avg, float& exp_avg_sq,
                                             const AdamScalars& s, float decay) {
  const float g = grad * s.clip_coeff + s.l2 * main;
  float p = main * decay;
  const float m = s.beta1 * exp_avg + (1.0f - s.beta1) * g;
  const float v = s.beta2 * exp_avg_sq + (1.0f - s.beta2) * g * g;
  p -= s.step_size * m / (std::sqrt(v) / s.bias_correction2_sqrt + s.eps);
  exp_avg = m;
  exp_avg_sq = v;
  main = p;
  return p;
}

// SGD with momentum on element i; returns the new param value.
MXDDP_HOST_DEVICE inline float sgd_element(float grad, float& main, float& momentum, const SgdScalars& s) {
  const float p = main;
  const float g = grad * s.clip_coeff + s.weight_decay * p;
  const float buf = s.momentum * momentum + g;
  momentum = buf;
  main = p - s.lr * buf;
  return main;
}

}  // namespace mxddp::optim_kernel
