// Error formatting and the library version.
#include <stitchcuda/error.hpp>

namespace stitchcuda {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return "InvalidArgument";
    case ErrorCode::CompileError: return "CompileError";
    case ErrorCode::LaunchError: return "LaunchError";
    case ErrorCode::CudaError: return "CudaError";
    case ErrorCode::NotFound: return "NotFound";
    case ErrorCode::Unavailable: return "Unavailable";
    case ErrorCode::IoError: return "IoError";
    case ErrorCode::LlmError: return "LlmError";
    case ErrorCode::Timeout: return "Timeout";
    case ErrorCode::Cancelled: return "Cancelled";
    case ErrorCode::Internal: return "Internal";
  }
  return "Internal";
}

std::string Error::describe() const {
  std::string out = std::string(to_string(code)) + ": " + message;
  if (!log.empty()) {
    out += "\n";
    out += log;
  }
  return out;
}

const char* version() noexcept { return STITCHCUDA_VERSION; }

}  // namespace stitchcuda
