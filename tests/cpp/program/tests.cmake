# Tests of the program layer (CPU only): IR and validation, liveness planning, its files (a program, a family,
# a prefill + decode pair).
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_validate.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_plan.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_artifact.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_family.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_state.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/program/test_decode.cpp
)
