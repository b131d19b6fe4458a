// Includes Catch2 2.x or 3.x (whichever CMake found) and papers over their differences,
// so the same tests build on the development machine (2.13) and the GPU machine (3.4).
#pragma once

#include <string>
#include <string_view>

#if STITCHCUDA_CATCH_MAJOR >= 3
#include <catch2/catch_all.hpp>
// Catch2 3 moved Approx into the Catch namespace; 2.x exports it globally.
using Catch::Approx;
// Catch2 3 reports a skipped test as skipped.
#define STITCHCUDA_SKIP(msg) SKIP(msg)
#else
#include <catch2/catch.hpp>
// Catch2 2 has no SKIP: leave a visible warning and end the test case.
#define STITCHCUDA_SKIP(msg) \
  do {                       \
    WARN(msg);               \
    return;                  \
  } while (0)
#endif

namespace stitchcuda_test {

// Matcher names differ between Catch2 2 and 3; a plain predicate reads the same in both.
inline bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace stitchcuda_test
