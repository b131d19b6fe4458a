// Errors as values: what failed, and what a person needs to act on it.
#pragma once

#include <string>
#include <vector>

#include <tl/expected.hpp>

namespace stitchcuda {

/// Kind of failure; the same names appear as Python exception classes.
enum class ErrorCode {
  InvalidArgument,  ///< the caller passed something unusable (bad option, wrong argument)
  CompileError,     ///< NVRTC rejected the source
  LaunchError,      ///< a kernel could not be launched (configuration, resources, driver)
  CudaError,        ///< any other CUDA driver failure
  NotFound,         ///< a named thing (kernel, file, symbol) does not exist
  Unavailable,      ///< a component (driver, NVRTC, GPU) is missing on this machine
  IoError,          ///< a file or folder could not be read or written
  LlmError,         ///< a model server failed, refused, or answered with something unusable
  Timeout,          ///< an operation did not finish within its time limit
  Cancelled,        ///< the caller cancelled the operation
  Internal,         ///< a bug in StitchCUDA
};

/// The stable name of an error code ("CompileError", ...).
const char* to_string(ErrorCode code) noexcept;

/// One compiler diagnostic, mapped to the source the caller gave.
struct Diagnostic {
  std::string file;         ///< program or header name as the compiler saw it
  int line = 0;             ///< 1-based line in that file (0 if unknown)
  int column = 0;           ///< 1-based column (0 if unknown)
  std::string severity;     ///< "error", "warning" or "remark"
  std::string message;      ///< the compiler's message
  std::string source_line;  ///< the text of that line, when it is the caller's source
};

/// A failure that is a normal outcome in an optimization loop.
struct Error {
  ErrorCode code = ErrorCode::Internal;  ///< kind of failure
  std::string message;                   ///< one paragraph: the problem and the fix
  std::string log;                       ///< full tool output (compiler log, driver text)
  std::vector<Diagnostic> diagnostics;   ///< parsed compiler diagnostics, if any
  int http_status = 0;                   ///< HTTP status of the reply that failed (0: none)
  bool transient = false;                ///< trying again may succeed (connection lost, 429, 5xx...)
  double retry_after_s = -1.0;           ///< how long the server asked to wait first (< 0: it did not say)

  /// message, followed by the log when there is one.
  std::string describe() const;
};

/// Outcome of an operation that can fail normally.
template <class T>
using Result = tl::expected<T, Error>;

/// Builds the unexpected value of a failed Result.
inline tl::unexpected<Error> fail(ErrorCode code, std::string message, std::string log = {}) {
  return tl::unexpected<Error>(Error{code, std::move(message), std::move(log), {}});
}

/// Library version string ("0.1.0").
const char* version() noexcept;

}  // namespace stitchcuda
