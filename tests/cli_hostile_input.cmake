# Hostile input (issue 15, points 5, 6, 7, 10 and 11): each case must end in bounded time with a
# non-zero exit and an error that names the flag or file, the value and what is valid. Included
# from tests/CMakeLists.txt after the fixtures it uses (cli_ckpt, cli_train).
#
# mxddp_cli_rejects(name regex script): runs `script` under sh with $m the mxddp command under
# timeout(1) (a regression to a hang fails in seconds, not at CTest's timeout) and $d a fresh
# directory; passes when the output, stderr included, matches regex and the exit status is
# non-zero. Further arguments are test properties.
function(mxddp_cli_rejects name regex script)
  add_test(NAME ${name}
           COMMAND sh -c "m='timeout 30 $<TARGET_FILE:mxddp_cli>'; d=$(mktemp -d); trap 'rm -rf $d' EXIT; { ${script} ; } 2>&1; echo exit=$?")
  set_tests_properties(${name} PROPERTIES PASS_REGULAR_EXPRESSION "${regex}.*exit=[1-9]" ${ARGN})
endfunction()


# ---- 6. FIFOs, devices and directories are refused at open, without blocking ----
mxddp_cli_rejects(cli_train_rejects_fifo_data
  "error: .*--data '.*/fifo' is a FIFO, not a regular file: give a regular file"
  "mkfifo $d/fifo && $m train --ranks 1 --data $d/fifo")
mxddp_cli_rejects(cli_ckpt_inspect_rejects_fifo_manifest
  "error: .*checkpoint file '.*/manifest.json' is a FIFO, not a regular file"
  "cp -r ${cli_ckpt} $d/ck && rm $d/ck/manifest.json && mkfifo $d/ck/manifest.json && $m ckpt inspect $d/ck"
  FIXTURES_REQUIRED cli_ckpt)
mxddp_cli_rejects(cli_train_load_rejects_fifo_rank_file
  "error: .*checkpoint file '.*/rank_00000.safetensors' is a FIFO, not a regular file"
  "cp -r ${cli_train_dir}/ckpt $d/ck && rm $d/ck/rank_00000.safetensors && mkfifo $d/ck/rank_00000.safetensors && $m train --ranks 2 ${cli_train_small_str} --train-iters 6 --load $d/ck"
  FIXTURES_REQUIRED cli_train)

# ---- 10. messages that name the file or flag, the value and what is valid ----
mxddp_cli_rejects(cli_ckpt_inspect_names_directory_manifest
  "error: .*checkpoint file '.*/manifest.json' is a directory, not a regular file"
  "cp -r ${cli_ckpt} $d/ck && rm $d/ck/manifest.json && mkdir $d/ck/manifest.json && $m ckpt inspect $d/ck"
  FIXTURES_REQUIRED cli_ckpt)
mxddp_cli_rejects(cli_train_load_names_directory_rank_file
  "error: .*checkpoint file '.*/rank_00001.safetensors' is a directory, not a regular file"
  "cp -r ${cli_train_dir}/ckpt $d/ck && rm $d/ck/rank_00001.safetensors && mkdir $d/ck/rank_00001.safetensors && $m train --ranks 2 ${cli_train_small_str} --train-iters 6 --load $d/ck"
  FIXTURES_REQUIRED cli_train)
# Shapes that fit one by one but whose buffer does not.
mxddp_cli_rejects(cli_layout_rejects_buffer_past_int64
  "error: .*buffer layout: end of param 0: 4611686018427387904 \\+ 4611686018427387904 does not fit in a signed 64-bit integer"
  "$m layout --shapes 4611686018427387904,4611686018427387904")
