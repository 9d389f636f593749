# Issue 40's hardening cases for the Python package that need a launch of their own (the plain
# pytest files, test_rank_agreement.py, test_replaced_params.py and test_skipped_steps.py, run in
# python_mpirun_np2). Included from tests/CMakeLists.txt, where mxddp_pyvenv and mxddp_pytests are set.

# Two jobs saving into one checkpoint history: the second is refused on every rank naming the
# holder, the first's saves stay intact, and its lock goes with it (item 2).
add_test(NAME python_save_lock_two_jobs
         COMMAND sh ${mxddp_pytests}/run_save_lock.sh ${mxddp_pyvenv} ${MPIEXEC_EXECUTABLE}
                 ${mxddp_pytests}/save_lock_job.py)
set_tests_properties(python_save_lock_two_jobs PROPERTIES TIMEOUT 400 SKIP_RETURN_CODE 77 RUN_SERIAL ON
                     FIXTURES_REQUIRED mxddp_python_package)

# Preemption under mpirun (item 1): docs/python.md's recipe (a signal handler that sets a flag, a
# max all-reduce of it after each iteration, a save, exit 0); SIGUSR1 to mpirun mid-run must end
# the job with exit 0 and a checkpoint of the stop's iteration that a second job resumes.
add_test(NAME python_preemption_sigusr1_mpirun
         COMMAND sh ${mxddp_pytests}/run_preempt.sh ${mxddp_pyvenv} ${MPIEXEC_EXECUTABLE}
                 ${mxddp_pytests}/preempt_job.py)
set_tests_properties(python_preemption_sigusr1_mpirun PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 RUN_SERIAL ON
                     FIXTURES_REQUIRED mxddp_python_package)
