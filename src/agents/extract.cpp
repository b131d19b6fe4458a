// Finds the candidate (the Python defining `class ModelNew`) in a Coder's reply: fenced blocks of either
// fence style, bare Python, cut-off replies. Every decision is written down in Extraction::notes.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cctype>
#include <regex>
#include <set>
#include <sstream>

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
