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
# The shipped prompts, by absolute path: not from __FILE__, which is relative where ccache's base_dir rewrites
# the compile line (make sets CCACHE_BASEDIR so clones elsewhere reuse the cache).
set_property(SOURCE
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_prompts.cpp ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_rubric_judge.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_planner.cpp ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_optimizer.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_replanner.cpp ${CMAKE_CURRENT_SOURCE_DIR}/agents/test_coder.cpp
  APPEND PROPERTY COMPILE_DEFINITIONS "STITCHCUDA_PROMPTS_DIR=\"${PROJECT_SOURCE_DIR}/python/stitchcuda/agents/prompts\"")
