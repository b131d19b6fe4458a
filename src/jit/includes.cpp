// The include rule for untrusted CUDA (jit::check_includes), read as NVRTC's preprocessor reads the text:
// the one implementation behind confined compiles, the .stitch loader and Python's jit.check_includes.
#include <stitchcuda/jit.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace stitchcuda::jit {
namespace fs = std::filesystem;
namespace {

const char* kIncludeRule = "untrusted CUDA may include only the CUDA toolkit's headers (CCCL among them) and "
                           "in-memory headers";
constexpr std::string_view kBlank = " \t\f\v";

// A string as Python's repr writes it (the messages read the same from C++ and Python).
std::string python_repr(std::string_view s) {
  std::string out = "'";
  for (unsigned char c : s) {
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 32 || c == 127) {
      const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += char(c);
    }
  }
  return out + "'";
}

bool ident_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == '$'; }
bool ident_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '$'; }
bool non_ascii(char c) { return static_cast<unsigned char>(c) > 127; }
bool hex_digit(char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; }

// `inner` lies inside `root` (both canonical).
bool inside(const fs::path& inner, const fs::path& root) {
  auto r = root.begin(), i = inner.begin();
  for (; r != root.end(); ++r, ++i)
    if (i == inner.end() || *i != *r) return false;
  return true;
}

// One #include-like directive or __has_include: its kind ("include", "include_next", "import", "embed",
// "__has_include", "__has_include_next", or "directive" for a name the rule cannot read), its header name
// (none when computed) and whether it was quoted.
struct Directive {
  int line = 0;
  std::string kind;
  std::optional<std::string> name;
  bool quoted = false;
};

// The text after translation phases 1-3, with directives found in it: line ends normalized, trigraphs
// (`trigraphs`) and backslash-newline splices (with blanks before the line's end: `loose`) resolved,
// comments dropped, string and character literals (raw ones included) skipped, `%:` read as `#`, any blank
// (form feed and vertical tab too) before it. Compilers differ on trigraphs and on blanks after a backslash:
// the caller checks every reading, so that none of them hides a directive another one sees.
class Reader {
 public:
  Reader(std::string_view raw, bool trigraphs, bool loose) {
    std::string text;
    text.reserve(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        text += '\n';
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        text += raw[i];
      }
    }
    if (trigraphs) {
      std::string t;
      for (std::size_t i = 0; i < text.size(); ++i) {
        if (text.compare(i, 3, "?\?=") == 0 || text.compare(i, 3, "?\?/") == 0) {
          t += text[i + 2] == '=' ? '#' : '\\';
          i += 2;
        } else {
          t += text[i];
        }
      }
      text.swap(t);
    }
    for (std::size_t i = 0; i < text.size(); ++i) {
      if (text[i] == '\\') {
        std::size_t j = i + 1;
        if (loose)
          while (j < text.size() && kBlank.find(text[j]) != std::string_view::npos) ++j;
        if (j < text.size() && text[j] == '\n') {
          splices_.push_back(text_.size());  // where a line break was removed, in the joined text
          i = j;
          continue;
        }
      }
      if (text[i] == '\n') newlines_.push_back(text_.size());
      text_ += text[i];
    }
  }

  std::vector<Directive> directives() const {
    std::vector<Directive> found;
    const std::string& t = text_;
    const std::size_t n = t.size();
    std::size_t i = 0;
    bool line_start = true;
    while (i < n) {
      const char c = t[i];
      if (c == '\n') {
        line_start = true;
        ++i;
      } else if (kBlank.find(c) != std::string_view::npos) {
        ++i;
      } else if (t.compare(i, 2, "//") == 0) {
        i = std::min(t.find('\n', i), n);
      } else if (t.compare(i, 2, "/*") == 0) {
        const auto end = t.find("*/", i + 2);
        i = end == std::string::npos ? n : end + 2;
      } else if (line_start && (c == '#' || t.compare(i, 2, "%:") == 0)) {
        line_start = false;
        const std::size_t j = blanks(i + (c == '#' ? 1 : 2));
        const std::size_t m = ident_end(j);
        const bool unreadable = j < n && (t[j] == '\\' || non_ascii(t[j]) ||
                                          (m > j && m < n && (t[m] == '\\' || non_ascii(t[m]))));
        const std::string word = t.substr(j, m - j);
        if (unreadable) {
          found.push_back({line_of(i), "directive", std::nullopt, false});
          i = j + 1;
        } else if (word == "include" || word == "include_next" || word == "import" || word == "embed") {
          const std::size_t start = blanks(m);
          auto [name, after] = header_name(start);
          found.push_back({line_of(i), word, name, start < n && t[start] == '"'});
          i = name ? after : m;
        } else {
          i = m > j ? m : j;
        }
      } else {
        line_start = false;
        const std::size_t m = ident_end(i);
        if (m > i) {
          const std::string word = t.substr(i, m - i);
          const std::size_t word_start = i;
          i = m;
          static const char* prefixes[] = {"u8", "u", "U", "L", "R", "u8R", "uR", "UR", "LR"};
          const bool prefix = std::any_of(std::begin(prefixes), std::end(prefixes), [&](const char* p) { return word == p; });
          if (i < n && (t[i] == '"' || t[i] == '\'') && prefix) {
            i = skip_literal(i, word.back() == 'R' && t[i] == '"');
          } else if (word == "__has_include" || word == "__has_include_next") {
            const std::size_t j = blanks(i);
            std::optional<std::string> name;
            std::size_t start = j;
            if (j < n && t[j] == '(') {
              start = blanks(j + 1);
              auto [got, after] = header_name(start);
              const std::size_t close = blanks(after);
              if (got && close < n && t[close] == ')') {
                name = got;
                i = after;
              }
            }
            found.push_back({line_of(word_start), word, name, start < n && t[start] == '"'});
          }
        } else if (c == '"' || c == '\'') {
          i = skip_literal(i, false);
        } else {
          i = pp_number_end(i);
        }
      }
    }
    return found;
  }

 private:
  std::string text_;
  std::vector<std::size_t> newlines_, splices_;

  int line_of(std::size_t pos) const {
    const auto lines = std::lower_bound(newlines_.begin(), newlines_.end(), pos) - newlines_.begin();
    const auto joined = std::upper_bound(splices_.begin(), splices_.end(), pos) - splices_.begin();
    return int(lines + joined + 1);
  }

  std::size_t blanks(std::size_t j) const {  // blanks and /* */ comments within the line
    const std::size_t n = text_.size();
    while (j < n) {
      if (kBlank.find(text_[j]) != std::string_view::npos) {
        ++j;
      } else if (text_.compare(j, 2, "/*") == 0) {
        const auto end = text_.find("*/", j + 2);
        j = end == std::string::npos ? n : end + 2;
      } else {
        return j;
      }
    }
    return j;
  }

  std::size_t ident_end(std::size_t j) const {
    if (j >= text_.size() || !ident_start(text_[j])) return j;
    while (j < text_.size() && ident_char(text_[j])) ++j;
    return j;
  }

  // A preprocessing number: .?digit (e+ e- p+ p- | letter | digit | _ | . | ' | \uXXXX)*; else one character.
  std::size_t pp_number_end(std::size_t i) const {
    const std::string& t = text_;
    const std::size_t n = t.size();
    std::size_t k = i;
    if (k < n && t[k] == '.') ++k;
    if (k >= n || !std::isdigit(static_cast<unsigned char>(t[k]))) return i + 1;
    ++k;
    while (k < n) {
      const char c = t[k];
      if (std::string_view("eEpP").find(c) != std::string_view::npos && k + 1 < n && (t[k + 1] == '+' || t[k + 1] == '-'))
        k += 2;
      else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '\'')
        ++k;
      else if (c == '\\' && k + 5 < n && t[k + 1] == 'u' && hex_digit(t[k + 2]) && hex_digit(t[k + 3]) &&
               hex_digit(t[k + 4]) && hex_digit(t[k + 5]))
        k += 6;
      else
        break;
    }
    return k;
  }

  std::pair<std::optional<std::string>, std::size_t> header_name(std::size_t j) const {
    const std::size_t n = text_.size();
    if (j < n && (text_[j] == '<' || text_[j] == '"')) {
      const auto end = text_.find(text_[j] == '<' ? '>' : '"', j + 1);
      const auto newline = text_.find('\n', j + 1);
      if (end != std::string::npos && (newline == std::string::npos || end < newline))
        return {text_.substr(j + 1, end - j - 1), end + 1};
    }
    return {std::nullopt, j};
  }

  // The offset after the string or character literal that starts at text_[i] (a quote).
  std::size_t skip_literal(std::size_t i, bool raw) const {
    const std::string& t = text_;
    const std::size_t n = t.size();
    if (raw) {  // R"delim( ... )delim"
      const auto open = t.find('(', i + 1);
      if (open == std::string::npos || open - i - 1 > 16) return i + 1;
      std::string closing(1, ')');
      closing.append(t, i + 1, open - i - 1).push_back('"');
      const auto end = t.find(closing, open);
      return end == std::string::npos ? n : end + closing.size();
    }
    const char quote = t[i];
    std::size_t j = i + 1;
    while (j < n && t[j] != '\n') {
      if (t[j] == '\\')
        j += 2;
      else if (t[j] == quote)
        return j + 1;
      else
        ++j;
    }
    return std::min(j, n);
  }
};

// Why `name` is no header of the toolkit's folders ("" when it is one).
std::string name_problem(const std::string& name, const std::vector<fs::path>& roots) {
  const fs::path path(name);
  bool escapes = path.is_absolute() || name.find('\\') != std::string::npos || name.empty() || name[0] == '~';
  for (const auto& part : path) escapes = escapes || part == "..";
  if (escapes) return std::string("absolute paths and '..' are not allowed (") + kIncludeRule + ")";
  for (const auto& root : roots) {
    std::error_code ec;
    const fs::path candidate = root / path;
    if (!fs::is_regular_file(candidate, ec)) continue;  // a FIFO or a device is no header
    const fs::path real = fs::canonical(candidate, ec);
    if (!ec && inside(real, root)) return "";
  }
  return "'" + name + "' is not a header of the CUDA toolkit (" + kIncludeRule + ")";
}

Result<void> check_directive(const std::string& where, const Directive& d, const CompileOptions& o,
                             const std::vector<fs::path>& roots, std::string_view program_name) {
  const std::string spelled = d.kind[0] == '_' ? d.kind : "#" + d.kind;
  const std::string at = where + ":" + std::to_string(d.line) + ": " + spelled;
  if (d.kind == "include_next" || d.kind == "import" || d.kind == "embed" || d.kind == "__has_include_next")
    return fail(ErrorCode::InvalidArgument, at + ": " + spelled + " is not allowed (" + kIncludeRule + ")");
  if (d.kind == "directive")
    return fail(ErrorCode::InvalidArgument, where + ":" + std::to_string(d.line) + ": a directive spelled with a "
                "universal character name or a non-ASCII letter is not allowed (" + kIncludeRule + ")");
  if (!d.name) {
    const char* what = d.kind == "include" ? "#include (a macro)" : "__has_include (a macro)";
    return fail(ErrorCode::InvalidArgument, at + ": a computed " + what + " cannot be checked (" + kIncludeRule + ")");
  }
  const std::string& name = *d.name;
  for (const auto& [header, text] : o.headers)
    if (header == name) return {};
  const std::string problem = name_problem(name, roots);
  // Whether a name is a toolkit header is all __has_include may learn; anything else is refused.
  if (!problem.empty() && (d.kind != "__has_include" || problem.find("is not a header of the CUDA toolkit") ==
                                                            std::string::npos))
    return fail(ErrorCode::InvalidArgument, at + " '" + name + "': " + problem);
  if (!d.quoted) return {};
  std::error_code ec;
  const fs::path folders[] = {fs::current_path(ec), fs::absolute(fs::path(program_name), ec).parent_path()};
  for (const auto& folder : folders) {  // NVRTC looks there first for a quoted name
    std::error_code missing;
    if (!folder.empty() && fs::exists(fs::symlink_status(folder / name, missing)))
      return fail(ErrorCode::InvalidArgument, at + " '" + name + "': a file of that name in the working folder "
                  "would be read instead of the toolkit's header (" + kIncludeRule + "); compile elsewhere or pass "
                  "it as an in-memory header");
  }
  return {};
}

bool allowed_flag(const std::string& f) {
  static const std::vector<std::string> exact = {
      "--use_fast_math", "-use_fast_math", "-lineinfo", "--generate-line-info", "-G", "--device-debug",
      "--extra-device-vectorization", "-extra-device-vectorization", "-restrict", "--restrict", "-w",
      "--disable-warnings", "-default-device", "--device-as-default-execution-space", "--minimal",
      "-dopt=on", "--dopt=on", "-Wno-deprecated-gpu-targets", "-Wno-deprecated-declarations", "-rdc=true",
      "-rdc=false", "--relocatable-device-code=true", "--relocatable-device-code=false"};
  static const std::vector<std::string> prefixes = {
      "--ftz=", "-ftz=", "--prec-div=", "-prec-div=", "--prec-sqrt=", "-prec-sqrt=", "--fmad=", "-fmad=",
      "--maxrregcount=", "-maxrregcount=", "-D", "--define-macro=", "-U", "--undefine-macro=", "--std=", "-std=",
      "--diag-suppress=", "-diag-suppress=", "--diag-error=", "--diag-warn=", "--gpu-architecture=", "-arch="};
  if (std::find(exact.begin(), exact.end(), f) != exact.end()) return true;
  for (const auto& p : prefixes)
    if (f.rfind(p, 0) == 0) return true;
  return false;
}

bool safe_expression(const std::string& e) {
  return std::all_of(e.begin(), e.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("_:<>,*&()[] .+-").find(c) !=
                                                              std::string_view::npos;
  });
}

bool has_control(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 32; });
}

}  // namespace

Result<void> check_includes(std::string_view source, const CompileOptions& o, std::string_view program_name) {
  if (program_name.find_first_of("/\\") != std::string_view::npos || program_name == "." || program_name == "..")
    return fail(ErrorCode::InvalidArgument, "program_name " + python_repr(program_name) + ": untrusted CUDA is compiled "
                "under a bare file name (NVRTC searches the program's folder for quoted includes)");
  for (const auto& e : o.name_expressions)
    if (!safe_expression(e))
      return fail(ErrorCode::InvalidArgument, "name expression " + python_repr(e) + " holds characters no C++ name needs "
                  "(NVRTC pastes name expressions into the program text)");
  std::vector<std::pair<std::string, std::string>> values = o.defines;
  for (const auto& f : o.extra_flags) values.emplace_back(f, f);
  for (const auto& [name, value] : values)
    if (has_control(name) || has_control(value))
      return fail(ErrorCode::InvalidArgument, "macro " + python_repr(name.substr(0, 40)) + ": a control character (a "
                  "line break) in a macro or flag would start a directive of its own; remove it");
  std::vector<fs::path> roots;
  for (const auto& p : Compiler::system_include_paths()) {
    std::error_code ec;
    fs::path real = fs::canonical(p, ec);
    if (!ec) roots.push_back(real);
  }
  std::vector<std::pair<std::string, std::string_view>> texts = {{std::string(program_name), source}};
  for (const auto& [name, text] : o.headers) texts.emplace_back(name, text);
  for (const auto& [where, text] : texts)
    for (bool trigraphs : {false, true})
      for (bool loose : {false, true})
        for (const auto& d : Reader(text, trigraphs, loose).directives())
          if (auto ok = check_directive(where, d, o, roots, program_name); !ok) return ok;
  for (const auto& p : o.include_paths) {
    std::error_code ec;
    fs::path real = fs::canonical(p, ec);
    bool ok = !ec && std::any_of(roots.begin(), roots.end(), [&](const fs::path& r) { return inside(real, r); });
    if (!ok)
      return fail(ErrorCode::InvalidArgument, "include path '" + p + "' is outside the CUDA toolkit's headers (" +
                                                  kIncludeRule + ")");
  }
  for (const auto& f : o.extra_flags)
    if (!allowed_flag(f))
      return fail(ErrorCode::InvalidArgument, "NVRTC flag '" + f + "' is not allowed for untrusted CUDA (allowed: "
                                              "code-generation flags and -D/-U macros; no include or pre-include flags)");
  return {};
}

}  // namespace stitchcuda::jit
