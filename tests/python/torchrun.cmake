# mxddp on torch.distributed's ranks (issue 43, item 1): torchrun, srun without MPI, and the user's
# process groups, each through tests/python/run_torchrun.sh (a launch of its own: these cannot run
# inside the mpirun pytest suites, where tests/python/torchrun/'s files skip). Included from
# tests/CMakeLists.txt, where mxddp_pyvenv and mxddp_pytests are set (and before the loop that puts
# <build>/python_pkg on every python_* test's PYTHONPATH).
foreach(mode basics suite groups parity no_init srun timeout raise)
  add_test(NAME python_torchrun_${mode}
           COMMAND sh ${mxddp_pytests}/run_torchrun.sh ${mxddp_pyvenv} ${MPIEXEC_EXECUTABLE} ${mode})
  set_tests_properties(python_torchrun_${mode} PROPERTIES TIMEOUT 400 SKIP_RETURN_CODE 77 RUN_SERIAL ON
                       FIXTURES_REQUIRED mxddp_python_package)
endforeach()
