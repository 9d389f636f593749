// The f32 row kernels compiled for x86-64-v2 (this file's compile flags are in CMakeLists.txt);
// row_kernels.cc dispatches to the widest table the CPU runs.
#define MXDDP_ROW_KERNELS row_kernels_base
#define MXDDP_ROW_KERNELS_ISA "x86-64-v2"
#include "row_kernels_simd.inc"
