# Tests of the rubric layer (CPU only): the source detectors, the four items and the Judge, the reward.
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/rubric/test_detect.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/rubric/test_items.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/rubric/test_reward.cpp
)
