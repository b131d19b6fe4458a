// The llm layer's names for the process-wide secret registry (stitchcuda/secrets.hpp).
#include "secrets.hpp"

#include <stitchcuda/secrets.hpp>

namespace stitchcuda::llm::detail {

void remember_secret(const std::string& value) { secrets::remember(value); }

std::string redact(std::string text) { return secrets::redact(text); }

}  // namespace stitchcuda::llm::detail
