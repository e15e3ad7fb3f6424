# ctest -P script: configures and builds the worker SDK, its unit tests and `train` against
# Debian's libtorch 1.13 (the oldest version supported) in a sub-build directory of the main
# build, so that a change which only compiles against the default torch 2.x fails the suite.
# Variables: SOURCE_DIR, BINARY_DIR, PYTHON (Debian's /usr/bin/python3).
foreach(step configure build)
  if(step STREQUAL "configure")
    set(cmd "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -G Ninja
            -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDDPLAUNCH_PYTHON=${PYTHON}
            -DDDPLAUNCH_BUILD_BENCH=OFF -DDDPLAUNCH_BUILD_TESTS=ON)
  else()
    set(cmd "${CMAKE_COMMAND}" --build "${BINARY_DIR}" --target worker_sdk_unit_tests train)
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the ${step} of the worker SDK against libtorch 1.13 failed (rc ${rc}): "
                        "${cmd}")
  endif()
endforeach()
file(STRINGS "${BINARY_DIR}/CMakeCache.txt" torch_dir REGEX "^Torch_DIR:")
message(STATUS "worker SDK built against ${torch_dir}")
