# Tests of the agents layer (CPU only; models are scripted backends or a local HTTP server).
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_retrieval.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_prompts.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_extract.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_plan.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_feedback.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_run_dir.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_loop.cpp
)
