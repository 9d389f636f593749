# The replicated optimizer over DDP (use_distributed_optimizer off, torch DDP's default; issue 43):
# its gtest suite on the local backend. Included from tests/CMakeLists.txt once mxddp_test is
# defined; paths are relative to this file so the suite builds wherever it is included from.
mxddp_test(replicated_optimizer_test ${CMAKE_CURRENT_LIST_DIR}/replicated_optimizer_test.cc)
# Its headers are included as "ddp/..." and "optim/...", from the tests folder.
target_include_directories(replicated_optimizer_test PRIVATE ${CMAKE_CURRENT_LIST_DIR}/..)
