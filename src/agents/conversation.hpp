// What the agents that talk to a model share (internal to src/agents/): retrieval of documentation for
// a prompt, one recorded call, and the bounded re-ask loop.
#pragma once

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <stitchcuda/agents.hpp>

namespace stitchcuda::agents::detail {

/// The `k` sections retrieved for `query` as prompt text, and their ids for the record ("" and none
/// without a retriever).
std::pair<std::string, std::vector<std::string>> retrieve(const Retriever* docs, std::size_t k, const std::string& query);

/// One call to the model, recorded as an Exchange whether it succeeded or not; `*error` is set when
/// it failed (the Exchange's `error` says so too).
Exchange call(llm::Backend& llm, const llm::Options& options, std::string agent, std::vector<llm::Message> messages,
              const Prompt& prompt, const std::vector<std::string>& snippets, Error* error);

/// A candidate as prompts show it, fenced: a kernel step (KernelStep::to_json's text) as its ```cuda
/// source and a ```json launch block, the way the Coder was asked to write it; anything else as ```python.
std::string fenced_candidate(const std::string& candidate);

/// Asks until `parse` accepts a reply: an unusable one is answered with parse's error and `again`, up to
/// `repairs` times. Every call is appended to `exchanges`. A backend error ends it; so does running out
/// of repairs, which leaves `problem` with the last reply's fault and returns nothing.
template <class Parse>
Result<std::optional<std::invoke_result_t<Parse, const Exchange&>>> converse(
    llm::Backend& llm, const AgentOptions& options, const std::string& agent, const Prompt& prompt,
    const std::vector<std::string>& snippets, std::string text, Parse parse, const std::string& again,
    std::vector<Exchange>& exchanges, std::string& problem) {
  std::vector<llm::Message> messages{{"user", std::move(text)}};
  for (int round = 0; round <= options.max_repairs; ++round) {
    Error error;
    Exchange e = call(llm, options.llm, agent, messages, prompt, snippets, &error);
    const bool failed = !e.error.empty();
    exchanges.push_back(e);
    if (failed) return tl::unexpected(error);
    auto parsed = parse(e);
    if (parsed) return std::optional(std::move(parsed));
    problem = parsed.error().message;
    messages.push_back({"assistant", e.reply});
    messages.push_back({"user", "Your answer cannot be used: " + problem + "\n" + again});
  }
  return std::nullopt;
}

}  // namespace stitchcuda::agents::detail
