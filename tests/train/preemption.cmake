# Issue 40, items 1 and 12 (included from tests/CMakeLists.txt; paths relative to tests/).
#
# Item 1, preemption: `mxddp train --exit-signal-handler --save D` signalled mid-iteration the way
# docs/train.md ("Stopping cleanly") gives for each launcher exits 0 with a checkpoint of the
# iteration it was in, which `ckpt inspect` accepts and `train --load` resumes from. --model small
# (iterations of a second or more here), so the signal lands inside an iteration.
foreach(mode mpirun local)
  add_test(NAME train_preemption_sigusr1_${mode}
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/preemption.sh $<TARGET_FILE:mxddp_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_preemption_${mode} ${mode} ${MPIEXEC_EXECUTABLE})
  set_tests_properties(train_preemption_sigusr1_${mode} PROPERTIES TIMEOUT 300 RUN_SERIAL ON)
endforeach()
# A storm of stop signals at both ranks until they stop: none may crash a rank (a signal handled
# inside oneDNN's generated GEMM kernels corrupted the heap before the signals got a thread of
# their own).
add_test(NAME train_preemption_signal_storm_mpirun
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/signal_storm.sh $<TARGET_FILE:mxddp_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_preemption_signal_storm ${MPIEXEC_EXECUTABLE})
set_tests_properties(train_preemption_signal_storm_mpirun PROPERTIES TIMEOUT 300 RUN_SERIAL ON)

# Item 12, every output checked at the start on every rank: a --report, --metrics-file or --save
# that one rank cannot write (read-only for that rank, or not the directory rank 0 sees) refuses the
# run before its first iteration, on every rank, naming the rank and the path. The mpirun cases put
# one rank in a mount namespace of its own; they skip (77) where mount namespaces are not allowed.
add_test(NAME train_outputs_checked_proc_report
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/outputs_checked.sh $<TARGET_FILE:mxddp_cli>
                 ${CMAKE_CURRENT_BINARY_DIR}/train_outputs_proc_report proc_report)
set_tests_properties(train_outputs_checked_proc_report PROPERTIES TIMEOUT 120)
foreach(case readonly_report_rank0 readonly_metrics_rank1 readonly_save_rank1 unshared_save_rank1)
  add_test(NAME train_outputs_checked_${case}
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/train/outputs_checked.sh $<TARGET_FILE:mxddp_cli>
                   ${CMAKE_CURRENT_BINARY_DIR}/train_outputs_${case} ${case} ${MPIEXEC_EXECUTABLE})
  set_tests_properties(train_outputs_checked_${case} PROPERTIES TIMEOUT 180 RUN_SERIAL ON SKIP_RETURN_CODE 77)
endforeach()
