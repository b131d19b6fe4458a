// Reads a kernel's declared parameter types from its source, so tensor dtypes can be checked
// against what the kernel expects ("const float*" wants float32).
#include <stitchcuda/jit.hpp>

#include <regex>

namespace stitchcuda::jit {
namespace {

std::string trim(std::string s) {
  auto b = s.find_first_not_of(" \t\r\n");
  auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// "const float* __restrict__ a" -> "const float*"
std::string type_of(std::string decl) {
  static const std::regex qualifiers(R"(\b(__restrict__|__restrict|restrict)\b)");
  decl = std::regex_replace(decl, qualifiers, "");
  if (auto eq = decl.find('='); eq != std::string::npos) decl = decl.substr(0, eq);  // default argument
  decl = trim(decl);
  // Drop the trailing parameter name when there is one.
  static const std::regex named(R"(^(.*[\s\*&])([A-Za-z_][A-Za-z0-9_]*)$)");
  std::smatch m;
  if (std::regex_match(decl, m, named) && !m[1].str().empty()) {
    std::string head = trim(m[1]);
    if (!head.empty() && head != "const" && head != "unsigned" && head != "signed") decl = head;
  }
  std::string out;
  for (char c : decl) {
    if (c == '*' || c == '&') {
      while (!out.empty() && out.back() == ' ') out.pop_back();
      out += c;
    } else if (std::isspace(static_cast<unsigned char>(c))) {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += c;
    }
  }
  return trim(out);
}

// Comments can sit between parameters; they are not part of any type.
std::string strip_comments(std::string_view in) {
  std::string out;
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (in.compare(i, 2, "//") == 0) {
      while (i < in.size() && in[i] != '\n') ++i;
      out += '\n';
    } else if (in.compare(i, 2, "/*") == 0) {
      auto end = in.find("*/", i + 2);
      i = end == std::string_view::npos ? in.size() : end + 1;
      out += ' ';
    } else {
      out += in[i];
    }
  }
  return out;
}

bool is_identifier(std::string_view s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  return true;
}

}  // namespace

std::vector<std::string> declared_signature(std::string_view source, std::string_view kernel_name) {
  if (!is_identifier(kernel_name)) return {};
  std::string text = strip_comments(source);
  // Attributes such as __launch_bounds__(256) may sit between __global__ and the name.
  const std::regex decl("__global__(?:[^;{(]|\\([^)]*\\))*?\\b" + std::string(kernel_name) + R"(\s*\(([^)]*)\))");
  std::smatch m;
  if (!std::regex_search(text, m, decl)) return {};
  // A template kernel's parameter types depend on its arguments: no fixed signature.
  auto before = text.substr(0, std::size_t(m.position(0)));
  auto last_semicolon = before.find_last_of(";}");
  auto prefix = before.substr(last_semicolon == std::string::npos ? 0 : last_semicolon);
  if (prefix.find("template") != std::string::npos) return {};
  std::vector<std::string> out;
  std::string params = m[1];
  if (trim(params).empty() || trim(params) == "void") return out;
  std::size_t start = 0;
  int depth = 0;
  for (std::size_t i = 0; i <= params.size(); ++i) {
    if (i < params.size() && (params[i] == '<' || params[i] == '(')) ++depth;
    if (i < params.size() && (params[i] == '>' || params[i] == ')')) --depth;
    if (i == params.size() || (params[i] == ',' && depth == 0)) {
      out.push_back(type_of(params.substr(start, i - start)));
      start = i + 1;
    }
  }
  return out;
}

}  // namespace stitchcuda::jit
