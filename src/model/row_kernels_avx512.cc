// The f32 row kernels compiled for avx512f (this file's compile flags are in CMakeLists.txt);
// row_kernels.cc dispatches to the widest table the CPU runs.
#define MXDDP_ROW_KERNELS row_kernels_avx512
#define MXDDP_ROW_KERNELS_ISA "avx512f"
#include "row_kernels_simd.inc"
