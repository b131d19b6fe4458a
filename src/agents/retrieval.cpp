// BM25 retrieval over markdown sections: what the Planner and Coder are shown from the documentation
// corpus (python/stitchcuda/agents/corpus/) or a user's own folder.
#include <stitchcuda/agents.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace stitchcuda::agents {
namespace {

const std::set<std::string>& stop_words() {
  static const std::set<std::string> words = {
      "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "into", "is", "it", "its", "of",
      "on", "or", "that", "the", "this", "to", "with", "when", "which", "what", "how", "than", "then", "so"};
  return words;
}

std::string slug(std::string_view heading) {
  std::string out;
  for (char c : heading) {
    if (std::isalnum(static_cast<unsigned char>(c))) out += char(std::tolower(static_cast<unsigned char>(c)));
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "section" : out;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// Splits one markdown document at "## " headings (outside code fences).
std::vector<Snippet> sections(const std::string& name, const std::string& markdown) {
  std::vector<Snippet> out;
  std::string doc_title = name, heading, body;
  bool fenced = false, any_heading = false;
  auto flush = [&] {
    std::string text = trim(body);
    if (!text.empty() && (any_heading || text.find_first_not_of("#\n ") != std::string::npos)) {
      Snippet s;
      s.id = name + "#" + (heading.empty() ? std::string("overview") : slug(heading));
      s.title = heading.empty() ? doc_title : doc_title + " — " + heading;
      s.text = text;
      out.push_back(std::move(s));
    }
    body.clear();
  };
  std::istringstream in(markdown);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("```", 0) == 0) fenced = !fenced;
    if (!fenced && line.rfind("# ", 0) == 0 && doc_title == name) {
      doc_title = trim(line.substr(2));
      continue;
    }
    if (!fenced && line.rfind("## ", 0) == 0) {
      flush();
      heading = trim(line.substr(3));
      any_heading = true;
    }
    body += line + "\n";
  }
  flush();
  // Ids stay unique when two sections share a heading.
  std::map<std::string, int> seen;
  for (Snippet& s : out)
    if (int n = seen[s.id]++; n > 0) s.id += "-" + std::to_string(n + 1);
  return out;
}

}  // namespace

std::vector<std::string> Retriever::tokenize(std::string_view text) {
  std::vector<std::string> out;
  std::string word;
  auto push = [&] {
    if (!word.empty() && !stop_words().count(word)) out.push_back(word);
    word.clear();
  };
  for (char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') word += char(std::tolower(static_cast<unsigned char>(c)));
    else push();
  }
  push();
  return out;
}

Retriever Retriever::from_documents(std::vector<std::pair<std::string, std::string>> documents, Bm25 params) {
  Retriever r;
  r.params_ = params;
  for (auto& [name, markdown] : documents)
    for (Snippet& s : sections(name, markdown)) r.snippets_.push_back(std::move(s));
  r.index();
  return r;
}

Result<Retriever> Retriever::from_folder(const std::string& dir, Bm25 params) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return fail(ErrorCode::NotFound, "no documentation folder at '" + dir + "': give a folder of markdown files");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.is_regular_file() && entry.path().extension() == ".md" && entry.path().filename() != "README.md")
      files.push_back(entry.path());
  if (ec) return fail(ErrorCode::IoError, "cannot list '" + dir + "': " + ec.message());
  if (files.empty())
    return fail(ErrorCode::InvalidArgument, "'" + dir + "' holds no markdown (*.md) files to index");
  std::sort(files.begin(), files.end());
  std::vector<std::pair<std::string, std::string>> docs;
  for (const auto& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return fail(ErrorCode::IoError, "cannot read '" + path.string() + "'");
    std::ostringstream text;
    text << in.rdbuf();
    docs.emplace_back(path.stem().string(), text.str());
  }
  return from_documents(std::move(docs), params);
}

void Retriever::index() {
  std::map<std::string, std::map<std::size_t, int>> counts;
  lengths_.assign(snippets_.size(), 0.0);
  for (std::size_t i = 0; i < snippets_.size(); ++i) {
    auto body = tokenize(snippets_[i].text);
    auto title = tokenize(snippets_[i].title);
    for (const auto& t : body) counts[t][i] += 1;
    for (const auto& t : title) counts[t][i] += 1;  // the heading is in the body too: titles count twice
    lengths_[i] = double(body.size() + title.size());
  }
  double total = 0;
  for (double l : lengths_) total += l;
  mean_length_ = snippets_.empty() ? 0.0 : total / double(snippets_.size());
  terms_.clear();
  postings_.clear();
  for (auto& [term, docs] : counts) {
    terms_.push_back(term);
    postings_.emplace_back(docs.begin(), docs.end());
  }
}

std::vector<Snippet> Retriever::search(std::string_view query, std::size_t k) const {
  std::vector<double> score(snippets_.size(), 0.0);
  std::vector<bool> hit(snippets_.size(), false);
  const double n = double(snippets_.size());
  auto words = tokenize(query);
  std::sort(words.begin(), words.end());
  words.erase(std::unique(words.begin(), words.end()), words.end());
  for (const auto& w : words) {
    auto it = std::lower_bound(terms_.begin(), terms_.end(), w);
    if (it == terms_.end() || *it != w) continue;
    const auto& docs = postings_[std::size_t(it - terms_.begin())];
    const double df = double(docs.size());
    const double idf = std::log(1.0 + (n - df + 0.5) / (df + 0.5));
    for (auto [doc, tf] : docs) {
      const double norm = params_.k1 * (1.0 - params_.b + params_.b * lengths_[doc] / std::max(mean_length_, 1.0));
      score[doc] += idf * (double(tf) * (params_.k1 + 1.0)) / (double(tf) + norm);
      hit[doc] = true;
    }
  }
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < snippets_.size(); ++i)
    if (hit[i]) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return score[a] != score[b] ? score[a] > score[b] : snippets_[a].id < snippets_[b].id;
  });
  std::vector<Snippet> out;
  for (std::size_t i = 0; i < order.size() && i < k; ++i) {
    Snippet s = snippets_[order[i]];
    s.score = score[order[i]];
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace stitchcuda::agents
