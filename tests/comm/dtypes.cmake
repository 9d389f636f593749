# Issue 44 item 4: collectives over f64, i64, i32 and bool, on the local backend (2, 3 and 4 ranks
# as threads) and under mpirun (2 and 4 processes). Included from tests/CMakeLists.txt after
# mxddp_test and mxddp_mpi_test are defined.
mxddp_test(comm_dtypes_test comm/dtypes_local_test.cc)
mxddp_mpi_test(comm_dtypes_mpi_test comm/dtypes_mpi_test.cc)
