# Tests of the profile layer: summaries, trace JSON, diagnosis, CUPTI record conversion and metric-name
# checks on the CPU; the Tracer and the range profiler on a GPU ([gpu]). test_activity.cpp reads CUPTI's
# record layouts, hence the CUDA headers.
target_sources(stitchcuda_cpp_tests PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/profile/test_trace_summary.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/profile/test_diagnosis.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/profile/test_activity.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/profile/test_tracer.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/profile/test_metrics.cpp
)
set_source_files_properties(${CMAKE_CURRENT_SOURCE_DIR}/profile/test_activity.cpp PROPERTIES
  INCLUDE_DIRECTORIES "${PROJECT_SOURCE_DIR}/src;${CUDAToolkit_INCLUDE_DIRS}")
