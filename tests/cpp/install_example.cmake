# Installs the build into a scratch prefix, then configures, builds and runs examples/cpp against it.
# Run by ctest as `cmake -P` with BUILD_DIR, INSTALL_PREFIX, EXAMPLE_SOURCE_DIR, EXAMPLE_BUILD_DIR set.
cmake_minimum_required(VERSION 3.20)

foreach(var BUILD_DIR INSTALL_PREFIX EXAMPLE_SOURCE_DIR EXAMPLE_BUILD_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "install_example.cmake: -D${var}=... is required")
  endif()
endforeach()

# Runs one step; stops the test with the step's name and output when it fails.
function(run_step name)
  message(STATUS "[${name}] ${ARGN}")
  execute_process(COMMAND ${ARGN}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step '${name}' failed (exit ${rc}):\n${ARGN}\n--- stdout ---\n${out}\n--- stderr ---\n${err}")
  endif()
  set(STEP_OUTPUT "${out}" PARENT_SCOPE)
endfunction()

# Fresh folders: a stale install or example cache would hide a broken package.
file(REMOVE_RECURSE "${INSTALL_PREFIX}" "${EXAMPLE_BUILD_DIR}")

set(config_args)
if(CONFIG)
  set(config_args --config ${CONFIG})
endif()
run_step(install ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${INSTALL_PREFIX}" ${config_args})

set(prefix_path "${INSTALL_PREFIX}")
if(EXTRA_PREFIX_PATH)
  string(REPLACE "|" ";" extra "${EXTRA_PREFIX_PATH}")
  list(APPEND prefix_path ${extra})
endif()
# A list cannot ride on one command-line argument; an initial-cache script carries it intact.
file(WRITE "${EXAMPLE_BUILD_DIR}/prefix.cmake"
  "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE STRING \"install prefix first\")\n")

set(configure_args -C "${EXAMPLE_BUILD_DIR}/prefix.cmake" -S "${EXAMPLE_SOURCE_DIR}" -B "${EXAMPLE_BUILD_DIR}")
if(GENERATOR)
  list(APPEND configure_args -G "${GENERATOR}")
endif()
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_COMPILER_LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_COMPILER_LAUNCHER}")
endif()
if(CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
endif()
if(TL_EXPECTED_DIR)
  list(APPEND configure_args "-DSTITCHCUDA_TL_EXPECTED_DIR=${TL_EXPECTED_DIR}")
endif()
# The package finds torch through the Python that has it, as a user's project would be told to.
if(PYTHON_EXECUTABLE)
  list(APPEND configure_args "-DPython_EXECUTABLE=${PYTHON_EXECUTABLE}")
endif()
run_step(configure ${CMAKE_COMMAND} ${configure_args})
run_step(build ${CMAKE_COMMAND} --build "${EXAMPLE_BUILD_DIR}" ${config_args})

# Multi-config generators put the program in a per-config folder.
set(demo "${EXAMPLE_BUILD_DIR}/jit_demo")
if(NOT EXISTS "${demo}" AND CONFIG)
  set(demo "${EXAMPLE_BUILD_DIR}/${CONFIG}/jit_demo")
endif()
# Keep the demo's kernel cache inside the build folder, not in the user's home.
set(ENV{STITCHCUDA_CACHE_DIR} "${EXAMPLE_BUILD_DIR}/kernel-cache")
run_step(run "${demo}")
message(STATUS "jit_demo printed:\n${STEP_OUTPUT}")
if(NOT STEP_OUTPUT MATCHES "(^|\n)(ok|no GPU: compiled only)\n")
  message(FATAL_ERROR "jit_demo exited 0 but printed neither 'ok' nor 'no GPU: compiled only':\n${STEP_OUTPUT}")
endif()

# Asked for help, a program says what it does and how to call it, and runs nothing.
run_step(help "${demo}" --help)
if(NOT STEP_OUTPUT MATCHES "^usage: jit_demo\n")
  message(FATAL_ERROR "jit_demo --help printed no usage:\n${STEP_OUTPUT}")
endif()

# The serving example exists when the package was built with the torch layer (stitchcuda::torch).
set(serve "${EXAMPLE_BUILD_DIR}/serve/serve")
if(NOT EXISTS "${serve}" AND CONFIG)
  set(serve "${EXAMPLE_BUILD_DIR}/serve/${CONFIG}/serve")
endif()
if(EXISTS "${serve}")
  run_step(serve_help "${serve}" --help)
  if(NOT STEP_OUTPUT MATCHES "^usage: serve ")
    message(FATAL_ERROR "serve --help printed no usage (it must not take --help for an artifact):\n${STEP_OUTPUT}")
  endif()
  run_step(serve "${serve}" --threads 4 --requests 50)
  message(STATUS "serve printed:\n${STEP_OUTPUT}")
  if(NOT STEP_OUTPUT MATCHES "(^|\n)(ok |no GPU: built only)")
    message(FATAL_ERROR "serve exited 0 but printed neither 'ok' nor 'no GPU: built only':\n${STEP_OUTPUT}")
  endif()
elseif(EXPECT_SERVE)
  message(FATAL_ERROR "the package was built with stitchcuda::torch but examples/cpp/serve was not built")
endif()
