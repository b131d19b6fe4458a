# Tests of the batching server example (examples/cpp/server): its pure half (requests, batcher, HTTP
# front, command line) with a CPU runner, no GPU or torch. Built where cpp-httplib is found, like the server;
# so are the CPU stand-in of the server and the load client that tests/python/test_server_load.py runs.
include(${PROJECT_SOURCE_DIR}/examples/cpp/server/httplib.cmake)
if(TARGET stitchcuda_httplib)
  set(_server ${PROJECT_SOURCE_DIR}/examples/cpp/server)
  add_library(stitchcuda_test_server_core STATIC
    ${_server}/model.cpp ${_server}/batcher.cpp ${_server}/http.cpp ${_server}/cli.cpp)
  target_compile_features(stitchcuda_test_server_core PUBLIC cxx_std_20)
  # Only the server's own targets see its folder: its model.hpp and http.hpp must not shadow other headers.
  target_include_directories(stitchcuda_test_server_core PRIVATE ${_server})
  target_link_libraries(stitchcuda_test_server_core PUBLIC stitchcuda::stitchcuda stitchcuda_httplib
    nlohmann_json::nlohmann_json Threads::Threads)
  target_sources(stitchcuda_cpp_tests PRIVATE
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_request.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_batcher.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_http.cpp
  )
  set_source_files_properties(
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_request.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_batcher.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_http.cpp
    PROPERTIES INCLUDE_DIRECTORIES ${_server})
  target_link_libraries(stitchcuda_cpp_tests PRIVATE stitchcuda_test_server_core)

  add_executable(stitchcuda_server_cpu ${CMAKE_CURRENT_SOURCE_DIR}/server/cpu_server.cpp)
  add_executable(stitchcuda_server_load ${_server}/load.cpp)
  foreach(_exe stitchcuda_server_cpu stitchcuda_server_load)
    target_include_directories(${_exe} PRIVATE ${_server} ${CMAKE_CURRENT_SOURCE_DIR})
    target_link_libraries(${_exe} PRIVATE stitchcuda_test_server_core)
  endforeach()
else()
  message(STATUS "the server tests are not built: ${STITCHCUDA_HTTPLIB_WHY}")
endif()
