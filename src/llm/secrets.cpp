// The process-wide list of secrets to scrub from everything the llm layer writes or reports.
#include "secrets.hpp"

#include <algorithm>
#include <mutex>
#include <string_view>
#include <vector>

namespace stitchcuda::llm::detail {
namespace {

constexpr std::string_view kMask = "[redacted]";

struct SecretList {
  std::mutex mu;
  std::vector<std::string> values;
};

SecretList& secrets() {
  static SecretList list;  // never destroyed before users: function-local static
  return list;
}

}  // namespace

void remember_secret(const std::string& value) {
  if (value.size() < 8) return;
  auto& list = secrets();
  std::lock_guard lock(list.mu);
  if (std::find(list.values.begin(), list.values.end(), value) == list.values.end()) list.values.push_back(value);
}

std::string redact(std::string text) {
  auto& list = secrets();
  std::lock_guard lock(list.mu);
  for (const auto& secret : list.values) {
    for (auto pos = text.find(secret); pos != std::string::npos; pos = text.find(secret, pos + kMask.size()))
      text.replace(pos, secret.size(), kMask);
  }
  return text;
}

}  // namespace stitchcuda::llm::detail
