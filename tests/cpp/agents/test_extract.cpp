// Code extraction: the block defining ModelNew among prose and other blocks, either fence style, bare
// Python, CRLF, cut-off replies, and errors that say what to ask the model.
#include "catch_shim.hpp"

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::extract_code;
using stitchcuda_test::contains;

namespace {

const std::string kModel =
    "import torch\n"
    "from stitchcuda import jit\n"
    "\n"
    "class ModelNew(torch.nn.Module):\n"
    "    def forward(self, x):\n"
    "        return x\n";

}  // namespace

TEST_CASE("the python block defining ModelNew is taken from prose and other blocks", "[agents]") {
  const std::string reply = "Here is the kernel first:\n\n```cuda\n__global__ void k() {}\n```\n\nAnd the module:\n\n```python\n" +
                            kModel + "```\n\nIt fuses bias and GELU.\n";
  auto e = extract_code(reply);
  REQUIRE(e);
  CHECK(e->code == kModel);
  REQUIRE(e->blocks.size() == 2);
  CHECK(e->blocks[0].language == "cuda");
  CHECK(e->blocks[0].line == 3);
  CHECK(e->blocks[0].code == "__global__ void k() {}\n");
  CHECK(e->blocks[1].language == "python");
  CHECK(e->blocks[1].line == 9);
  CHECK(e->blocks[1].closed);
  CHECK_FALSE(e->truncated);
  REQUIRE(e->notes.size() == 1);
  CHECK(contains(e->notes[0], "block 2 of 2"));
  CHECK(contains(e->notes[0], "only block defining class ModelNew"));
}

TEST_CASE("fence styles and info strings", "[agents]") {
  for (const std::string info : {"python", "py", "python3", "Python", "", "PY title=model.py"}) {
    INFO("info string '" << info << "'");
    for (const std::string fence : {"```", "~~~", "````"}) {
      auto e = extract_code("Answer:\n" + fence + info + "\n" + kModel + fence + "\n");
      REQUIRE(e);
      CHECK(e->code == kModel);
    }
  }
  // A tilde fence may hold backtick lines, and an indented fence (inside a list) is un-indented.
  auto tilde = extract_code("~~~python\nclass ModelNew:\n    s = '''\n```\n'''\n~~~\n");
  REQUIRE(tilde);
  CHECK(tilde->code == "class ModelNew:\n    s = '''\n```\n'''\n");
  auto indented = extract_code("1. The code:\n   ```py\n   class ModelNew:\n       pass\n   ```\n");
  REQUIRE(indented);
  CHECK(indented->code == "class ModelNew:\n    pass\n");
  CHECK(indented->blocks[0].language == "py");
}

TEST_CASE("CUDA and C++ blocks are never the candidate", "[agents]") {
  for (const std::string lang : {"cuda", "cpp", "c++"}) {
    INFO(lang);
    auto e = extract_code("```" + lang + "\n// class ModelNew lives in Python\nclass ModelNew {};\n```\n");
    REQUIRE_FALSE(e);
    CHECK(e.error().code == ErrorCode::LlmError);
    CHECK(contains(e.error().message, "no code block defines class ModelNew"));
    CHECK(contains(e.error().message, "blocks seen: " + lang));
  }
}

TEST_CASE("of several blocks defining ModelNew the last is taken, and the notes say so", "[agents]") {
  const std::string first = "class ModelNew(torch.nn.Module):\n    version = 1\n";
  const std::string second = "class ModelNew(torch.nn.Module):\n    version = 2\n";
  auto e = extract_code("First try:\n```python\n" + first + "```\nBetter:\n```python\n" + second +
                        "```\nUsage:\n```python\nm = ModelNew()\n```\n");
  REQUIRE(e);
  CHECK(e->code == second);
  CHECK(e->blocks.size() == 3);
  CHECK(contains(e->notes[0], "block 2 of 3"));
  CHECK(contains(e->notes[0], "last of 2 blocks defining class ModelNew"));
  // `class ModelNew` must start a line: a mention in a comment or a string does not count.
  auto mention = extract_code("```python\nx = 'class ModelNew'  # class ModelNew\n```\n");
  REQUIRE_FALSE(mention);
  CHECK(contains(mention.error().message, "blocks seen: python"));
}

TEST_CASE("a bare Python reply is the candidate; CRLF is normalised", "[agents]") {
  auto bare = extract_code(kModel);
  REQUIRE(bare);
  CHECK(bare->code == kModel);
  CHECK(bare->blocks.empty());
  CHECK(contains(bare->notes[0], "no fenced block"));

  auto with_prose = extract_code("Sure, here it is:\n" + kModel);
  REQUIRE(with_prose);
  CHECK(with_prose->code == kModel);
  CHECK(contains(with_prose->notes.back(), "dropped 1 line"));

  std::string crlf;
  for (char c : "Text\n```python\n" + kModel + "```\n") crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  auto windows = extract_code(crlf);
  REQUIRE(windows);
  CHECK(windows->code == kModel);
  CHECK_FALSE(contains(windows->code, "\r"));
}

TEST_CASE("cut-off replies: an error when the candidate is cut, a note otherwise", "[agents]") {
  auto cut = extract_code("Here:\n```python\n" + kModel + "    def more(self):\n", "length");
  REQUIRE_FALSE(cut);
  CHECK(cut.error().code == ErrorCode::LlmError);
  CHECK(contains(cut.error().message, "cut off"));
  CHECK(contains(cut.error().message, "shorter answer"));
  CHECK(contains(cut.error().message, "max_tokens"));

  // An unclosed fence is a cut even without the finish reason.
  auto unclosed = extract_code("```python\n" + kModel);
  REQUIRE_FALSE(unclosed);
  CHECK(contains(unclosed.error().message, "cut off inside the code block defining ModelNew"));

  // Stopped at max_tokens after the code closed: usable, marked truncated, explained.
  auto late = extract_code("```python\n" + kModel + "```\nThe kernel uses float4 loads and", "length");
  REQUIRE(late);
  CHECK(late->truncated);
  CHECK(late->code == kModel);
  CHECK(contains(late->notes.back(), "code is complete"));

  // Cut in a later block: the candidate stands, the note names the cut block.
  auto after = extract_code("```python\n" + kModel + "```\nTest:\n```python\nm = ModelNew(", "length");
  REQUIRE(after);
  CHECK(after->truncated);
  CHECK_FALSE(after->blocks.back().closed);
  CHECK(contains(after->notes.back(), "block 2 of 2"));

  // A bare-Python reply cut at max_tokens has nothing to show it is complete.
  auto bare = extract_code(kModel, "length");
  REQUIRE_FALSE(bare);
  CHECK(contains(bare.error().message, "cut off"));

  auto clean = extract_code("```python\n" + kModel + "```\n", "stop");
  REQUIRE(clean);
  CHECK_FALSE(clean->truncated);
}

TEST_CASE("empty replies and replies without ModelNew are errors that say what to ask", "[agents]") {
  for (const std::string reply : {"", "  \n\r\n\t"}) {
    auto e = extract_code(reply);
    REQUIRE_FALSE(e);
    CHECK(e.error().code == ErrorCode::LlmError);
    CHECK(contains(e.error().message, "empty reply"));
  }
  auto none = extract_code("I would fuse the ops.\n```\nx = 1\n```\n```cuda\n__global__ void k() {}\n```\n~~~text\nnotes\n~~~\n");
  REQUIRE_FALSE(none);
  CHECK(none.error().code == ErrorCode::LlmError);
  CHECK(contains(none.error().message, "no code block defines class ModelNew"));
  CHECK(contains(none.error().message, "blocks seen: unlabeled, cuda, text"));
  auto prose = extract_code("I cannot do that.");
  REQUIRE_FALSE(prose);
  CHECK(contains(prose.error().message, "no code block defines class ModelNew"));
  CHECK(contains(prose.error().message, "no fenced code block"));
}
