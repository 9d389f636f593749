// f64, i64, i32 and bool collectives on the MPI backend, one process per rank (CTest runs it at 2
// and 4 ranks): the same checks as the local suite (dtype_checks.h), through MPI's own types and
// reductions (MPI_DOUBLE, MPI_INT64_T, MPI_INT32_T, MPI_C_BOOL with logical or).
#include "mpi_main.h"
#include "comm/dtype_checks.h"

namespace mxddp::testing {
namespace {

TEST(MpiDTypes, F64) { check_dtype_collectives<DType::kF64>(*g_mpi_comm); }
TEST(MpiDTypes, I64) { check_dtype_collectives<DType::kI64>(*g_mpi_comm); }
TEST(MpiDTypes, I32) { check_dtype_collectives<DType::kI32>(*g_mpi_comm); }
TEST(MpiDTypes, Bool) { check_dtype_collectives<DType::kBool>(*g_mpi_comm); }
TEST(MpiDTypes, AvgAndPrescaleOfIntegersAndBoolAreRefused) { check_integer_ops_refused(*g_mpi_comm); }

}  // namespace
}  // namespace mxddp::testing
