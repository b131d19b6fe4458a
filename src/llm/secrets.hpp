// API keys are remembered here when they are read, so that every text leaving the llm layer
// (errors, transcripts) can be scrubbed of them, whatever a server echoes back.
#pragma once

#include <string>

namespace stitchcuda::llm::detail {

/// Remembers a secret so redact() removes it; values shorter than 8 characters are not
/// remembered (they would scrub ordinary words and cannot be real keys).
void remember_secret(const std::string& value);

/// `text` with every remembered secret replaced by "[redacted]".
std::string redact(std::string text);

}  // namespace stitchcuda::llm::detail
