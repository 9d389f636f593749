# Data read under the faults of a long run (issue 40): a Megatron indexed dataset changed under
# `mxddp train` (item 4), and a --load-hf model.safetensors holding NaN or Inf (item 8).
# Included from tests/CMakeLists.txt (after mpirun_2_str and mxddp_cli_rejects are defined).

# ---- item 4: P.bin truncated, rewritten with ids past the vocabulary, or rewritten at the same
# size after two iterations: the run ends with exit status 1 and an error naming P.bin (it used
# to die of SIGBUS, look the ids up past the embedding, or train on silently).
foreach(mode truncate ids same-size)
  string(REPLACE "-" "_" mode_id "${mode}")
  add_test(NAME data_changed_under_run_${mode_id}
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/model/data_changed_under_run.sh ${PROJECT_SOURCE_DIR} ${mode}
                   $<TARGET_FILE:mxddp_cli> train --ranks 2)
  set_tests_properties(data_changed_under_run_${mode_id} PROPERTIES TIMEOUT 90 RUN_SERIAL ON
    PASS_REGULAR_EXPRESSION "error: [^\n]*/p\\.bin[^\n]*changed under the run: .*\nexit=1\n" FAIL_REGULAR_EXPRESSION "FAIL:")
endforeach()
# Under mpirun each rank reads the file itself; the job ends with 1 too.
add_test(NAME data_changed_under_run_truncate_mpi
         COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/model/data_changed_under_run.sh ${PROJECT_SOURCE_DIR} truncate
                 ${mpirun_2} $<TARGET_FILE:mxddp_cli> train --backend mpi)
set_tests_properties(data_changed_under_run_truncate_mpi PROPERTIES TIMEOUT 90 RUN_SERIAL ON
  PASS_REGULAR_EXPRESSION "rank [01]: mxddp: error: [^\n]*/p\\.bin' changed under the run: it had [0-9]+ bytes when it was opened and has [0-9]+ now.*\nexit=1\n"
  FAIL_REGULAR_EXPRESSION "FAIL:")

# ---- item 8: a NaN or Inf in --load-hf's model.safetensors is refused at load naming the tensor,
# its count and its first element (it used to load and fail at iteration 1 blaming the gradients).
# The HF directory is `ckpt export --format hf` of a one-iteration run; one value is then written
# over in place (tests/hf/poison_safetensors.py, standard library only).
set(data_hf_dir ${CMAKE_CURRENT_BINARY_DIR}/data_hardening_hf)
set(data_hf_model --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2
                  --global-batch-size 4)
string(REPLACE ";" " " data_hf_model_str "${data_hf_model}")
add_test(NAME data_load_hf_fixture
         COMMAND sh -c "rm -rf ${data_hf_dir} && $<TARGET_FILE:mxddp_cli> train --ranks 1 ${data_hf_model_str} --train-iters 1 --save ${data_hf_dir}/ck > /dev/null && $<TARGET_FILE:mxddp_cli> ckpt export ${data_hf_dir}/ck --format hf --out ${data_hf_dir}/hf")
set_tests_properties(data_load_hf_fixture PROPERTIES FIXTURES_SETUP data_load_hf TIMEOUT 60
  PASS_REGULAR_EXPRESSION "to .*/hf as a Hugging Face GPT-2 directory")
# The clean export loads (so each refusal below is the poisoned value's).
add_test(NAME data_load_hf_finite_loads
         COMMAND mxddp_cli train --ranks 2 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 1 --load-hf ${data_hf_dir}/hf)
set_tests_properties(data_load_hf_finite_loads PROPERTIES FIXTURES_REQUIRED data_load_hf TIMEOUT 60
  PASS_REGULAR_EXPRESSION "trained iterations 1\\.\\.1")
foreach(case "nan|transformer.h.1.mlp.c_fc.weight|37|F32 \\[32, 128\\], mxddp's decoder.layers.1.mlp.linear_fc1.weight\\) holds 1 non-finite value \\(1 NaN, 0 \\+-Inf\\), the first at element 37 \\[0, 37\\] = nan"
             "inf|transformer.wte.weight|100|F32 \\[256, 32\\], mxddp's embedding.word_embeddings.weight\\) holds 1 non-finite value \\(0 NaN, 1 \\+-Inf\\), the first at element 100 \\[3, 4\\] = inf"
             "-inf|transformer.ln_f.bias|5|F32 \\[32\\], mxddp's decoder.final_layernorm.bias\\) holds 1 non-finite value \\(0 NaN, 1 \\+-Inf\\), the first at element 5 \\[5\\] = -inf")
  string(REPLACE "|" ";" case "${case}")
  list(GET case 0 value)
  list(GET case 1 tensor)
  list(GET case 2 index)
  list(GET case 3 expected)
  string(REPLACE "-" "minus_" value_id "${value}")
  mxddp_cli_rejects(data_load_hf_refuses_${value_id}_naming_the_tensor
    "error: [^\n]*'.*/model.safetensors': tensor '${tensor}' \\(${expected}: a model to load must be finite"
    "cp -r ${data_hf_dir}/hf $d/h && /usr/bin/python3 ${CMAKE_CURRENT_SOURCE_DIR}/hf/poison_safetensors.py $d/h/model.safetensors ${tensor} ${index} ${value} && $m train --ranks 2 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 1 --load-hf $d/h"
    FIXTURES_REQUIRED data_load_hf TIMEOUT 60 FAIL_REGULAR_EXPRESSION "trained iterations|iteration 1:")
endforeach()
