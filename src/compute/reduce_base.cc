// The float reduction and copy kernels compiled for the build's baseline ISA (x86-64-v2); reduce.cc dispatches to it.
#define MXDDP_REDUCE_KERNEL reduce_float_base
#define MXDDP_COPY_KERNEL copy_many_base
#include "reduce_simd.inc"
