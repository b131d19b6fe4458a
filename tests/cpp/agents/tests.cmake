# Tests of the agents layer (CPU only; models are scripted backends or a local HTTP server). One file
# per source file it tests; agents_fixtures.hpp holds what the agent and loop tests share.
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_retrieval.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_prompts.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_extract.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_kernel_step.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_problem_plan.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_verifier_agent.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_rubric_judge.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_run_dir.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_planner.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_replanner.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_coder.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_optimizer.cpp
)
