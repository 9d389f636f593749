// The f32 row kernels compiled for avx2 (this file's compile flags are in CMakeLists.txt);
// row_kernels.cc dispatches to the widest table the CPU runs.
#define MXDDP_ROW_KERNELS row_kernels_avx2
#define MXDDP_ROW_KERNELS_ISA "avx2"
#include "row_kernels_simd.inc"
