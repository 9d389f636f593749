# torch.distributed.checkpoint (DCP) of mxddp.torch's sharded states across world sizes (issue 43,
# item 4): a save at dp 2 loaded at dp 1 and dp 4, which needs three launches (the same-dp cases
# and the refusals are test_dcp.py's, in python_mpirun_np2). Included from tests/CMakeLists.txt,
# where mxddp_pyvenv and mxddp_pytests are set.
add_test(NAME python_dcp_reshard
         COMMAND sh ${mxddp_pytests}/run_dcp_reshard.sh ${mxddp_pyvenv} ${MPIEXEC_EXECUTABLE}
                 ${mxddp_pytests}/dcp_job.py)
set_tests_properties(python_dcp_reshard PROPERTIES TIMEOUT 700 SKIP_RETURN_CODE 77 RUN_SERIAL ON
                     FIXTURES_REQUIRED mxddp_python_package)
