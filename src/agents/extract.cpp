// Finds the candidate (the Python defining `class ModelNew`) in a Coder's reply: fenced blocks of either
// fence style, bare Python, cut-off replies. Every decision is written down in Extraction::notes.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cctype>
#include <regex>
#include <optional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace stitchcuda::agents {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

/// Lines of the reply with CRLF and lone CR turned into LF.
std::vector<std::string> split_lines(std::string_view reply) {
  std::vector<std::string> lines(1);
  for (std::size_t i = 0; i < reply.size(); ++i) {
    const char c = reply[i];
    if (c == '\r' || c == '\n') {
      if (c == '\r' && i + 1 < reply.size() && reply[i + 1] == '\n') ++i;
      lines.emplace_back();
    } else {
      lines.back() += c;
    }
  }
  if (lines.back().empty()) lines.pop_back();  // a final newline ends the last line; it opens none
  return lines;
}

/// A fence line: indentation, 3+ backticks or tildes, then the info string.
struct Fence {
  std::size_t indent = 0;
  char ch = 0;
  std::size_t length = 0;
  std::string info;
};

std::optional<Fence> parse_fence(const std::string& line) {
  Fence f;
  while (f.indent < line.size() && line[f.indent] == ' ') ++f.indent;
  if (f.indent >= line.size() || (line[f.indent] != '`' && line[f.indent] != '~')) return std::nullopt;
  f.ch = line[f.indent];
  std::size_t i = f.indent;
  while (i < line.size() && line[i] == f.ch) ++i;
  f.length = i - f.indent;
  if (f.length < 3) return std::nullopt;
  f.info = line.substr(i);
  if (f.ch == '`' && f.info.find('`') != std::string::npos) return std::nullopt;  // inline code, not a fence
  return f;
}

/// The language of an info string: its first word, lower case, without `{.` `}` decoration
/// ("Python title=x.py" -> "python", "{.cuda}" -> "cuda").
std::string language_of(const std::string& info) {
  std::istringstream words(info);
  std::string word;
  words >> word;
  word.erase(0, std::min(word.find_first_not_of("{."), word.size()));
  if (!word.empty() && word.back() == '}') word.pop_back();
  return lower(word);
}

bool closes(const std::string& line, const Fence& open) {
  std::size_t i = 0;
  while (i < line.size() && line[i] == ' ') ++i;
  std::size_t n = 0;
  while (i + n < line.size() && line[i + n] == open.ch) ++n;
  if (n < open.length) return false;
  return line.find_first_not_of(" \t", i + n) == std::string::npos;
}

/// The reply's fenced blocks, in order; a fence still open at the end is a block with closed = false.
std::vector<CodeBlock> fenced_blocks(const std::vector<std::string>& lines) {
  std::vector<CodeBlock> blocks;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    auto fence = parse_fence(lines[i]);
    if (!fence) continue;
    CodeBlock block;
    block.language = language_of(fence->info);
    block.line = int(i) + 1;
    block.closed = false;
    for (++i; i < lines.size(); ++i) {
      if (closes(lines[i], *fence)) {
        block.closed = true;
        break;
      }
      // An indented fence (inside a list item) indents its content as much: take that off.
      const std::string& l = lines[i];
      std::size_t strip = 0;
      while (strip < fence->indent && strip < l.size() && l[strip] == ' ') ++strip;
      block.code += l.substr(strip) + "\n";
    }
    blocks.push_back(std::move(block));
  }
  return blocks;
}

bool python_language(const std::string& language) {
  static const std::set<std::string> names = {"", "python", "py", "python3", "py3"};
  return names.count(language) > 0;
}

bool defines_model_new(std::string_view code) {
  static const std::regex pattern(R"((^|\n)[ \t]*class[ \t]+ModelNew\b)");
  return std::regex_search(code.begin(), code.end(), pattern);
}

std::string shown(const std::string& language) { return language.empty() ? "unlabeled" : language; }

std::string block_name(const std::vector<CodeBlock>& blocks, std::size_t i) {
  return "block " + std::to_string(i + 1) + " of " + std::to_string(blocks.size()) + " (" +
         shown(blocks[i].language) + ", line " + std::to_string(blocks[i].line) + ")";
}

/// What to ask the model for when the reply was cut off.
constexpr const char* kShorterAnswer =
    "ask for a shorter answer (only the code, fewer comments, no explanation) or raise max_tokens";

/// The reply has no fence: it is the candidate itself when it defines ModelNew. Prose lines before the
/// first line that can start a Python module are dropped.
Result<Extraction> bare_python(const std::vector<std::string>& lines, bool cut) {
  std::string all;
  for (const auto& l : lines) all += l + "\n";
  if (!defines_model_new(all))
    return fail(ErrorCode::LlmError,
                "no code block defines class ModelNew: the reply has no fenced code block and does not define "
                "ModelNew; ask for one ```python block defining class ModelNew(torch.nn.Module)");
  if (cut)
    return fail(ErrorCode::LlmError,
                "the reply was cut off (finish reason \"length\") while it was the code itself, so the code is "
                "incomplete; " + std::string(kShorterAnswer));
  static const std::regex module_start(R"(^(import |from |class |def |@|#|"""|'''))");
  std::size_t first = 0;
  while (first < lines.size() && !std::regex_search(lines[first], module_start)) ++first;
  Extraction out;
  for (std::size_t i = first; i < lines.size(); ++i) out.code += lines[i] + "\n";
  out.notes.push_back("the reply has no fenced block; took the reply itself as Python defining ModelNew");
  if (first > 0)
    out.notes.push_back("dropped " + std::to_string(first) + " line(s) of prose before the first Python line");
  return out;
}

}  // namespace

Result<Extraction> extract_code(std::string_view reply, std::string_view finish_reason) {
  const bool cut = finish_reason == "length";
  if (std::all_of(reply.begin(), reply.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }))
    return fail(ErrorCode::LlmError, std::string("the model returned an empty reply") +
                                         (cut ? " (cut off at max_tokens before any text: raise max_tokens)"
                                              : "; ask again for one ```python block defining class ModelNew"));

  const auto lines = split_lines(reply);
  auto blocks = fenced_blocks(lines);
  if (blocks.empty()) return bare_python(lines, cut);

  std::vector<std::size_t> candidates;
  for (std::size_t i = 0; i < blocks.size(); ++i)
    if (python_language(blocks[i].language) && defines_model_new(blocks[i].code)) candidates.push_back(i);

  Extraction out;
  out.truncated = cut || !blocks.back().closed;
  if (candidates.empty()) {
    std::string list;
    for (const auto& b : blocks) list += (list.empty() ? "" : ", ") + shown(b.language);
    std::string message = "no code block defines class ModelNew (blocks seen: " + list +
                          "); ask for one ```python block defining class ModelNew(torch.nn.Module), with the CUDA "
                          "source as a string inside it";
    if (out.truncated) message += "; the reply was also cut off, so " + std::string(kShorterAnswer);
    return fail(ErrorCode::LlmError, message);
  }

  const std::size_t pick = candidates.back();
  const CodeBlock& chosen = blocks[pick];
  if (!chosen.closed)
    return fail(ErrorCode::LlmError, "the reply was cut off inside the code block defining ModelNew (" +
                                         block_name(blocks, pick) + " never closes), so the code is incomplete; " +
                                         kShorterAnswer);
  out.code = chosen.code;
  out.notes.push_back("picked " + block_name(blocks, pick) + ": " +
                      (candidates.size() == 1
                           ? std::string("the only block defining class ModelNew")
                           : "the last of " + std::to_string(candidates.size()) + " blocks defining class ModelNew"));
  if (!blocks.back().closed)
    out.notes.push_back("the reply was cut off inside " + block_name(blocks, blocks.size() - 1) +
                        ", after the candidate; the candidate itself is complete");
  else if (cut)
    out.notes.push_back("the model stopped at max_tokens after the candidate's block closed; the code is complete");
  out.blocks = std::move(blocks);
  return out;
}

}  // namespace stitchcuda::agents

// ---- kernel steps: a graph-mode target's answer ---------------------------------------------------

namespace stitchcuda::agents {
namespace {

using Json = nlohmann::json;

bool cuda_language(const std::string& language) {
  static const std::set<std::string> names = {"cuda", "cu", "cpp", "c++", "cxx", "c", "cuh"};
  return names.count(language) > 0;
}

/// Names of the `__global__` functions a source defines (extern "C" or not).
std::vector<std::string> global_functions(std::string_view source) {
  static const std::regex pattern(R"(__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?([A-Za-z_]\w*)\s*\()");
  std::vector<std::string> names;
  for (std::cregex_iterator it(source.data(), source.data() + source.size(), pattern), end; it != end; ++it)
    names.push_back((*it)[1].str());
  return names;
}

/// The form of one launch expression: integers, in<k>/out<k> with .shape[d] or .numel, + - * / % ( ) ,
/// and the functions ceil_div, min, max. The value is computed where shapes are known; here a typo is
/// caught while the model can still be asked again.
std::string expression_problem(const std::string& text) {
  if (text.empty()) return "empty expression";
  if (text.size() > 200) return "longer than 200 characters";
  static const std::set<std::string> words = {"shape", "numel", "ceil_div", "min", "max"};
  static const std::regex buffer(R"((in|out)\d+)");
  int depth = 0;
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (std::isspace(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) ||
        std::string_view("+-*/%,.[]").find(c) != std::string_view::npos) {
      ++i;
      continue;
    }
    if (c == '(' || c == ')') {
      depth += c == '(' ? 1 : -1;
      if (depth < 0) return "unbalanced ')'";
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t j = i;
      while (j < text.size() && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_')) ++j;
      const std::string word = text.substr(i, j - i);
      if (!words.count(word) && !std::regex_match(word, buffer))
        return "unknown name '" + word + "' (use in0.., out0.., .shape[d], .numel, ceil_div, min, max)";
      i = j;
      continue;
    }
    return std::string("unexpected character '") + c + "'";
  }
  return depth == 0 ? "" : "unbalanced '('";
}

std::string as_expression(const Json& v) {
  if (v.is_number_integer()) return std::to_string(v.get<long long>());
  if (v.is_string()) return v.get<std::string>();
  return "";
}

/// Fields of a kernel step from a JSON object (the launch block, or the canonical text), every problem listed.
Result<KernelStep> kernel_step_from(const Json& j, std::string source) {
  std::vector<std::string> problems;
  KernelStep step;
  step.source = std::move(source);
  if (!j.is_object()) return fail(ErrorCode::InvalidArgument, "a kernel step is a JSON object");
  if (j.contains("kernel") && j["kernel"].is_string()) step.kernel = j["kernel"].get<std::string>();
  else problems.push_back("kernel: missing (the __global__ function to launch)");
  auto dims = [&](const char* key, std::vector<std::string>& out) {
    if (!j.contains(key)) return problems.push_back(std::string(key) + ": missing");
    const Json& v = j[key];
    const Json list = v.is_array() ? v : Json::array({v});
    if (list.empty() || list.size() > 3) return problems.push_back(std::string(key) + ": 1-3 entries");
    for (std::size_t i = 0; i < list.size(); ++i) {
      std::string e = as_expression(list[i]);
      const std::string why = e.empty() ? "an integer or an expression string" : expression_problem(e);
      if (!why.empty()) problems.push_back(std::string(key) + "[" + std::to_string(i) + "]: " + why);
      out.push_back(std::move(e));
    }
  };
  dims("grid", step.grid);
  dims("block", step.block);
  if (j.contains("shared_bytes")) {
    step.shared_bytes = as_expression(j["shared_bytes"]);
    const std::string why = step.shared_bytes.empty() ? "an integer or an expression string" : expression_problem(step.shared_bytes);
    if (!why.empty()) problems.push_back("shared_bytes: " + why);
  }
  if (!j.contains("args") || !j["args"].is_array()) {
    problems.push_back("args: missing (a list: \"in0\", \"out0\", or scalar expressions, in the kernel's order)");
  } else {
    for (std::size_t i = 0; i < j["args"].size(); ++i) {
      std::string e = as_expression(j["args"][i]);
      const std::string why = e.empty() ? "a buffer name or an expression string" : expression_problem(e);
      if (!why.empty()) problems.push_back("args[" + std::to_string(i) + "]: " + why);
      step.args.push_back(std::move(e));
    }
  }
  if (step.source.find("__global__") == std::string::npos) problems.push_back("source: no __global__ function");
  if (!step.kernel.empty()) {
    const auto names = global_functions(step.source);
    if (std::find(names.begin(), names.end(), step.kernel) == names.end()) {
      std::string list;
      for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
      problems.push_back("kernel '" + step.kernel + "' is not a __global__ function of the source (it defines: " +
                         (list.empty() ? std::string("none") : list) + ")");
    }
  }
  if (!problems.empty()) {
    std::string message = "the kernel step is invalid: ";
    for (std::size_t i = 0; i < problems.size(); ++i) message += (i ? "; " : "") + problems[i];
    return fail(ErrorCode::InvalidArgument, message);
  }
  return step;
}

}  // namespace

std::string KernelStep::to_json() const {
  Json j{{"kernel_step", 1}, {"kernel", kernel}, {"grid", grid}, {"block", block},
         {"shared_bytes", shared_bytes}, {"args", args}, {"source", source}};
  return j.dump(2, ' ', false, Json::error_handler_t::replace);
}

Result<KernelStep> KernelStep::parse(std::string_view text) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("kernel_step", 0) != 1)
    return fail(ErrorCode::InvalidArgument, "not a kernel step: expected a JSON object with \"kernel_step\": 1");
  if (!j.contains("source") || !j["source"].is_string())
    return fail(ErrorCode::InvalidArgument, "the kernel step is invalid: source: missing");
  return kernel_step_from(j, j["source"].get<std::string>());
}

Result<Extraction> extract_kernel_step(std::string_view reply, std::string_view finish_reason) {
  const bool cut = finish_reason == "length";
  const std::string ask = "answer with one ```cuda block holding the kernel and one ```json block "
                          "{\"kernel\", \"grid\", \"block\", \"shared_bytes\", \"args\"}";
  if (std::all_of(reply.begin(), reply.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }))
    return fail(ErrorCode::LlmError, "the model returned an empty reply" +
                                         std::string(cut ? " (cut off at max_tokens: raise max_tokens)" : "; " + ask));
  Extraction out;
  out.blocks = fenced_blocks(split_lines(reply));
  out.truncated = cut || (!out.blocks.empty() && !out.blocks.back().closed);
  std::optional<std::size_t> cuda, launch;
  for (std::size_t i = 0; i < out.blocks.size(); ++i) {
    const CodeBlock& b = out.blocks[i];
    if (cuda_language(b.language) && b.code.find("__global__") != std::string::npos) cuda = i;
    else if (b.language == "json") launch = i;
  }
  if (!cuda)
    return fail(ErrorCode::LlmError, std::string("no ```cuda block defines a __global__ kernel; ") + ask +
                                         (out.truncated ? std::string("; the reply was also cut off, so ") + kShorterAnswer : ""));
  if (!out.blocks[*cuda].closed)
    return fail(ErrorCode::LlmError, "the reply was cut off inside the CUDA block (" + block_name(out.blocks, *cuda) +
                                         " never closes); " + kShorterAnswer);
  if (!launch)
    return fail(ErrorCode::LlmError, "the reply has the kernel but no ```json launch block; " + ask);
  if (!out.blocks[*launch].closed)
    return fail(ErrorCode::LlmError, "the reply was cut off inside the launch block; " + std::string(kShorterAnswer));
  Json j = Json::parse(out.blocks[*launch].code, nullptr, false);
  if (j.is_discarded())
    return fail(ErrorCode::LlmError, "the ```json launch block (" + block_name(out.blocks, *launch) +
                                         ") is not valid JSON; " + ask);
  auto step = kernel_step_from(j, out.blocks[*cuda].code);
  if (!step) return fail(ErrorCode::LlmError, step.error().message + "; " + ask);
  out.code = step->to_json();
  out.notes.push_back("kernel from " + block_name(out.blocks, *cuda) + ", launch from " + block_name(out.blocks, *launch));
  return out;
}

}  // namespace stitchcuda::agents
