// The float reduction and copy kernels compiled for avx512 (this file's compile flags are in CMakeLists.txt); reduce.cc dispatches to it.
#define MXDDP_REDUCE_KERNEL reduce_float_avx512
#define MXDDP_COPY_KERNEL copy_many_avx512
#include "reduce_simd.inc"
