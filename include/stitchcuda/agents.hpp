// stitchcuda::agents — the agents' shared machinery. For now: retrieval over the documentation corpus
// the Planner and Coder read (BM25 over markdown sections). Pure C++, no CUDA or LibTorch header.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>

namespace stitchcuda::agents {

/// One retrievable unit: a `## ` section of a markdown document (or the text before the first one).
struct Snippet {
  std::string id;      ///< "coalescing_and_vector_loads#vector-loads": document name, '#', section slug
  std::string title;   ///< "Coalescing and vector loads — Vector loads"
  std::string text;    ///< the section's markdown, heading included
  double score = 0.0;  ///< BM25 score for the query that returned it (0 in snippets())
};

/// BM25 parameters (the usual defaults).
struct Bm25 {
  double k1 = 1.2;  ///< term-frequency saturation
  double b = 0.75;  ///< length normalization
};

/// Ranks documentation sections for a query with Okapi BM25; titles count twice.
class Retriever {
 public:
  /// Indexes documents given as (name, markdown) pairs; a name becomes the ids' prefix.
  static Retriever from_documents(std::vector<std::pair<std::string, std::string>> documents, Bm25 params = {});
  /// Indexes every `*.md` file of `dir` (README.md excepted), in name order. NotFound when the folder
  /// does not exist, InvalidArgument when it holds no markdown.
  static Result<Retriever> from_folder(const std::string& dir, Bm25 params = {});

  /// The `k` best sections for `query` (those sharing at least one term), best first; ties by id.
  std::vector<Snippet> search(std::string_view query, std::size_t k = 3) const;
  /// Every indexed section, in document order.
  const std::vector<Snippet>& snippets() const { return snippets_; }

  /// Lower-case word tokens: letters, digits and '_' ("__shfl_xor_sync", "fp32", "cp"), minus stop words.
  static std::vector<std::string> tokenize(std::string_view text);

 private:
  Retriever() = default;
  void index();
  std::vector<Snippet> snippets_;
  std::vector<std::vector<std::pair<std::size_t, int>>> postings_;  // term index -> (snippet, tf)
  std::vector<std::string> terms_;                                    // sorted vocabulary
  std::vector<double> lengths_;                                       // tokens per snippet
  double mean_length_ = 0.0;
  Bm25 params_;
};

}  // namespace stitchcuda::agents
