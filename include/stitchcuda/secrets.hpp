// The process's secrets (API keys, tokens), scrubbed by value from everything StitchCUDA writes or sends:
// run directories, transcripts, trajectories, feedback, prompts, errors, CLI output.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace stitchcuda::secrets {

/// Remembers `value` (8 characters or more; shorter ones cannot be real keys and would scrub ordinary
/// words). Its hex and base64 spellings are remembered with it.
void remember(std::string_view value);
/// Remembers the value of every environment variable whose name looks like a credential
/// (`looks_secret`; values that are paths are skipped). Called once when the registry is first used;
/// call again after setting new ones.
void remember_environment();
/// A variable or field name that holds credentials: *API_KEY*, *_KEY, *TOKEN*, *SECRET*, *PASSWORD*,
/// *CREDENTIAL*, *ACCESS_KEY*... (not a provider's other settings: OPENAI_BASE_URL, HF_HOME).
bool looks_secret(std::string_view name);
/// `text` with every run of 8 or more characters that appears in a remembered secret (or in its hex or
/// base64 spelling) replaced by "[redacted]": a key's fragments and encodings leave nothing behind.
/// Runs of digits alone are kept (a number in a JSON file stays a number).
std::string redact(std::string_view text);
/// How many spellings are remembered (tests, diagnostics).
std::size_t count();

}  // namespace stitchcuda::secrets
