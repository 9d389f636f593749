# `cmake --install` and a project outside this tree built against the installed prefix, through
# the CMake package (find_package(mxddp), mxddp::mxddp) and through pkg-config (mxddp.pc);
# install/run_consumer.cmake does the work. Each installs this build tree into its own scratch
# prefix under the build directory, builds and runs the consumer in tests/install/consumer.
include(GNUInstallDirs)
set(mxddp_consumer_flags "")
if(MXDDP_SANITIZE)
  set(mxddp_consumer_flags "-fsanitize=${MXDDP_SANITIZE}")
endif()
foreach(mode find_package pkg_config)
  add_test(NAME install_consumer_${mode}
           COMMAND ${CMAKE_COMMAND} -DMODE=${mode} -DBUILD_DIR=${CMAKE_BINARY_DIR}
                   -DWORK_DIR=${CMAKE_BINARY_DIR}/install_consumer/${mode}
                   -DCONSUMER_DIR=${CMAKE_CURRENT_SOURCE_DIR}/install/consumer
                   -DCXX=${CMAKE_CXX_COMPILER} -DGENERATOR=${CMAKE_GENERATOR} -DBUILD_TYPE=${CMAKE_BUILD_TYPE}
                   -DLIBDIR=${CMAKE_INSTALL_LIBDIR} "-DFLAGS=${mxddp_consumer_flags}"
                   -DSOURCE_DIR=${PROJECT_SOURCE_DIR}
                   -P ${CMAKE_CURRENT_SOURCE_DIR}/install/run_consumer.cmake)
  # The consumer's line is printed only after every step succeeded, the run's exit status included.
  set_tests_properties(install_consumer_${mode} PROPERTIES
    TIMEOUT 600 RUN_SERIAL ON
    PASS_REGULAR_EXPRESSION "mxddp consumer: all_reduce over 2 ranks exact, FSDP with every param in a unit ok, 3 GPT iterations with loss [0-9.]+ -> [0-9.]+, checkpoint at step 3 ok")
endforeach()
