// The prefill + decode pair (DecodePrograms): its file round trip (both programs, the weights stored once,
// the states paired by name), the pair's checks, and a damaged or mistaken file refused by name.
#include <fstream>
#include <string>

#include <stitchcuda/decode.hpp>
#include <stitchcuda/detail/container.hpp>
#include <stitchcuda/family.hpp>

#include "catch_shim.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using namespace stitchcuda::program;
using stitchcuda_test::contains;

namespace {

constexpr std::int64_t kBatch = 2, kMaxLength = 8, kVocab = 16, kDim = 4;

std::string bytes_of(std::size_t n, unsigned seed) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = char((i * 31 + seed) & 0xff);
  return s;
}

// A static-cache LM step for `tokens` tokens: the embeddings written into the cache at the positions, the
// logits read from them. Both programs of a pair are built by it, as optimize() builds both from one model.
Program lm_program(std::int64_t tokens, std::string cache_name = "layer0.k_cache", std::int64_t vocab = kVocab) {
  ProgramBuilder b;
  BufferId ids = b.input(TensorSpec::contiguous({kBatch, tokens}, DType::i64), "input_ids");
  BufferId positions = b.input(TensorSpec::contiguous({tokens}, DType::i64), "cache_position");
  BufferId embed = b.weight(TensorSpec::contiguous({vocab, kDim}), bytes_of(std::size_t(vocab * kDim * 4), 1), "embed");
  BufferId head = b.weight(TensorSpec::contiguous({kDim, vocab}), bytes_of(std::size_t(vocab * kDim * 4), 2), "head");
  BufferId cache = b.state(TensorSpec::contiguous({kBatch, kMaxLength, kDim}), std::move(cache_name));
  BufferId x = b.intermediate(TensorSpec::contiguous({kBatch, tokens, kDim}), "x");
  BufferId logits = b.output(TensorSpec::contiguous({kBatch, tokens, vocab}), "logits");
  b.aten("aten::embedding", {embed, ids}, {x});
  b.aten("aten::index_copy_", {cache, positions, x}, {cache}, {{"dim", std::int64_t(1)}});
  b.aten("aten::matmul", {x, head}, {logits});
  auto p = b.build();
  if (!p) FAIL(p.error().describe() << "\n" << p.error().log);
  return *p;
}

DecodePrograms pair(std::int64_t prompt = 5) { return {lm_program(prompt), lm_program(1), kMaxLength}; }

std::string refusal(const DecodePrograms& d) {
  auto ok = d.validate();
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().code == ErrorCode::InvalidArgument);
  return ok.error().message;
}

}  // namespace

TEST_CASE("a prefill + decode pair round-trips through one file with its weights stored once", "[program][decode]") {
  const DecodePrograms d = pair();
  REQUIRE(d.validate().has_value());
  CHECK(d.batch() == kBatch);
  CHECK(d.prompt_length() == 5);
  CHECK(d.vocab() == kVocab);
  const auto pairs = d.state_pairs();
  REQUIRE(pairs.size() == 1);
  CHECK(d.prefill.buffer(pairs[0].first)->name == "layer0.k_cache");
  CHECK(d.decode.buffer(pairs[0].second)->name == "layer0.k_cache");

  const std::string bytes = d.serialize();
  CHECK(is_decode_artifact(bytes));
  CHECK_FALSE(is_family_artifact(bytes));
  // The two programs' equal weights once: the file is smaller than the two programs saved apart by
  // about one copy of the weights.
  const std::size_t weights = 2 * std::size_t(kVocab * kDim * 4);
  CHECK(bytes.size() + weights <= d.prefill.serialize().size() + d.decode.serialize().size() + 1024);
  auto back = DecodePrograms::deserialize(bytes);
  REQUIRE(back.has_value());
  CHECK(back->max_length == kMaxLength);
  CHECK(back->prefill.serialize() == d.prefill.serialize());  // buffers, steps, weights, provenance
  CHECK(back->decode.serialize() == d.decode.serialize());
  CHECK(back->state_pairs() == pairs);

  stitchcuda_test::TempDir dir;
  const std::string path = (dir.path() / "lm.decode.stitch").string();
  REQUIRE(d.save(path).has_value());
  auto loaded = DecodePrograms::load(path);
  REQUIRE(loaded.has_value());
  CHECK(loaded->decode.serialize() == d.decode.serialize());
  auto single = Program::load(path);  // the single-program loader names the pair's loaders
  REQUIRE_FALSE(single.has_value());
  CHECK(contains(single.error().message, "is a prefill + decode pair"));
  CHECK(contains(single.error().message, "Generator::load"));
  CHECK(DecodePrograms::load((dir.path() / "none").string()).error().code == ErrorCode::NotFound);
}

TEST_CASE("the pair's checks name the program, the buffer and the fix", "[program][decode]") {
  SECTION("states are paired by name") {
    DecodePrograms d{lm_program(5), lm_program(1, "layer0.v_cache"), kMaxLength};
    CHECK(contains(refusal(d), "prefill has a state 'layer0.k_cache' and decode has none of that name"));
  }
  SECTION("a state without a name cannot be paired") {
    DecodePrograms d{lm_program(5, ""), lm_program(1, ""), kMaxLength};
    CHECK(contains(refusal(d), "prefill's state 4 has no name"));
  }
  SECTION("a paired state has one layout") {
    DecodePrograms d = pair();
    for (Buffer& b : d.decode.buffers)
      if (b.role == BufferRole::state) b.spec.dtype = DType::f16;
    CHECK(contains(refusal(d), "prefill's state 'layer0.k_cache' is f32[2, 8, 4] but decode's is f16[2, 8, 4]"));
  }
  SECTION("the decode takes one token") {
    DecodePrograms d{lm_program(5), lm_program(2), kMaxLength};
    CHECK(contains(refusal(d), "decode takes 2 tokens per sequence, not 1"));
  }
  SECTION("the prompt leaves room for a new token") {
    CHECK(contains(refusal(pair(8)), "prefill takes prompts of 8 tokens but the cache holds 8 positions"));
    DecodePrograms d = pair();
    d.max_length = 1;
    CHECK(contains(refusal(d), "max_length = 1 is outside 2.."));
  }
  SECTION("one vocabulary") {
    DecodePrograms d{lm_program(5), lm_program(1, "layer0.k_cache", 32), kMaxLength};
    CHECK(contains(refusal(d), "decode's logits have a vocabulary of 32, prefill's of 16"));
  }
  SECTION("the logits are the last positions': all of them or the last alone") {
    DecodePrograms d = pair();
    Buffer& logits = d.prefill.buffers[6];
    REQUIRE(logits.role == BufferRole::output);
    logits.spec = TensorSpec::contiguous({kBatch, 1, kVocab});  // a model asked for the last position's logits
    CHECK(d.validate().has_value());
    logits.spec = TensorSpec::contiguous({kBatch, 6, kVocab});
    CHECK(contains(refusal(d), "prefill's output 'logits' is f32[2, 6, 16], not the logits (floating point [2, 1..5, vocab]"));
  }
  SECTION("the inputs are token ids and positions") {
    DecodePrograms d = pair();
    d.prefill.buffers[0].spec.dtype = DType::f32;
    CHECK(contains(refusal(d), "prefill's input 'input_ids' is f32[2, 5], not the token ids"));
  }
  SECTION("programs without a cache do not make a token loop") {
    auto without_cache = [](std::int64_t tokens) {
      ProgramBuilder b;
      BufferId ids = b.input(TensorSpec::contiguous({kBatch, tokens}, DType::i64), "input_ids");
      b.input(TensorSpec::contiguous({tokens}, DType::i64), "cache_position");  // unread: a bigram model
      BufferId embed = b.weight(TensorSpec::contiguous({kVocab, kVocab}), {}, "embed");
      BufferId logits = b.output(TensorSpec::contiguous({kBatch, tokens, kVocab}), "logits");
      b.aten("aten::embedding", {embed, ids}, {logits});
      auto p = b.build();
      if (!p) FAIL(p.error().describe());
      return *p;
    };
    DecodePrograms d{without_cache(5), without_cache(1), kMaxLength};
    CHECK(contains(refusal(d), "prefill has no state"));
  }
}

TEST_CASE("a damaged or mistaken prefill + decode file is a clear error", "[program][decode]") {
  const std::string bytes = pair().serialize();
  auto error = [](std::string_view b) {
    auto r = DecodePrograms::deserialize(b);
    REQUIRE_FALSE(r.has_value());
    CHECK(r.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(r.error().message, "not a valid prefill + decode file"));
    return r.error().message;
  };
  CHECK(contains(error(bytes.substr(0, 30)), "fewer than the 52-byte header (truncated?)"));
  CHECK(contains(error(bytes.substr(0, bytes.size() - 1)), "remain (truncated?)"));
  CHECK(contains(error(bytes + "x"), "1 bytes follow the last section"));
  std::string flipped = bytes;
  flipped[flipped.size() - 2] ^= 0x20;  // inside the last weight
  CHECK(contains(error(flipped), "fails its SHA-256 check"));
  CHECK(contains(error(lm_program(1).serialize()), "wrong magic bytes (a single program's .stitch file"));
  // Re-packed with fresh checksums (the container's own writer), so the reader's checks behind them run.
  const program::detail::ContainerKind kind{{'S', 'T', 'I', 'T', 'C', 'H', 'D', '\x01'}, kDecodeArtifactVersion,
                                            "stitchcuda.decode", "decode pair file", "not a valid prefill + decode file", ""};
  auto file = program::detail::read_container(kind, bytes);
  REQUIRE(file.has_value());
  std::vector<std::pair<std::string, std::string_view>> sections(file->sections.begin(), file->sections.end());
  sections.emplace_back("surprise", "?");
  CHECK(contains(error(program::detail::write_container(kind, file->manifest, sections)),
                 "section 'surprise' belongs to neither program"));
  sections.pop_back();
  std::erase_if(sections, [](const auto& s) { return s.first == "weight.0"; });
  CHECK(contains(error(program::detail::write_container(kind, file->manifest, sections)),
                 "manifest.programs.prefill.weights names section 'weight.0', which the file lacks"));
  auto manifest = file->manifest;
  manifest.erase("max_length");
  CHECK(contains(error(program::detail::write_container(kind, manifest, {})), "missing field 'manifest.max_length'"));
  // Programs that do not make a pair are refused on reading too, not only on saving.
  DecodePrograms mismatched{lm_program(5), lm_program(1, "other"), kMaxLength};
  CHECK(contains(error(mismatched.serialize()), "the stored pair does not validate: prefill has a state"));
}
