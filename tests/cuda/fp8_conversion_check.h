// fp8_conversion_check.cu's entry point, for kernels_test.cc (a host file).
#pragma once

#include <cstdint>

namespace mxddp::testing {

// How many of the 2^32 floats the device's FP8 conversion encodes differently from fp8::encode
// (E4M3 or E5M2); -1 when a CUDA call failed.
int64_t fp8_conversion_mismatches(bool e4m3);

}  // namespace mxddp::testing
