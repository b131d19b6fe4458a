// Prompt templates: versioned markdown files (shipped in python/stitchcuda/agents/prompts/, overridable from
// a folder), checked when loaded and filled in one pass so that values are never re-read as template syntax.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <stitchcuda/detail/sha256.hpp>

namespace stitchcuda::agents {
namespace {

/// One `{{...}}` tag: `{{key}}` (placeholder), `{{#key}}` (section start) or `{{/key}}` (section end).
/// Anything else between braces (`{{ x }}`, `{{"a": 1}}`) is literal text.
struct Tag {
  char kind = 0;          // 0: placeholder, '#': open, '/': close
  std::string key;
  std::size_t begin = 0;  // offset of the first '{'
  std::size_t end = 0;    // one past the last '}'
};

bool key_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

/// The next tag at or after `from`, if any.
std::optional<Tag> next_tag(std::string_view text, std::size_t from) {
  for (std::size_t at = text.find("{{", from); at != std::string_view::npos; at = text.find("{{", at + 1)) {
    Tag tag;
    tag.begin = at;
    std::size_t i = at + 2;
    if (i < text.size() && (text[i] == '#' || text[i] == '/')) tag.kind = text[i++];
    const std::size_t key_begin = i;
    while (i < text.size() && key_char(text[i])) ++i;
    if (i == key_begin || text.substr(i, 2) != "}}") continue;
    tag.key = std::string(text.substr(key_begin, i - key_begin));
    tag.end = i + 2;
    return tag;
  }
  return std::nullopt;
}

/// The `{{/key}}` that closes a section opened before `from`.
std::optional<Tag> closing_tag(std::string_view text, const std::string& key, std::size_t from) {
  for (auto tag = next_tag(text, from); tag; tag = next_tag(text, tag->end))
    if (tag->kind == '/' && tag->key == key) return tag;
  return std::nullopt;
}

/// A section tag alone on its line (only blanks around it) takes the whole line with it, so a dropped
/// section leaves no empty line behind. Returns the span to remove: [line start, after the newline).
std::pair<std::size_t, std::size_t> standalone_span(std::string_view text, const Tag& tag) {
  std::size_t b = tag.begin;
  while (b > 0 && (text[b - 1] == ' ' || text[b - 1] == '\t')) --b;
  std::size_t e = tag.end;
  while (e < text.size() && (text[e] == ' ' || text[e] == '\t')) ++e;
  const bool at_line_start = b == 0 || text[b - 1] == '\n';
  const bool at_line_end = e == text.size() || text[e] == '\n';
  if (!at_line_start || !at_line_end) return {tag.begin, tag.end};
  return {b, e == text.size() ? e : e + 1};
}

/// Checks that every `{{#key}}` is closed, every `{{/key}}` opened, and a key is not nested in itself.
Result<void> check_sections(const std::string& where, std::string_view text) {
  std::vector<std::string> open;
  for (auto tag = next_tag(text, 0); tag; tag = next_tag(text, tag->end)) {
    if (tag->kind == '#') {
      if (std::find(open.begin(), open.end(), tag->key) != open.end())
        return fail(ErrorCode::InvalidArgument,
                    where + ": section {{#" + tag->key + "}} is nested inside itself; close it first");
      open.push_back(tag->key);
    } else if (tag->kind == '/') {
      if (open.empty() || open.back() != tag->key)
        return fail(ErrorCode::InvalidArgument,
                    where + ": {{/" + tag->key + "}} closes a section that is not open" +
                        (open.empty() ? std::string() : " (the open one is {{#" + open.back() + "}})"));
      open.pop_back();
    }
  }
  if (!open.empty())
    return fail(ErrorCode::InvalidArgument,
                where + ": section {{#" + open.back() + "}} is not closed; add {{/" + open.back() + "}}");
  return {};
}

/// Fills `text[begin, end)` into `out`; keys without a value are collected in `missing` (the text is still
/// walked so that all of them are reported at once). Offsets stay in the whole template so that "alone on
/// its line" is judged against the real line, also inside a section's body.
void fill(std::string_view text, std::size_t begin, std::size_t end, const std::map<std::string, std::string>& values,
          std::string& out, std::set<std::string>& missing) {
  std::size_t pos = begin;
  for (auto tag = next_tag(text, pos); tag && tag->end <= end; tag = next_tag(text, pos)) {
    out.append(text.substr(pos, tag->begin - pos));
    if (tag->kind == 0) {
      if (auto it = values.find(tag->key); it == values.end()) {
        missing.insert(tag->key);
      } else {
        // Values are usually files or texts ending in a newline; where the template ends the line itself,
        // one newline is enough (no blank line before a closing fence).
        std::string_view value = it->second;
        if (!value.empty() && value.back() == '\n' && tag->end < text.size() && text[tag->end] == '\n')
          value.remove_suffix(1);
        out += value;
      }
      pos = tag->end;
      continue;
    }
    // Sections were checked when the prompt was made, so a section's close tag is there and inside the
    // range; a close tag met on its own cannot occur and is kept as text.
    auto close = tag->kind == '#' ? closing_tag(text, tag->key, tag->end) : std::nullopt;
    if (!close) {
      out.append(text.substr(tag->begin, tag->end - tag->begin));
      pos = tag->end;
      continue;
    }
    const auto [open_b, open_e] = standalone_span(text, *tag);
    const auto [close_b, close_e] = standalone_span(text, *close);
    out.resize(out.size() - (tag->begin - std::max(open_b, pos)));  // a standalone tag's indentation
    auto it = values.find(tag->key);
    if (it == values.end()) missing.insert(tag->key);
    std::string body;
    fill(text, open_e, close_b, values, body, missing);
    if (it != values.end() && !it->second.empty()) out += body;
    pos = close_e;
  }
  out.append(text.substr(pos, end - pos));
}

/// A prompt from a file's text: the version line is taken off, the rest hashed.
Result<Prompt> make_prompt(std::string name, std::string text, std::string path) {
  // Windows line endings would otherwise end up in every rendered prompt.
  text.erase(std::remove(text.begin(), text.end(), '\r'), text.end());
  Prompt p{std::move(name), std::string(1, '0'), {}, std::move(path), {}};
  const std::string_view first(text.data(), std::min(text.find('\n'), text.size()));
  constexpr std::string_view open = "<!--", close = "-->";
  if (first.substr(0, open.size()) == open && first.size() >= open.size() + close.size() &&
      first.substr(first.size() - close.size()) == close) {
    std::istringstream inner(std::string(first.substr(open.size(), first.size() - open.size() - close.size())));
    std::string label, value, rest;
    if (inner >> label && label == "version:" && inner >> value && !(inner >> rest)) {
      p.version = value;
      text.erase(0, std::min(first.size() + 1, text.size()));
    }
  }
  const std::string where = p.path.empty() ? "prompt '" + p.name + "'" : p.path;
  if (auto ok = check_sections(where, text); !ok) return tl::unexpected(ok.error());
  p.text = std::move(text);
  p.sha256 = detail::sha256_hex(p.text);
  return p;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

/// NotFound listing the required prompts `prompts` lacks.
Result<void> check_required(const std::map<std::string, Prompt>& prompts, const std::string& where) {
  std::vector<std::string> absent;
  for (const auto& name : PromptLibrary::required_names())
    if (!prompts.count(name)) absent.push_back(name + ".md");
  if (absent.empty()) return {};
  return fail(ErrorCode::NotFound, "missing required prompt(s) " + join(absent) + " in " + where);
}

/// Reads every `*.md` of `dir` (README.md excepted) into `prompts`, replacing prompts of the same name.
Result<void> read_folder(const std::string& dir, std::map<std::string, Prompt>& prompts) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return fail(ErrorCode::NotFound, "no prompt folder at '" + dir + "'");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.is_regular_file() && entry.path().extension() == ".md" && entry.path().filename() != "README.md")
      files.push_back(entry.path());
  if (ec) return fail(ErrorCode::IoError, "cannot list '" + dir + "': " + ec.message());
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return fail(ErrorCode::IoError, "cannot read '" + path.string() + "'");
    std::ostringstream text;
    text << in.rdbuf();
    auto prompt = make_prompt(path.stem().string(), text.str(), path.string());
    if (!prompt) return tl::unexpected(prompt.error());
    prompts[prompt->name] = std::move(*prompt);
  }
  return {};
}

}  // namespace

const std::vector<std::string>& PromptLibrary::required_names() {
  // answer_*: the Coder's answer contracts, one per Problem::answer, rendered into {{answer}}.
  static const std::vector<std::string> names = {"planner",   "coder_plan", "coder_feedback",   "answer_model_new",
                                                 "answer_kernel_step", "replanner", "verifier"};
  return names;
}

Result<PromptLibrary> PromptLibrary::load(const std::string& dir, const std::string& override_dir) {
  PromptLibrary lib;
  if (auto ok = read_folder(dir, lib.prompts_); !ok) return tl::unexpected(ok.error());
  if (!override_dir.empty())
    if (auto ok = read_folder(override_dir, lib.prompts_); !ok) return tl::unexpected(ok.error());
  const std::string where = "'" + dir + "'" + (override_dir.empty() ? "" : " or '" + override_dir + "'");
  if (auto ok = check_required(lib.prompts_, where); !ok) return tl::unexpected(ok.error());
  return lib;
}

Result<PromptLibrary> PromptLibrary::from_texts(const std::vector<std::pair<std::string, std::string>>& prompts) {
  PromptLibrary lib;
  for (const auto& [name, text] : prompts) {
    auto prompt = make_prompt(name, text, "");
    if (!prompt) return tl::unexpected(prompt.error());
    lib.prompts_[name] = std::move(*prompt);
  }
  if (auto ok = check_required(lib.prompts_, "the given texts"); !ok) return tl::unexpected(ok.error());
  return lib;
}

Result<const Prompt*> PromptLibrary::get(const std::string& name) const {
  if (auto it = prompts_.find(name); it != prompts_.end()) return &it->second;
  std::vector<std::string> names;
  for (const auto& entry : prompts_) names.push_back(entry.first);
  return fail(ErrorCode::NotFound, "no prompt called '" + name + "'; there are: " + join(names));
}

Result<std::string> PromptLibrary::render(const std::string& name,
                                          const std::map<std::string, std::string>& values) const {
  auto prompt = get(name);
  if (!prompt) return tl::unexpected(prompt.error());
  std::string out;
  std::set<std::string> missing;
  const std::string& text = (*prompt)->text;
  fill(text, 0, text.size(), values, out, missing);
  if (!missing.empty())
    return fail(ErrorCode::InvalidArgument,
                "prompt '" + name + "' needs a value for " + join({missing.begin(), missing.end()}) +
                    " (pass \"\" for an empty one)");
  return out;
}

}  // namespace stitchcuda::agents
