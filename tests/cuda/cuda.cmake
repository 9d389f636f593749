# The CUDA layer's tests (include/mxddp/cuda.h), built when MXDDP_CUDA is on.
#   cuda_host_test: what runs without a device (argument checks, the missing-device reason).
#   cuda_kernels_test: every kernel against its CPU reference, device memory and the allocator
#     interface; exits 77 (skipped, saying why) where no CUDA device is usable (CI, this VM).
#   cuda_local_group_test: the local backend's collectives on device buffers, then DDP and the
#     distributed optimizer on them, 2 and 4 ranks on one GPU with a stream each, against the host
#     run of the same jobs, and every FSDP strategy against the generic model's serial reference;
#     skips likewise.
mxddp_test(cuda_host_test cuda/cuda_host_test.cc)
target_link_libraries(cuda_host_test PRIVATE mxddp_cuda)
add_executable(cuda_kernels_test cuda/kernels_test.cc cuda/fp8_conversion_check.cu cuda/device_main.cc)
target_link_libraries(cuda_kernels_test PRIVATE mxddp_cuda GTest::gtest CUDA::cudart_static)  # only these: it runs on the GPU machine
target_compile_options(cuda_kernels_test PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-fmad=false>)
target_include_directories(cuda_kernels_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME cuda_kernels_test COMMAND cuda_kernels_test)
set_tests_properties(cuda_kernels_test PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
add_executable(cuda_local_group_test cuda/local_group_test.cc cuda/fsdp_device_test.cc cuda/device_main.cc)
target_link_libraries(cuda_local_group_test PRIVATE mxddp_cuda mxddp_checkpoint mxddp_optim mxddp_fsdp mxddp_ddp mxddp_comm GTest::gtest)
target_include_directories(cuda_local_group_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
add_test(NAME cuda_local_group_test COMMAND cuda_local_group_test)
set_tests_properties(cuda_local_group_test PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
#   cuda_staged_mpi_test_np2/np4: MPI processes sharing one GPU, every collective staged through
#     page-locked host memory (MpiOptions::compute), DDP on them, against the host runs. Without a
#     device its cases skip, saying why, and the run passes (mpi_main.cc), as nccl_mpi_test's join.
#     Linked to the layers it runs only (no oneDNN: the GPU machine's carry is limited to 64 MiB).
add_executable(cuda_staged_mpi_test cuda/staged_mpi_device_test.cc mpi_main.cc)
target_link_libraries(cuda_staged_mpi_test PRIVATE mxddp_cuda mxddp_optim mxddp_ddp mxddp_comm GTest::gtest MPI::MPI_CXX)
target_include_directories(cuda_staged_mpi_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
foreach(np 2 4)
  add_test(NAME cuda_staged_mpi_test_np${np}
           COMMAND ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe --bind-to none ${MPIEXEC_NUMPROC_FLAG} ${np}
                   $<TARGET_FILE:cuda_staged_mpi_test>)
  set_tests_properties(cuda_staged_mpi_test_np${np} PROPERTIES TIMEOUT 300 RUN_SERIAL ON)
endforeach()

# The NCCL communicator's tests (include/mxddp/nccl.h), built when MXDDP_NCCL is on.
#   nccl_host_test: what runs without a device (the version, unique ids, refused arguments, the
#     missing-device reason); CI runs it.
#   nccl_mpi_test_np2/np4: the unique id over MPI reaches every rank; with a GPU per rank, they
#     join and all-reduce (skipped, saying why, without).
#   nccl_device_test: NCCL at world 1 on the GPU against the host runs; skips (77) without a device.
if(MXDDP_NCCL)
  mxddp_test(nccl_host_test cuda/nccl_host_test.cc)
  target_link_libraries(nccl_host_test PRIVATE mxddp_nccl)
  mxddp_mpi_test(nccl_mpi_test cuda/nccl_mpi_test.cc)
  target_link_libraries(nccl_mpi_test PRIVATE mxddp_nccl)
  add_executable(nccl_device_test cuda/nccl_device_test.cc cuda/device_main.cc)
  target_link_libraries(nccl_device_test PRIVATE mxddp_nccl mxddp_checkpoint mxddp_optim mxddp_fsdp mxddp_ddp mxddp_comm GTest::gtest)
  target_include_directories(nccl_device_test PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
  add_test(NAME nccl_device_test COMMAND nccl_device_test)
  set_tests_properties(nccl_device_test PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
endif()

#   cuda_wide_host_test: the wide kernels' per-thread code (mxfp8_wide.h, adamw_wide.h) run thread
#     by thread on the host against the CPU references, and cuda_fp8.h's conversion against the
#     encoder; runs without a device, so CI checks the wide kernels' logic.
mxddp_test(cuda_wide_host_test cuda/wide_kernels_host_test.cc)
target_link_libraries(cuda_wide_host_test PRIVATE CUDA::toolkit)
