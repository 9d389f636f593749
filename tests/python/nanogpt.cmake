# Issue 43's proof: nanoGPT's train.py and its mxddp port (tests/python/nanogpt, README.md there) under
# torchrun at 2 ranks, losses equal within 1e-5, uninterrupted and resumed from the script's own ckpt.pt.
# Included from tests/CMakeLists.txt, where mxddp_pyvenv and mxddp_pytests are set.
add_test(NAME python_nanogpt_torchrun
         COMMAND sh ${mxddp_pytests}/nanogpt/run_nanogpt.sh ${mxddp_pyvenv} ${CMAKE_CURRENT_BINARY_DIR}/python_nanogpt)
set_tests_properties(python_nanogpt_torchrun PROPERTIES TIMEOUT 600 SKIP_RETURN_CODE 77 RUN_SERIAL ON
                     FIXTURES_REQUIRED mxddp_python_package)
