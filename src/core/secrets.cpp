// Redaction by value: every secret the process knows, with its hex and base64 spellings, as the set of
// its 8-character windows; a text is scanned once and every window found is masked.
#include <stitchcuda/secrets.hpp>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <regex>
#include <string>
#include <unordered_set>
#include <vector>

extern char** environ;

namespace stitchcuda::secrets {
namespace {

constexpr std::size_t kWindow = 8;
constexpr std::string_view kMask = "[redacted]";

struct Registry {
  std::mutex mu;
  std::unordered_set<std::string> values;   // every spelling remembered
  std::unordered_set<std::string> windows;  // their kWindow-character substrings
  bool environment_read = false;
};

Registry& registry() {
  static Registry r;  // function-local: alive for every user
  return r;
}

std::string hex(std::string_view s, bool upper) {
  static const char* lo = "0123456789abcdef";
  static const char* hi = "0123456789ABCDEF";
  const char* d = upper ? hi : lo;
  std::string out;
  for (unsigned char c : s) out += d[c >> 4], out += d[c & 15];
  return out;
}

std::string base64(std::string_view s) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  std::size_t i = 0;
  for (; i + 3 <= s.size(); i += 3) {
    unsigned v = (unsigned char)s[i] << 16 | (unsigned char)s[i + 1] << 8 | (unsigned char)s[i + 2];
    out += t[v >> 18 & 63], out += t[v >> 12 & 63], out += t[v >> 6 & 63], out += t[v & 63];
  }
  return out;  // the last partial group depends on what follows the secret: left out
}

void add_locked(Registry& r, const std::string& value) {
  if (value.size() < kWindow || !r.values.insert(value).second) return;
  for (std::size_t i = 0; i + kWindow <= value.size(); ++i) r.windows.insert(value.substr(i, kWindow));
}

void remember_locked(Registry& r, std::string_view value) {
  if (value.size() < kWindow) return;
  const std::string v(value);
  add_locked(r, v);
  add_locked(r, hex(v, false));
  add_locked(r, hex(v, true));
  // base64 of the secret inside a longer text: each of the three alignments, without the groups that
  // mix in neighbouring bytes (the first one for offsets 1 and 2).
  for (std::size_t skip = 0; skip < 3 && skip < v.size(); ++skip) {
    std::string enc = base64(std::string_view(v).substr(skip));
    add_locked(r, enc);
    // url-safe alphabet too
    std::replace(enc.begin(), enc.end(), '+', '-');
    std::replace(enc.begin(), enc.end(), '/', '_');
    add_locked(r, enc);
  }
}

void read_environment_locked(Registry& r) {
  r.environment_read = true;
  for (char** e = environ; e && *e; ++e) {
    std::string_view entry(*e);
    auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view value = entry.substr(eq + 1);
    // A path is a setting, not a credential (XDG-style *_KEY_FILE=/path, a socket).
    if (value.empty() || value[0] == '/' || value[0] == '~' || value[0] == '.') continue;
    if (looks_secret(entry.substr(0, eq))) remember_locked(r, value);
  }
}

}  // namespace

bool looks_secret(std::string_view name) {
  // Names that hold credentials, not the provider's other settings (OPENAI_BASE_URL, HF_HOME and
  // AWS_REGION are not secrets, and scrubbing their values would mask ordinary paths and URLs).
  static const std::regex pattern(
      "(API_?KEY|_KEY$|^KEY$|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_?KEY|ACCESS_?KEY|SESSION_?KEY)",
      std::regex::icase);
  return std::regex_search(std::string(name), pattern);
}

void remember(std::string_view value) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  if (!r.environment_read) read_environment_locked(r);
  remember_locked(r, value);
}

void remember_environment() {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  read_environment_locked(r);
}

std::string redact(std::string_view text) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  if (!r.environment_read) read_environment_locked(r);
  if (r.windows.empty() || text.size() < kWindow) return std::string(text);
  std::vector<bool> masked(text.size(), false);
  bool any = false;
  std::string window(kWindow, ' ');
  for (std::size_t i = 0; i + kWindow <= text.size(); ++i) {
    window.assign(text.substr(i, kWindow));
    // Digits alone are left: a number in a JSON file (a time, an error) must stay a number.
    if (std::all_of(window.begin(), window.end(), [](unsigned char c) { return std::isdigit(c); })) continue;
    if (r.windows.count(window)) {
      std::fill(masked.begin() + i, masked.begin() + i + kWindow, true);
      any = true;
    }
  }
  if (!any) return std::string(text);
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    if (!masked[i]) {
      out += text[i++];
      continue;
    }
    while (i < text.size() && masked[i]) ++i;
    out += kMask;
  }
  return out;
}

std::size_t count() {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  if (!r.environment_read) read_environment_locked(r);
  return r.values.size();
}

}  // namespace stitchcuda::secrets
