# Tests of the batching server example (examples/cpp/server): its pure half (requests, batcher, HTTP
# front) with a CPU runner, no GPU or torch. Built where cpp-httplib is found, like the server.
include(${PROJECT_SOURCE_DIR}/examples/cpp/server/httplib.cmake)
if(TARGET stitchcuda_httplib)
  set(_server ${PROJECT_SOURCE_DIR}/examples/cpp/server)
  target_sources(stitchcuda_cpp_tests PRIVATE
    ${_server}/model.cpp ${_server}/batcher.cpp ${_server}/http.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_request.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_batcher.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_http.cpp
  )
  # Only these files see the server's folder: its model.hpp and http.hpp must not shadow other headers.
  set_source_files_properties(
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_request.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_batcher.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/server/test_http.cpp
    PROPERTIES INCLUDE_DIRECTORIES ${_server})
  target_link_libraries(stitchcuda_cpp_tests PRIVATE stitchcuda_httplib)
else()
  message(STATUS "the server tests are not built: ${STITCHCUDA_HTTPLIB_WHY}")
endif()
