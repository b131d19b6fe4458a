# Tests of the agents layer (CPU only): retrieval.
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_retrieval.cpp
)
