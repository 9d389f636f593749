// The wide AdamW kernel's per-thread work (optim_cuda.cu's adamw_wide_kernel), as host-and-device
// functions so that tests/cuda/wide_kernels_host_test.cc runs every thread's share on the CPU against
// the CPU step (adamw_kernel.h) where no GPU is. Each element is optim_element.h's adamw_element,
// the CPU's own, so the wide step equals the CPU step bit for bit as the element kernel's does.
//
// Why wide: a thread updates 4 consecutive elements with 16-byte loads and stores (8-byte for bf16
// grads or params), a quarter of the element kernel's memory instructions and four times its bytes
// in flight per thread. It takes a shard whose f32 pointers are 16-byte aligned and bf16 ones
// 8-byte aligned (adamw_wide_fits); group g is elements [4g, 4g + 4), and the last n % 4 elements
// go one per thread (adamw_at).
#pragma once

#include <cstdint>

#include <vector_functions.h>
#include <vector_types.h>

#include "cuda/vector_access.h"
#include "optim_element.h"

namespace mxddp::cuda_kernels::wide {

inline constexpr int kAdamGroup = 4;

MXDDP_HOST_DEVICE inline void load4(const float* p, int64_t i, float v[kAdamGroup]) {
  const float4 q = load_vec<float4>(p + i);
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
MXDDP_HOST_DEVICE inline void load4(const bf16_bits* p, int64_t i, float v[kAdamGroup]) {
  const uint2 q = load_vec<uint2>(p + i);
  v[0] = bf16_to_f32(static_cast<bf16_bits>(q.x & 0xffffu)), v[1] = bf16_to_f32(static_cast<bf16_bits>(q.x >> 16));
  v[2] = bf16_to_f32(static_cast<bf16_bits>(q.y & 0xffffu)), v[3] = bf16_to_f32(static_cast<bf16_bits>(q.y >> 16));
}
MXDDP_HOST_DEVICE inline void store4(float* p, int64_t i, const float v[kAdamGroup]) {
  store_vec(p + i, make_float4(v[0], v[1], v[2], v[3]));
}
MXDDP_HOST_DEVICE inline void store4(bf16_bits* p, int64_t i, const float v[kAdamGroup]) {
  store_vec(p + i, make_uint2(uint32_t{f32_to_bf16(v[0])} | (uint32_t{f32_to_bf16(v[1])} << 16),
                              uint32_t{f32_to_bf16(v[2])} | (uint32_t{f32_to_bf16(v[3])} << 16)));
}
MXDDP_HOST_DEVICE inline void store4(optim_kernel::NoStage*, int64_t, const float*) {}

// Element i, alone (the element kernel's body, and the wide kernel's tail).
template <typename G, typename P>
MXDDP_HOST_DEVICE inline void adamw_at(const G* grad, float* main, float* exp_avg, float* exp_avg_sq, P* param,
                                       int64_t i, const optim_kernel::AdamScalars& s, float decay) {
  const optim_kernel::AdamElement e =
      optim_kernel::adamw_element(optim_kernel::load(grad, i), main[i], exp_avg[i], exp_avg_sq[i], s, decay);
  exp_avg[i] = e.exp_avg;
  exp_avg_sq[i] = e.exp_avg_sq;
  main[i] = e.main;
  optim_kernel::store(param, i, e.main);
}

// Elements [4g, 4g + 4).
template <typename G, typename P>
MXDDP_HOST_DEVICE inline void adamw_group(const G* grad, float* main, float* exp_avg, float* exp_avg_sq, P* param,
                                          int64_t g, const optim_kernel::AdamScalars& s, float decay) {
  const int64_t i = g * kAdamGroup;
  float gv[kAdamGroup], p[kAdamGroup], m[kAdamGroup], v[kAdamGroup];
  load4(grad, i, gv);
  load4(main, i, p);
  load4(exp_avg, i, m);
  load4(exp_avg_sq, i, v);
  for (int k = 0; k < kAdamGroup; ++k) {
    const optim_kernel::AdamElement e = optim_kernel::adamw_element(gv[k], p[k], m[k], v[k], s, decay);
    p[k] = e.main, m[k] = e.exp_avg, v[k] = e.exp_avg_sq;
  }
  store4(exp_avg, i, m);
  store4(exp_avg_sq, i, v);
  store4(main, i, p);
  store4(param, i, p);
}

// grad_bytes, param_bytes: the element sizes (param_bytes 0 when nothing is staged).
inline bool adamw_wide_fits(const void* grad, int grad_bytes, const float* main, const float* exp_avg,
                            const float* exp_avg_sq, const void* param, int param_bytes) {
  return aligned(grad, 4 * grad_bytes) && aligned(main, 16) && aligned(exp_avg, 16) && aligned(exp_avg_sq, 16) &&
         (param_bytes == 0 || aligned(param, 4 * param_bytes));
}

}  // namespace mxddp::cuda_kernels::wide
