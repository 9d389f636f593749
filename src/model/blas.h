// Row-major GEMM over OpenBLAS, one name for both precisions: the model's math is written once as
// a template and runs in f32 (training) and f64 (the finite-difference gradient check).
//
//   C[M, N] = alpha * op(A)[M, K] * op(B)[K, N] + beta * C[M, N]
// with op(X) = X or X^T and the leading dimensions of the row-major storage (so a head's slice of
// a [N, 3C] qkv matrix is addressed in place with ld = 3C).
#pragma once

#include <cblas.h>

namespace mxddp::model {

enum class Op : bool { kN = false, kT = true };

inline void gemm(Op op_a, Op op_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                 float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, op_a == Op::kT ? CblasTrans : CblasNoTrans, op_b == Op::kT ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

inline void gemm(Op op_a, Op op_b, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, op_a == Op::kT ? CblasTrans : CblasNoTrans, op_b == Op::kT ? CblasTrans : CblasNoTrans,
              m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace mxddp::model
