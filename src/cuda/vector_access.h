// Vector loads and stores for the wide kernels (mxfp8_wide.h, adamw_wide.h), written once for both
// sides: on the device, one 8- or 16-byte memory instruction at an address aligned to its size;
// on the host, where the tests run the same per-thread code, memcpy of the same bytes.
#pragma once

#include <cstdint>
#include <cstring>

#include <mxddp/host_device.h>

namespace mxddp::cuda_kernels {

template <typename V>
MXDDP_HOST_DEVICE inline V load_vec(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const V*>(p);
#else
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

template <typename V>
MXDDP_HOST_DEVICE inline void store_vec(void* p, const V& v) {
#if defined(__CUDA_ARCH__)
  *static_cast<V*>(p) = v;
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

// Whether p may be read with such instructions of the given size: core.h's is_aligned, which the
// .cu files cannot include (nvcc does not compile core.h's fmt).
inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace mxddp::cuda_kernels
