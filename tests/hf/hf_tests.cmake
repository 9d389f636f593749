# mxddp's GPT to and from Hugging Face GPT-2 (docs/hf.md): `ckpt export --format hf`, `train
# --load-hf`, `--skip-train`, with transformers' GPT2LMHeadModel as the reference (tests/hf).
# Included from tests/CMakeLists.txt. Needs build/pyvenv-torch (scripts/setup.sh, or a light venv
# that sees another's torch); skipped (77) without torch and transformers. In the address build
# too: the Python side runs uninstrumented and drives the instrumented command, whose readers
# take the hostile files. Not under ThreadSanitizer (the command's threads are other suites').
if(NOT MXDDP_SANITIZE STREQUAL "thread")
  add_test(NAME hf_gpt2
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/hf/run_hf_tests.sh ${PROJECT_SOURCE_DIR}/build/pyvenv-torch
                   $<TARGET_FILE:mxddp_cli> ${CMAKE_CURRENT_SOURCE_DIR}/hf)
  set_tests_properties(hf_gpt2 PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)
endif()
