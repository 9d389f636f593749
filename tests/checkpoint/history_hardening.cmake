# Checkpoint histories under hostile use (issue 40): where `mxddp ckpt export` may write (item 3)
# and what a failed export leaves (item 10), readers while another run saves with --keep-last
# (item 9), and a resume's stale partials, the tracker's text in messages and a history without
# saves (item 15). The deterministic library cases are gtest cases of checkpoint_test
# (tests/checkpoint/history_test.cc: CheckpointHistory.*). Included from tests/CMakeLists.txt;
# uses only what it defines and mxddp_cli. Each script prints "ok NAME" / "FAIL NAME" per check.

set(history_hardening_dir ${CMAKE_CURRENT_BINARY_DIR}/history_hardening)

# Item 3 and item 10's export part: refused targets inside any history or checkpoint (by name, a
# link, '..'), files and directories the export did not write, --overwrite for its own, and a
# file-size limit that leaves no partial output (needs mxddp to ignore SIGXFSZ: apps/mxddp/main.cc).
add_test(NAME history_export_targets
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/export_targets.sh $<TARGET_FILE:mxddp_cli>
                 ${history_hardening_dir}/export_targets)
set_tests_properties(history_export_targets PROPERTIES TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "\n24 of 24 checks passed\n$" FAIL_REGULAR_EXPRESSION "FAIL")

# Item 9: `ckpt inspect` and `train --load --skip-train` run in a loop for 20 s while a run saves
# every iteration with --keep-last 1: none may report damage or a missing checkpoint. Timed
# against another process, so alone.
add_test(NAME history_readers_during_save
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/readers_during_save.sh $<TARGET_FILE:mxddp_cli>
                 ${history_hardening_dir}/readers 20)
set_tests_properties(history_readers_during_save PROPERTIES TIMEOUT 90 RUN_SERIAL ON
                     PASS_REGULAR_EXPRESSION "reads while the writer saved iterations [0-9]+\\.\\.[0-9]+: 0 reported damage or failed")

# Item 15: stale iter_N.partial cleared by a resume with --keep-last, the tracker's text escaped
# and bounded (inspect and --load), inspect of a history with no save.
add_test(NAME history_leftovers
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/history_leftovers.sh $<TARGET_FILE:mxddp_cli>
                 ${history_hardening_dir}/leftovers)
set_tests_properties(history_leftovers PROPERTIES TIMEOUT 120
                     PASS_REGULAR_EXPRESSION "\n6 of 6 checks passed\n$" FAIL_REGULAR_EXPRESSION "FAIL")
