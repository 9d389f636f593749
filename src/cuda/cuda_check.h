// MXDDP_CUDA_CHECK(call, what...): runs a CUDA runtime call (or takes a launcher's returned error)
// and throws an Error carrying CUDA's name and message for it and the caller's context when it
// failed, as NCCL's check macros carry context up. Host code only (it formats with fmt).
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
