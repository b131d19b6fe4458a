// Retrieval: markdown sections become snippets with stable ids; BM25 ranks the section about the query
// first; titles weigh more than body text; bad folders are clear errors.
#include "catch_shim.hpp"
#include "temp_dir.hpp"

#include <fstream>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::Retriever;
using stitchcuda_test::contains;

namespace {

const char* kCoalescing = R"(# Coalescing

Intro text about memory transactions.

## Vector loads
Use float4 to move 16 bytes per thread; addresses must be 16-byte aligned.

```cuda
// ## not a heading inside a fence
float4 v = reinterpret_cast<const float4*>(x)[i];
```

## Strided access
A stride between neighbouring threads splits a warp's request into many transactions.
)";

const char* kReductions = R"(# Warp reductions

## Shuffles
__shfl_xor_sync exchanges registers inside a warp: a butterfly sum takes five steps.

## Block reductions
Each warp reduces with shuffles, writes its partial to shared memory, then one warp reduces the partials.
)";

}  // namespace

TEST_CASE("sections become snippets with stable ids", "[agents]") {
  auto r = Retriever::from_documents({{"coalescing", kCoalescing}, {"reductions", kReductions}});
  const auto& s = r.snippets();
  REQUIRE(s.size() == 5);
  CHECK(s[0].id == "coalescing#overview");
  CHECK(s[1].id == "coalescing#vector-loads");
  CHECK(s[1].title == "Coalescing — Vector loads");
  CHECK(contains(s[1].text, "## not a heading inside a fence"));  // the fence kept the section whole
  CHECK(s[2].id == "coalescing#strided-access");
  CHECK(s[4].id == "reductions#block-reductions");
}

TEST_CASE("BM25 ranks the section about the query first", "[agents]") {
  auto r = Retriever::from_documents({{"coalescing", kCoalescing}, {"reductions", kReductions}});
  auto hits = r.search("use float4 vector loads", 2);
  REQUIRE_FALSE(hits.empty());
  CHECK(hits[0].id == "coalescing#vector-loads");
  CHECK(hits[0].score > 0.0);
  auto shfl = r.search("__shfl_xor_sync warp sum", 3);
  REQUIRE(shfl.size() >= 2);
  CHECK(shfl[0].id == "reductions#shuffles");
  CHECK(shfl[0].score >= shfl[1].score);
  CHECK(r.search("the of and", 3).empty());        // stop words only
  CHECK(r.search("tensormap wgmma", 3).empty());   // no shared term
  CHECK(r.search("warp", 1).size() == 1);          // k caps the list
}

TEST_CASE("tokens keep identifiers and drop stop words", "[agents]") {
  auto t = Retriever::tokenize("Use __shfl_xor_sync for the FP32 sum, cp.async.bulk");
  CHECK(t == std::vector<std::string>{"use", "__shfl_xor_sync", "fp32", "sum", "cp", "async", "bulk"});
}

TEST_CASE("folders: every markdown file but README; bad folders are clear errors", "[agents]") {
  stitchcuda_test::TempDir dir;
  {
    std::ofstream(dir.path() / "b_reductions.md") << kReductions;
    std::ofstream(dir.path() / "a_coalescing.md") << kCoalescing;
    std::ofstream(dir.path() / "README.md") << "# About\n\n## Not indexed\nnothing\n";
    std::ofstream(dir.path() / "notes.txt") << "## ignored\n";
  }
  auto r = Retriever::from_folder(dir.path().string());
  REQUIRE(r);
  REQUIRE(r->snippets().size() == 5);
  CHECK(r->snippets().front().id == "a_coalescing#overview");
  auto missing = Retriever::from_folder((dir.path() / "nope").string());
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::NotFound);
  stitchcuda_test::TempDir empty;
  auto none = Retriever::from_folder(empty.path().string());
  REQUIRE_FALSE(none);
  CHECK(none.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(none.error().message, "no markdown"));
}
