// Internals shared by the rubric's detectors: identifier tokens of a blanked source.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace stitchcuda::rubric::detail {

/// One identifier of a source whose comments and literals are blanked.
struct Token {
  std::string word;       ///< the identifier
  std::string dotted;     ///< the identifier with what follows it joined by dots ("mma.sync.aligned")
  std::size_t offset = 0; ///< offset in the source
  int line = 1;           ///< 1-based line
  bool after_dot = false; ///< preceded by '.' (a member or a PTX suffix)
  char next = '\0';       ///< next non-space character
};

/// Identifier tokens of `clean` (numbers are skipped).
std::vector<Token> tokens(std::string_view clean);

}  // namespace stitchcuda::rubric::detail
