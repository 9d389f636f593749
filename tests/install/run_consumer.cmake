# Installs a built mxddp into a fresh prefix, builds tests/install/consumer against it and runs it
# (cmake -P; tests/install_consumer.cmake defines the CTest tests that call it).
#   MODE        find_package: the consumer's CMakeLists.txt (find_package(mxddp), mxddp::mxddp)
#               pkg_config:   main.cc compiled by hand with `pkg-config --cflags --libs mxddp`
#   BUILD_DIR   the configured and built mxddp tree to install
#   WORK_DIR    scratch: emptied, then holds prefix/, build/ and ckpt/
#   CONSUMER_DIR, CXX, GENERATOR, BUILD_TYPE, LIBDIR (the install's CMAKE_INSTALL_LIBDIR)
#   FLAGS       extra compile and link flags (a sanitizer build's -fsanitize=...)
#   SOURCE_DIR  mxddp's source tree: no installed package file may mention it or BUILD_DIR
cmake_minimum_required(VERSION 3.25)

foreach(var MODE SOURCE_DIR BUILD_DIR WORK_DIR CONSUMER_DIR CXX GENERATOR BUILD_TYPE LIBDIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()

# Runs a command; on failure prints what it wrote and stops.
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "${what} failed (${rc}): ${command}\n--- stdout\n${out}\n--- stderr\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix ${WORK_DIR}/prefix)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})

# The installed tree: the command, the headers, the package files, and nothing that points back
# into the source or build tree (the package must work from wherever the prefix is).
foreach(file bin/mxddp include/mxddp/comm.h include/mxddp/train.h ${LIBDIR}/libmxddp_core.a
             ${LIBDIR}/libmxddp_train.a ${LIBDIR}/cmake/mxddp/mxddpConfig.cmake
             ${LIBDIR}/cmake/mxddp/mxddpConfigVersion.cmake ${LIBDIR}/cmake/mxddp/mxddpTargets.cmake
             ${LIBDIR}/pkgconfig/mxddp.pc)
  if(NOT EXISTS ${prefix}/${file})
    message(FATAL_ERROR "the install lacks ${file}")
  endif()
endforeach()
file(GLOB_RECURSE package_files ${prefix}/${LIBDIR}/cmake/*.cmake ${prefix}/${LIBDIR}/pkgconfig/*.pc)
foreach(file IN LISTS package_files)
  file(READ ${file} text)
  foreach(path ${SOURCE_DIR}/ ${BUILD_DIR}/)
    string(FIND "${text}" "${path}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${file} refers to ${path}: the installed package is not relocatable")
    endif()
  endforeach()
endforeach()
step("mxddp --help" ${prefix}/bin/mxddp --help)

separate_arguments(flags UNIX_COMMAND "${FLAGS}")
if(MODE STREQUAL "find_package")
  step("configure the consumer" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
       -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=${BUILD_TYPE} -DCMAKE_PREFIX_PATH=${prefix}
       "-DCMAKE_CXX_FLAGS=${FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${FLAGS}")
  step("build the consumer" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  set(consumer ${WORK_DIR}/build/mxddp_consumer)
elseif(MODE STREQUAL "pkg_config")
  find_program(PKG_CONFIG NAMES pkg-config pkgconf REQUIRED)
  set(ENV{PKG_CONFIG_PATH} "${prefix}/${LIBDIR}/pkgconfig")
  step("pkg-config --cflags --libs mxddp" ${PKG_CONFIG} --cflags --libs mxddp)
  string(STRIP "${step_output}" pc_flags)
  message(STATUS "pkg-config: ${pc_flags}")
  separate_arguments(pc_flags UNIX_COMMAND "${pc_flags}")
  set(consumer ${WORK_DIR}/mxddp_consumer_pc)
  step("compile the consumer with pkg-config's flags" ${CXX} ${flags} ${CONSUMER_DIR}/main.cc ${pc_flags}
       -o ${consumer})
else()
  message(FATAL_ERROR "run_consumer.cmake: MODE is find_package or pkg_config, not '${MODE}'")
endif()

step("run the consumer" ${consumer} ${WORK_DIR}/ckpt)
set(expected "mxddp consumer: all_reduce over 2 ranks exact, FSDP with every param in a unit ok, 3 GPT iterations with loss [0-9.]+ -> [0-9.]+, checkpoint at step 3 ok")
if(NOT step_output MATCHES "${expected}")
  message(FATAL_ERROR "the consumer's output does not match '${expected}':\n${step_output}")
endif()
message("${step_output}")
