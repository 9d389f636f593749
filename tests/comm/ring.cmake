# Issue 44 item 3: the MPI backend's ring for large f32 sums: exact against the serial reference,
# and no temporary as large as the message (tests/comm/mpi_ring_test.cc). Included from
# tests/CMakeLists.txt after mxddp_mpi_test is defined.
mxddp_mpi_test(comm_mpi_ring_test comm/mpi_ring_test.cc)
# The shared-memory transport of the torch backend's ring (tests/comm/shm_ring_test.cc), ranks as
# threads.
mxddp_test(comm_shm_ring_test comm/shm_ring_test.cc)
