// The FP8 element encoder for the CPU codec's loops: fp8_element.h's arithmetic (shared with the
// CUDA kernels), with the format as a compile-time constant so the loops fold it.
#pragma once

#include <mxddp/quant.h>

#include "fp8_element.h"

namespace mxddp::fp8 {

static_assert(kE8M0NanCode == kE8M0Nan);
static_assert(kMxBlock == kMxBlockSize);

inline const Spec& spec(Fp8Format f) { return f == Fp8Format::kE4M3 ? kE4M3 : kE5M2; }
template <Fp8Format F>
inline constexpr const Spec& kSpec = F == Fp8Format::kE4M3 ? kE4M3 : kE5M2;

}  // namespace mxddp::fp8
