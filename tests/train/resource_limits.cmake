# Issue 40, items 10, 11 and 13: the limits a machine or launcher puts on a process (included from
# tests/CMakeLists.txt; paths relative to tests/).

# The parsing behind them, on fake cgroup trees and limits set in-process: the cgroup v1/v2 walk
# from the process's own cgroup (item 11), the out-of-memory error naming the request (item 13),
# the file-size limit named in a write error and nothing left by a failed write (item 10).
mxddp_test(resource_limits_test train/resource_limits_test.cc)

# Item 10: `ulimit -f` makes a save or an export fail with an error naming the file and the limit
# (SIGXFSZ ignored), leaving no temporary and the previous checkpoint loadable.
foreach(mode local mpirun)
  add_test(NAME train_resource_file_size_limit_${mode}
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/resource_file_size_limit.sh $<TARGET_FILE:mxddp_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_resource_fsize_${mode} ${mode} ${MPIEXEC_EXECUTABLE})
  set_tests_properties(train_resource_file_size_limit_${mode} PROPERTIES TIMEOUT 180 RUN_SERIAL ON
                       PASS_REGULAR_EXPRESSION "resource_file_size_limit \\(${mode}\\): ok")
endforeach()

# Item 11: a memory limit on a cgroup above the process's own refuses `--model small` naming the
# limit's file. It makes (and always removes) cgroups under this process's own, as root; it skips
# where that is not allowed.
add_test(NAME train_resource_cgroup_limit
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/resource_cgroup_limit.sh $<TARGET_FILE:mxddp_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_resource_cgroup)
set_tests_properties(train_resource_cgroup_limit PROPERTIES TIMEOUT 180 RUN_SERIAL ON SKIP_RETURN_CODE 77
                     PASS_REGULAR_EXPRESSION "resource_cgroup_limit \\(cgroup v[12]\\): ok")

# Item 13: under address-space limits from 100 MiB up, every run either trains or ends with an
# out-of-memory error or the up-front refusal naming ulimit -v: no signal, no abort, no hang.
# Sanitizer builds reserve terabytes of shadow memory at start, which no such limit allows.
if(NOT MXDDP_SANITIZE)
  foreach(mode local mpirun)
    add_test(NAME train_resource_address_space_${mode}
             COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/resource_address_space.sh $<TARGET_FILE:mxddp_cli>
                     ${CMAKE_CURRENT_BINARY_DIR}/train_resource_as_${mode} ${mode} ${MPIEXEC_EXECUTABLE})
    set_tests_properties(train_resource_address_space_${mode} PROPERTIES TIMEOUT 600 RUN_SERIAL ON
                         SKIP_RETURN_CODE 77 PASS_REGULAR_EXPRESSION "resource_address_space \\(${mode}\\): ok")
  endforeach()
endif()

# Item 13: a failed allocation names the request, not a bare std::bad_alloc: quantize reading a 1 GiB
# (sparse) input under a 390 MiB address-space limit.
if(NOT MXDDP_SANITIZE)
  mxddp_cli_rejects(cli_out_of_memory_names_the_request
    "mxddp: error: quantize ran out of memory \\(std::bad_alloc\\): [^\n]*\\(out of memory: could not allocate 1073741824 bytes\\)"
    "truncate -s 1G $d/big && (ulimit -v 400000; $m quantize --input $d/big --shape 16384x16384 --out-data $d/q --out-scales $d/s)")
endif()
