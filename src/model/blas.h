// The name the model's kernels (gpt_ops.h) include for their matrix products: the products
// themselves, one entry point per precision, are declared in gemm.h and run on oneDNN (f32, and
// BF16 when the calling thread asks for it) and OpenBLAS (f64).
#pragma once

#include "gemm.h"
