// The model's matrix products, one entry point per precision, row-major:
//
//   C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C[M, N]
// with op(X) = X or X^T and the leading dimensions of the row-major storage (so a head's slice of
// a [N, 3C] qkv matrix is addressed in place with ld = 3C).
//
// f32 runs on oneDNN's matmul primitive, which picks its kernel from the CPU's feature flags at
// run time (AVX2, AVX-512, AMX) rather than from a table of model numbers; see docs/compute.md
// for the measurements behind that choice. The calling thread chooses the compute dtype of its
// f32 products: with kBF16 (Megatron's --bf16) both operands are rounded to BF16 and multiplied
// with F32 accumulation and an F32 C, on CPUs whose oneDNN ISA has native BF16 (avx512_bf16 or
// AMX); elsewhere kBF16 falls back to F32 products. f64 (only the finite-difference gradient
// test uses it) runs on OpenBLAS's dgemm.
//
// Threads: oneDNN runs on OpenMP, whose thread count is a per-calling-thread setting
// (set_compute_threads in include/mxddp/model.h), so ranks that run as threads each get theirs.
#pragma once

#include <cstdint>

namespace mxddp::model {

enum class Op : bool { kN = false, kT = true };

// What the calling thread's f32 products compute in.
enum class GemmDType : uint8_t { kF32, kBF16 };

void set_gemm_dtype(GemmDType dtype);  // the calling thread's, until changed
GemmDType gemm_dtype();

// Sets the calling thread's gemm dtype for a scope and restores the previous one.
class ScopedGemmDType {
 public:
  explicit ScopedGemmDType(GemmDType dtype) : previous_(gemm_dtype()) { set_gemm_dtype(dtype); }
  ~ScopedGemmDType() { set_gemm_dtype(previous_); }
  ScopedGemmDType(const ScopedGemmDType&) = delete;
  ScopedGemmDType& operator=(const ScopedGemmDType&) = delete;

 private:
  GemmDType previous_;
};

// True when this CPU (as oneDNN sees it) multiplies BF16 natively, so kBF16 really runs in BF16.
bool bf16_gemm_supported();

void gemm(Op op_a, Op op_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
          float beta, float* c, int ldc);

// An operand of an f32-output product whose storage may already be BF16 (a BF16 param, say):
// such an operand is read in place, with no rounding pass. BF16 storage needs BF16 compute
// (kBF16 on a CPU where bf16_gemm_supported()); f32 storage is rounded as above when the thread
// computes in BF16.
struct GemmOperand {
  const void* data;
  int ld;
  bool bf16;  // data holds uint16_t BF16 bits, else float
};

// bias [n] (optional, alpha 1 only) is added to every row of C inside the product: a linear
// layer's y = x W^T + b without a pass that first fills C with b.
void gemm(Op op_a, Op op_b, int m, int n, int k, float alpha, GemmOperand a, GemmOperand b, float beta, float* c,
          int ldc, const float* bias = nullptr);

void gemm(Op op_a, Op op_b, int m, int n, int k, double alpha, const double* a, int lda, const double* b, int ldb,
          double beta, double* c, int ldc);

}  // namespace mxddp::model
