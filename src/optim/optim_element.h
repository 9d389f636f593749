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
// A staging target that stores nothing: the update without staging (MXFP8 reuse stages later).
struct NoStage {};
MXDDP_HOST_DEVICE inline void store(NoStage*, int64_t, float) {}

// AdamW on one element: g the (unclipped) grad, the element's main param and moments in; their new
// values out. decay = 1 - lr * weight_decay, computed once by the caller. Values in and out rather
// than references, so that the CPU loops keep their __restrict guarantees and vectorize.
struct AdamElement {
  float main, exp_avg, exp_avg_sq;
};
MXDDP_HOST_DEVICE inline AdamElement adamw_element(float grad, float main, float exp_avg, float exp_avg_sq,
                                                   const AdamScalars& s, float decay) {
  const float g = grad * s.clip_coeff + s.l2 * main;
  float p = main * decay;
  const float m = s.beta1 * exp_avg + (1.0f - s.beta1) * g;
  const float v = s.beta2 * exp_avg_sq + (1.0f - s.beta2) * g * g;
  p -= s.step_size * m / (std::sqrt(v) / s.bias_correction2_sqrt + s.eps);
  return {p, m, v};
}

// SGD with momentum on one element: the new main param and momentum buffer.
struct SgdElement {
  float main, momentum;
};
MXDDP_HOST_DEVICE inline SgdElement sgd_element(float grad, float main, float momentum, const SgdScalars& s) {
  const float g = grad * s.clip_coeff + s.weight_decay * main;
  const float buf = s.momentum * momentum + g;
  return {main - s.lr * buf, buf};
}

}  // namespace mxddp::optim_kernel
