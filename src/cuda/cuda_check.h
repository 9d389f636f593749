// MXDDP_CUDA_CHECK(call, what...): runs a CUDA runtime call (or takes a launcher's returned error)
// and throws an Error carrying CUDA's name and message for it and the caller's context when it
// failed, as NCCL's check macros carry context up. And select_device, which every thread that works
// for a rank calls first. Host code only (it formats with fmt).
#pragma once

#include <cuda_runtime_api.h>

#include <mxddp/core.h>

#define MXDDP_CUDA_CHECK(call, ...)                                                                          \
  do {                                                                                                       \
    const auto mxddp_cuda_status_ = static_cast<cudaError_t>(call);                                          \
    if (mxddp_cuda_status_ != cudaSuccess) [[unlikely]]                                                      \
      MXDDP_FAIL("{}: {} ({})", ::fmt::format(__VA_ARGS__), cudaGetErrorString(mxddp_cuda_status_),          \
                 cudaGetErrorName(mxddp_cuda_status_));                                                      \
  } while (0)

namespace mxddp {

// Makes `device` the calling thread's current device, and leaves it so, as torch.cuda.set_device
// does: restoring a thread that never chose one (a collective's progress thread, a watchdog) would
// create a context on device 0 in every rank.
inline void select_device(int device) {
  int current = -1;
  MXDDP_CUDA_CHECK(cudaGetDevice(&current), "reading the current device");
  if (current != device) MXDDP_CUDA_CHECK(cudaSetDevice(device), "selecting device {}", device);
}

}  // namespace mxddp
