// Comment- and string-aware scanning of CUDA and Python sources, and the CUDA technique detectors.
// Everything works on identifier tokens of the blanked text, so a word in a comment, a printf string or
// a docstring never counts, while inline PTX (the strings of asm statements) does.
#include <stitchcuda/rubric.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <set>
#include <utility>

#include "scan.hpp"

namespace stitchcuda::rubric {
namespace {

bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

void blank(std::string& out, std::size_t start, std::size_t end) {
  for (std::size_t k = start; k < std::min(end, out.size()); ++k)
    if (out[k] != '\n') out[k] = ' ';
}

// Whether the quote at `i` is a C++14 digit separator (1'000, 0xFF'FF) rather than a char literal.
bool digit_separator(std::string_view text, std::size_t i) {
  if (i == 0 || !std::isxdigit(static_cast<unsigned char>(text[i - 1]))) return false;
  std::size_t start = i;
  while (start > 0 && (std::isalnum(static_cast<unsigned char>(text[start - 1])) || text[start - 1] == '\'' ||
                       text[start - 1] == '.'))
    --start;
  return std::isdigit(static_cast<unsigned char>(text[start]));
}

// Skips whitespace forward from `i`.
std::size_t skip_space(std::string_view text, std::size_t i) {
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  return i;
}

// Offset of the bracket closing the one at `open` (npos when unbalanced).
std::size_t matching(std::string_view text, std::size_t open, char open_ch, char close_ch) {
  int depth = 0;
  for (std::size_t k = open; k < text.size(); ++k) {
    if (text[k] == open_ch) ++depth;
    else if (text[k] == close_ch && --depth == 0) return k;
  }
  return std::string_view::npos;
}

}  // namespace

std::string strip_cuda(std::string_view text) {
  std::string out(text);
  std::vector<std::pair<std::size_t, std::size_t>> strings;  // contents of string literals
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const char c = text[i];
    if (text.substr(i, 2) == "//") {
      std::size_t end = i;
      // A backslash-newline continues a // comment onto the next line.
      while (end < n && text[end] != '\n') end += (text[end] == '\\' && end + 1 < n) ? 2 : 1;
      blank(out, i, end);
      i = end;
    } else if (text.substr(i, 2) == "/*") {
      std::size_t end = text.find("*/", i + 2);
      end = end == std::string_view::npos ? n : end + 2;
      blank(out, i, end);
      i = end;
    } else if (c == 'R' && text.substr(i, 2) == "R\"" && (i == 0 || !is_ident(text[i - 1]) ||
                                                          text[i - 1] == 'u' || text[i - 1] == 'L' ||
                                                          text[i - 1] == '8' || text[i - 1] == 'U')) {
      std::size_t paren = text.find('(', i + 2);
      std::size_t end = n;
      if (paren != std::string_view::npos) {
        std::string close(1, ')');
        close.append(text.substr(i + 2, paren - i - 2)).push_back('"');
        std::size_t found = text.find(close, paren + 1);
        if (found != std::string_view::npos) end = found + close.size();
      }
      strings.emplace_back(i + 2, end == n ? n : end - 1);
      blank(out, i + 2, end == n ? n : end - 1);
      i = end;
    } else if (c == '"' || (c == '\'' && !digit_separator(text, i))) {
      std::size_t end = i + 1;
      while (end < n && text[end] != c && text[end] != '\n') end += text[end] == '\\' ? 2 : 1;
      end = std::min(end, n);
      strings.emplace_back(i + 1, end);
      blank(out, i + 1, end);
      i = end + 1;
    } else {
      ++i;
    }
  }
  // Inline PTX is code: restore the strings inside asm(...) operands.
  std::vector<std::pair<std::size_t, std::size_t>> asm_ranges;
  for (std::size_t k = 0; k < out.size();) {
    if (!is_ident(out[k]) || (k > 0 && is_ident(out[k - 1]))) {
      ++k;
      continue;
    }
    std::size_t end = k;
    while (end < out.size() && is_ident(out[end])) ++end;
    std::string_view word(out.data() + k, end - k);
    if (word == "asm" || word == "__asm__" || word == "__asm") {
      std::size_t p = skip_space(out, end);
      // Qualifiers: volatile, __volatile__, inline, goto.
      while (p < out.size() && is_ident(out[p])) {
        std::size_t q = p;
        while (q < out.size() && is_ident(out[q])) ++q;
        std::string_view qual(out.data() + p, q - p);
        if (qual != "volatile" && qual != "__volatile__" && qual != "inline" && qual != "goto") break;
        p = skip_space(out, q);
      }
      if (p < out.size() && out[p] == '(') {
        std::size_t close = matching(out, p, '(', ')');
        asm_ranges.emplace_back(p, close == std::string_view::npos ? out.size() : close);
      }
    }
    k = end;
  }
  for (auto [start, end] : strings)
    for (auto [a, b] : asm_ranges)
      if (start > a && start < b)
        for (std::size_t k = start; k < end; ++k) out[k] = text[k];
  return out;
}

std::string strip_python(std::string_view text) {
  std::string out(text);
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const char c = text[i];
    if (c == '#') {
      std::size_t end = text.find('\n', i);
      end = end == std::string_view::npos ? n : end;
      blank(out, i, end);
      i = end;
    } else if (c == '"' || c == '\'') {
      const bool triple = text.substr(i, 3) == std::string(3, c);
      const std::size_t open = triple ? 3 : 1;
      std::size_t end = i + open;
      while (end < n) {
        if (text[end] == '\\') {
          end += 2;
          continue;
        }
        if (triple ? text.substr(end, 3) == std::string(3, c) : (text[end] == c || text[end] == '\n')) break;
        ++end;
      }
      end = std::min(end, n);
      blank(out, i + open, end);
      i = end + (triple ? 3 : 1);
    } else {
      ++i;
    }
  }
  return out;
}

const char* to_string(Technique technique) noexcept {
  switch (technique) {
    case Technique::shared_tiling: return "shared-memory tiling";
    case Technique::vectorized: return "vectorized access";
    case Technique::tensor_cores: return "tensor cores";
    case Technique::async_copies: return "async copies";
    case Technique::warp_shuffles: return "warp shuffles";
    case Technique::fused_launches: return "fused launches";
  }
  return "?";
}

std::string Sighting::describe() const {
  return std::string(to_string(technique)) + ": cuda[" + std::to_string(source) + "]:" + std::to_string(line) +
         ": " + excerpt;
}

bool Techniques::has(Technique technique) const {
  return std::any_of(sightings.begin(), sightings.end(),
                     [&](const Sighting& s) { return s.technique == technique; });
}

namespace detail {

std::vector<Token> tokens(std::string_view clean) {
  std::vector<Token> out;
  int line = 1;
  std::size_t k = 0;
  while (k < clean.size()) {
    const char c = clean[k];
    if (c == '\n') {
      ++line;
      ++k;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t end = k;
      while (end < clean.size() && is_ident(clean[end])) ++end;
      // The dotted run ("mma.sync.aligned") is kept for PTX mnemonics; not after a '.', so that
      // "x.y" yields the token x with dotted "x.y" and y alone is a plain identifier.
      std::size_t dot_end = end;
      while (dot_end < clean.size() && (is_ident(clean[dot_end]) || clean[dot_end] == '.')) ++dot_end;
      Token t;
      t.word = std::string(clean.substr(k, end - k));
      t.dotted = std::string(clean.substr(k, dot_end - k));
      t.offset = k;
      t.line = line;
      t.after_dot = k > 0 && clean[k - 1] == '.';
      std::size_t next = skip_space(clean, end);
      t.next = next < clean.size() ? clean[next] : '\0';
      out.push_back(std::move(t));
      k = end;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      while (k < clean.size() && (is_ident(clean[k]) || clean[k] == '.')) ++k;  // a number is no word
    } else {
      ++k;
    }
  }
  return out;
}

}  // namespace detail

namespace {

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }
bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

const std::set<std::string, std::less<>> kVectorTypes = {
    "float2", "float4", "int2", "int4", "uint2", "uint4", "double2", "double4", "double4_16a", "double4_32a",
    "longlong2", "ulonglong2", "longlong4", "ulonglong4", "short2", "short4", "ushort2", "ushort4", "char4",
    "uchar4", "half2", "__half2", "nv_bfloat162", "__nv_bfloat162", "float4_16a", "float4_32a"};

// The technique a token shows, if any; `barrier` is set when the token is a block-level barrier.
std::optional<Technique> classify(const detail::Token& t, bool& shared, bool& barrier) {
  const std::string_view w = t.word, d = t.dotted;
  if (w == "__shared__") shared = true;
  if (starts_with(w, "__syncthreads") || starts_with(d, "bar.sync") || starts_with(d, "barrier.sync") ||
      starts_with(d, "barrier.cta.sync") || starts_with(d, "mbarrier.") || w == "arrive_and_wait" ||
      (t.after_dot && w == "sync" && t.next == '('))
    barrier = true;
  if (t.after_dot) return std::nullopt;  // members are judged through their dotted head
  if (kVectorTypes.count(w) || w == "__ldg" ||
      ((starts_with(d, "ld.") || starts_with(d, "st.")) &&
       (d.find(".v2") != std::string_view::npos || d.find(".v4") != std::string_view::npos ||
        d.find(".v8") != std::string_view::npos || d.find(".nc") != std::string_view::npos)))
    return Technique::vectorized;
  if (w == "wmma" || w == "mma_sync" || starts_with(d, "mma.") || starts_with(d, "wgmma.") ||
      starts_with(d, "tcgen05.mma"))
    return Technique::tensor_cores;
  if (starts_with(d, "cp.async") || w == "memcpy_async" || w == "__pipeline_memcpy_async" ||
      w == "CUtensorMap" || starts_with(w, "cuTensorMapEncode"))
    return Technique::async_copies;
  if (w == "__shfl" || w == "__shfl_up" || w == "__shfl_down" || w == "__shfl_xor" ||
      (starts_with(w, "__shfl") && ends_with(w, "_sync")) || (starts_with(w, "__reduce_") && ends_with(w, "_sync")) ||
      starts_with(d, "shfl.sync") || starts_with(d, "redux.sync"))
    return Technique::warp_shuffles;
  return std::nullopt;
}

std::string line_excerpt(std::string_view text, std::size_t offset) {
  std::size_t start = text.rfind('\n', offset);
  start = start == std::string_view::npos ? 0 : start + 1;
  std::size_t end = text.find('\n', offset);
  end = end == std::string_view::npos ? text.size() : end;
  std::string line(text.substr(start, end - start));
  const auto first = line.find_first_not_of(" \t\r");
  const auto last = line.find_last_not_of(" \t\r");
  line = first == std::string::npos ? std::string() : line.substr(first, last - first + 1);
  // Evidence goes into logs and prompts: one generated monster line must not flood them.
  if (line.size() > 120) line = line.substr(0, 117) + "...";
  return line;
}

}  // namespace

Techniques detect_techniques(const std::vector<std::string>& cuda) {
  Techniques found;
  std::array<std::optional<Sighting>, kTechniqueCount> first;
  std::optional<Sighting> first_shared;
  bool any_barrier = false;
  for (std::size_t s = 0; s < cuda.size(); ++s) {
    const std::string clean = strip_cuda(cuda[s]);
    for (const detail::Token& t : detail::tokens(clean)) {
      if (t.word == "__global__") ++found.kernels;
      bool shared = false, barrier = false;
      auto technique = classify(t, shared, barrier);
      any_barrier = any_barrier || barrier;
      if (shared && !first_shared)
        first_shared = Sighting{Technique::shared_tiling, s, t.line, line_excerpt(cuda[s], t.offset)};
      if (technique && !first[static_cast<std::size_t>(*technique)])
        first[static_cast<std::size_t>(*technique)] = Sighting{*technique, s, t.line, line_excerpt(cuda[s], t.offset)};
    }
  }
  // A shared array without a barrier is a staging buffer at best, not a tile threads share.
  if (first_shared && any_barrier) first[static_cast<std::size_t>(Technique::shared_tiling)] = first_shared;
  for (auto& sighting : first)
    if (sighting) found.sightings.push_back(std::move(*sighting));
  return found;
}

}  // namespace stitchcuda::rubric
