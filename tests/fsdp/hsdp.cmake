# Issue 43 item 5: hybrid sharding (HSDP). Included from tests/CMakeLists.txt after the multihost
# tests (mxddp_test is defined; mxddp_pyvenv is, outside the sanitizer builds).
#   hsdp_test: a shard x replica grid of local ranks as threads (parity with FSDP and DDP over all
#     ranks, the replica all-reduce's order and sharing, the tracker's charges, and the memory plan
#     against the run).
#   multihost_hsdp: mxddp.torch's HSDP over 2 simulated hosts x 2 ranks, the shard group inside each
#     host (tests/multihost/hsdp.sh); skipped (77) without network namespaces or without the
#     package's device_mesh= plumbing.
mxddp_test(hsdp_test fsdp/hsdp_local_test.cc fsdp/hsdp_plan_test.cc)
if(DEFINED mxddp_pyvenv AND TARGET _C)
  add_test(NAME multihost_hsdp COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/multihost/hsdp.sh ${mxddp_pyvenv}/bin/python
                                          ${CMAKE_BINARY_DIR}/python_pkg ${CMAKE_CURRENT_BINARY_DIR}/multihost_hsdp)
  set_tests_properties(multihost_hsdp PROPERTIES SKIP_RETURN_CODE 77 RUN_SERIAL ON TIMEOUT 300)
endif()
