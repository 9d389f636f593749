# Hostile input (issue 15, points 4, 5, 6, 7, 10 and 11): each case must end in bounded time with a
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

# ---- 4. outputs refuse targets a rename would destroy, and report write errors ----
set(cli_train_tiny "--ranks 1 ${cli_train_small_str}")
foreach(kind fifo symlink)
  set(make_fifo "mkfifo $d/r")
  set(make_symlink "ln -s $d/target $d/r")
  mxddp_cli_rejects(cli_train_report_refuses_${kind}
    "error: .*--report '.*/r' is a (FIFO|symbolic link); writing would replace it: give a regular file or a new name"
    "${make_${kind}} && $m train ${cli_train_tiny} --report $d/r" FAIL_REGULAR_EXPRESSION "trained iterations")
endforeach()
mxddp_cli_rejects(cli_train_report_refuses_directory
  "error: .*--report '.' is a directory; writing would replace it" "cd $d && $m train ${cli_train_tiny} --report ."
  FAIL_REGULAR_EXPRESSION "trained iterations")
# A --save under a regular file used to fail only at the first save, after the training.
mxddp_cli_rejects(cli_train_save_checked_before_training
  "error: .*--save '.*/f/ck': .*/f is a regular file, not a directory"
  "touch $d/f && $m train ${cli_train_tiny} --save $d/f/ck" FAIL_REGULAR_EXPRESSION "compute:|trained iterations")
mxddp_cli_rejects(cli_train_save_refuses_symlink
  "error: .*--save '.*/ck' is a symbolic link; saving would replace it"
  "mkdir $d/real && ln -s $d/real $d/ck && $m train ${cli_train_tiny} --save $d/ck" FAIL_REGULAR_EXPRESSION "compute:")
mxddp_cli_rejects(cli_quantize_refuses_one_file_for_both_outputs
  "error: .*--out-data '.*/o' and --out-scales '.*/./o' name the same file: give two different files"
  "printf 1234 > $d/x && $m quantize --input $d/x --shape 1x1 --out-data $d/o --out-scales $d/./o")
mxddp_cli_rejects(cli_quantize_refuses_device_output
  "error: .*--out-data '/dev/full' is a character device; writing would replace it"
  "printf 1234 > $d/x && $m quantize --input $d/x --shape 1x1 --out-data /dev/full --out-scales $d/s")
# A write error is an error: under a file-size limit of 0 the write fails with EFBIG (SIGXFSZ
# ignored), and no temporary is left behind.
mxddp_cli_rejects(cli_quantize_reports_write_errors
  "error: .*--out-data '.*/o': writing '.*/.o.partial' failed: File too large.*left: x\n"
  "printf 1234 > $d/x && (trap '' XFSZ; ulimit -f 0; $m quantize --input $d/x --shape 1x1 --out-data $d/o --out-scales $d/s); s=$?; echo left: $(ls -A $d); (exit $s)")

# ---- 5. sizes from the flags are overflow-checked, and the input's size is checked first ----
mxddp_cli_rejects(cli_quantize_rejects_overflowing_shape
  "error: .*--shape 4294967296x4294967296: elements: 4294967296 x 4294967296 does not fit in a signed 64-bit integer"
  ": > $d/x && $m quantize --input $d/x --shape 4294967296x4294967296 --out-data $d/o --out-scales $d/s")
# The element count fits in int64, its f32 byte count does not (it used to wrap to a wrong size).
mxddp_cli_rejects(cli_quantize_rejects_overflowing_byte_count
  "error: .*--shape 3037000499x3037000499: bytes of f32: 9223372030926249001 x 4 does not fit"
  ": > $d/x && $m quantize --input $d/x --shape 3037000499x3037000499 --out-data $d/o --out-scales $d/s")
mxddp_cli_rejects(cli_quantize_rejects_dimension_past_int64
  "error: .*--shape '99999999999999999999x1': dimension '99999999999999999999' is not valid: give an integer in \\[1, 9223372036854775807\\]"
  ": > $d/x && $m quantize --input $d/x --shape 99999999999999999999x1 --out-data $d/o --out-scales $d/s")
# A 1 TiB sparse file: reading it to find out its size would take until memory runs out.
mxddp_cli_rejects(cli_quantize_checks_input_size_before_reading
  "error: .*--input '.*/big' holds 1099511627776 bytes; a f32 2x40 matrix is 320 bytes"
  "truncate -s 1T $d/big && $m quantize --input $d/big --shape 2x40 --out-data $d/o --out-scales $d/s")

# ---- 6. FIFOs, devices and directories are refused at open, without blocking ----
mxddp_cli_rejects(cli_quantize_rejects_fifo_input
  "error: .*--input '.*/fifo' is a FIFO, not a regular file: give a regular file"
  "mkfifo $d/fifo && $m quantize --input $d/fifo --shape 2x40 --out-data $d/o --out-scales $d/s")
mxddp_cli_rejects(cli_quantize_rejects_endless_device
  "error: .*--input '/dev/zero' is a character device, not a regular file"
  "$m quantize --input /dev/zero --shape 2x40 --out-data $d/o --out-scales $d/s")
mxddp_cli_rejects(cli_train_rejects_fifo_data
  "error: .*--data '.*/fifo' is a FIFO, not a regular file: give a regular file"
  "mkfifo $d/fifo && $m train --ranks 1 --data $d/fifo")
mxddp_cli_rejects(cli_ckpt_inspect_rejects_fifo_manifest
  "error: .*checkpoint file '.*/manifest.json' is a FIFO, not a regular file"
  "cp -r ${cli_ckpt} $d/ck && rm $d/ck/manifest.json && mkfifo $d/ck/manifest.json && $m ckpt inspect $d/ck"
  FIXTURES_REQUIRED cli_ckpt)
mxddp_cli_rejects(cli_train_load_rejects_fifo_rank_file
  "error: .*checkpoint file '.*/rank_00000.safetensors' is a FIFO, not a regular file"
  "cp -r ${cli_train_dir}/ckpt $d/ck && rm $d/ck/iter_0000004/rank_00000.safetensors && mkfifo $d/ck/iter_0000004/rank_00000.safetensors && $m train --ranks 2 ${cli_train_small_str} --train-iters 6 --load $d/ck"
  FIXTURES_REQUIRED cli_train)

# ---- 7. a timeout past what a deadline can hold is refused at the flag ----
mxddp_cli_rejects(cli_train_rejects_huge_timeout
  "--timeout-ms: '9223372036854' is not valid: give an integer in \\[1, 604800000\\]"
  "$m train --timeout-ms 9223372036854")

# ---- 10. messages that name the file or flag, the value and what is valid ----
mxddp_cli_rejects(cli_ckpt_inspect_names_directory_manifest
  "error: .*checkpoint file '.*/manifest.json' is a directory, not a regular file"
  "cp -r ${cli_ckpt} $d/ck && rm $d/ck/manifest.json && mkdir $d/ck/manifest.json && $m ckpt inspect $d/ck"
  FIXTURES_REQUIRED cli_ckpt)
mxddp_cli_rejects(cli_train_load_names_directory_rank_file
  "error: .*checkpoint file '.*/rank_00001.safetensors' is a directory, not a regular file"
  "cp -r ${cli_train_dir}/ckpt $d/ck && rm $d/ck/iter_0000004/rank_00001.safetensors && mkdir $d/ck/iter_0000004/rank_00001.safetensors && $m train --ranks 2 ${cli_train_small_str} --train-iters 6 --load $d/ck"
  FIXTURES_REQUIRED cli_train)
# One flipped byte in a key: the error names the manifest and both checksums (issue 15.13: the
# checksum is verified before any field is read).
mxddp_cli_rejects(cli_ckpt_inspect_names_malformed_manifest
  "error: .*checkpoint manifest '.*/manifest.json' fails its checksum: its content has CRC-32 [0-9a-f]+, its manifest_crc32 says [0-9a-f]+"
  "cp -r ${cli_ckpt} $d/ck && sed -i 's/\"step\"/\"stfp\"/' $d/ck/manifest.json && $m ckpt inspect $d/ck"
  FIXTURES_REQUIRED cli_ckpt)
mxddp_cli_rejects(cli_train_rejects_huge_corpus
  "--corpus-bytes: '99999999999999999999' is not valid: give an integer in \\[1, 1073741824\\]"
  "$m train --corpus-bytes 99999999999999999999")
# Shapes that fit one by one but whose buffer does not.
mxddp_cli_rejects(cli_layout_rejects_buffer_past_int64
  "error: .*buffer layout: end of param 0: 4611686018427387904 \\+ 4611686018427387904 does not fit in a signed 64-bit integer"
  "$m layout --shapes 4611686018427387904,4611686018427387904")
mxddp_cli_rejects(cli_layout_rejects_huge_dp
  "--dp: '2147483647' is not valid: give an integer in \\[1, 65536\\]"
  "$m layout --shapes 5 --dp 2147483647 --use-distributed-optimizer")
mxddp_cli_rejects(cli_selfcheck_names_timeout_range
  "--timeout-ms: '0' is not valid: give an integer in \\[1, 604800000\\]"
  "$m selfcheck --timeout-ms 0")
# Empty arguments: CLI11 2.1 skipped the rest of the line after one (exit 0 with the flags after it
# unread) or, after a bad value, looped forever; and "--flag=" set an on/off flag.
mxddp_cli_rejects(cli_train_refuses_empty_argument
  "mxddp: error: .*argument 2 is empty \\(''\\): no argument of mxddp is empty" "$m train '' --bogus")
mxddp_cli_rejects(cli_train_empty_argument_after_bad_value_does_not_hang
  "mxddp: error: .*argument 4 is empty" "$m train --ranks x '' --x")
mxddp_cli_rejects(cli_flag_with_empty_value
  "mxddp: error: .*argument 2 '--average-in-collective=' has an empty value" "$m train --average-in-collective=")
mxddp_cli_rejects(cli_parse_errors_read_as_mxddp_errors "mxddp: error: .*--ranks" "$m train --ranks x")
# ---- 9. a run that cannot fit is refused before it allocates, with the figures ----
mxddp_cli_rejects(cli_train_refuses_a_billion_layers
  "error: .*this run cannot fit in this machine's memory: 1 rank here need at least .* is available.*--num-layers 2147483647"
  "$m train --ranks 1 --num-layers 2147483647")
mxddp_cli_rejects(cli_train_refuses_a_million_hidden
  "error: .*this run cannot fit in this machine's memory: 2 ranks here need at least .*--hidden-size 1000000"
  "$m train --ranks 2 --hidden-size 1000000")
mxddp_cli_rejects(cli_train_param_count_past_int64
  "error: .*the model's param count \\(--num-layers, --hidden-size, --seq-length\\): 12 x 4611686014132420609 does not fit"
  "$m train --ranks 1 --hidden-size 2147483647 --num-attention-heads 1")
# An allocation that fails is named with the subcommand and what to change, never a bare
# std::bad_alloc: 1 GiB of built-in corpus under a 512 MiB address-space limit. Sanitizer builds
# reserve terabytes of shadow memory at startup, which no such limit allows, so only plain builds
# run it.
if(NOT MXDDP_SANITIZE)
  mxddp_cli_rejects(cli_out_of_memory_names_the_command
    "mxddp: error: .*this run cannot fit in this process's address space: 1 rank here need at least 1 GiB \\(1 GiB each: [^)]*data 1 GiB\\) and .* is available \\(the address-space limit \\(ulimit -v, RLIMIT_AS\\) of 512 MiB"
    "ulimit -v 524288 && $m train --ranks 1 --corpus-bytes 1073741824")
endif()

# ---- 11. nonsense that used to be accepted with exit 0 ----
mxddp_cli_rejects(cli_train_rejects_negative_seed
  "--seed: '-1' is not valid: give an integer in \\[0, 18446744073709551615\\]" "$m train --seed -1")
mxddp_cli_rejects(cli_train_rejects_train_iters_past_int64
  "--train-iters: '9223372036854775808' is not valid: give an integer in \\[0, 9223372036854775807\\]"
  "$m train --train-iters 9223372036854775808")
mxddp_cli_rejects(cli_train_rejects_weight_decay_past_float
  "--weight-decay: '1e39' is not valid: give a finite 32-bit float in \\[0, 3.40282[0-9]*e\\+38\\]"
  "$m train --weight-decay 1e39")
mxddp_cli_rejects(cli_train_rejects_nan_lr
  "--lr: 'nan' is not valid: give a finite 32-bit float" "$m train --lr nan")
# Adam's bias correction divides by 1 - beta^t: beta 1 is refused, and so is a value that only
# becomes 1 when rounded to float.
mxddp_cli_rejects(cli_train_rejects_adam_beta_of_one
  "--adam-beta2: '0.999999999' is not valid: give a finite 32-bit float in \\[0, 1\\)" "$m train --adam-beta2 0.999999999")
foreach(flag save load report data)
  mxddp_cli_rejects(cli_train_rejects_empty_${flag}
    "--${flag}: '' is not valid: give a value \\(an empty one names nothing\\)" "$m train --${flag} ''")
endforeach()
mxddp_cli_rejects(cli_layout_rejects_trailing_x
  "error: .*--shapes '5x': dimension of shape '5x' '' is not valid: give an integer in \\[1, " "$m layout --shapes 5x")
mxddp_cli_rejects(cli_layout_rejects_trailing_x_in_2d
  "error: .*--shapes '5x5x': dimension of shape '5x5x' '' is not valid" "$m layout --shapes 5x5x")
mxddp_cli_rejects(cli_layout_rejects_empty_shape_in_list
  "error: .*--shapes '95,,95': shape '' is not valid" "$m layout --shapes 95,,95")
