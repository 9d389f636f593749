# Issue 44 item 2: a rank waiting for a late peer sleeps instead of polling (its CPU time during the
# wait is a small fraction of the wait), under mpirun at 2 and 4 ranks. Included from
# tests/CMakeLists.txt after mxddp_mpi_test is defined.
mxddp_mpi_test(comm_mpi_wait_cpu_test comm/mpi_wait_cpu_test.cc)
