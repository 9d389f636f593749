// The f32 row kernels compiled for AVX-512 with native BF16 conversion (avx512_bf16: Cooper Lake,
// Sapphire Rapids, Zen 4; this file's compile flags are in CMakeLists.txt): the avx512 table's
// arithmetic, with the BF16 casts on vcvtneps2bf16. row_kernels.cc picks it where the CPU has it.
#define MXDDP_ROW_KERNELS row_kernels_avx512bf16
#define MXDDP_ROW_KERNELS_ISA "avx512bf16"
#include "row_kernels_simd.inc"
