// Kernel steps (a graph-mode target's answer): a CUDA block and a JSON launch block found among prose,
// every malformed field named, the canonical text round-tripping, and the errors a model is re-asked with.
#include "catch_shim.hpp"

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::extract_kernel_step;
using stitchcuda::agents::KernelStep;
using stitchcuda_test::contains;

namespace {

const std::string kCuda =
    "extern \"C\" __global__ void __launch_bounds__(1024) scan_rows(const float* x, float* y, int cols) {\n"
    "  y[blockIdx.x * cols + threadIdx.x] = x[blockIdx.x * cols + threadIdx.x];\n"
    "}\n";

std::string reply_with(const std::string& launch) {
  return "One block per row.\n\n```cuda\n" + kCuda + "```\n\nLaunch:\n\n```json\n" + launch + "\n```\n";
}

}  // namespace

TEST_CASE("a kernel step is the CUDA block and the JSON launch block", "[agents]") {
  auto e = extract_kernel_step(reply_with(
      R"J({"kernel": "scan_rows", "grid": ["in0.shape[0]"], "block": [1024, 1], "args": ["in0", "out0", "in0.shape[1]"]})J"));
  REQUIRE(e);
  auto step = KernelStep::parse(e->code);
  REQUIRE(step);
  CHECK(step->kernel == "scan_rows");
  CHECK(step->source == kCuda);
  CHECK(step->grid == std::vector<std::string>{"in0.shape[0]"});
  CHECK(step->block == std::vector<std::string>{"1024", "1"});
  CHECK(step->shared_bytes == "0");
  CHECK(step->args == std::vector<std::string>{"in0", "out0", "in0.shape[1]"});
  CHECK(KernelStep::parse(step->to_json())->to_json() == step->to_json());
  CHECK(contains(e->notes.at(0), "kernel from block 1 of 2"));
}

TEST_CASE("a scalar grid and expressions with ceil_div, min and max are accepted", "[agents]") {
  auto e = extract_kernel_step(reply_with(
      R"J({"kernel": "scan_rows", "grid": "min(ceil_div(out0.numel, 256), 132 * 8)", "block": 256,
          "shared_bytes": "4 * (block + 1)", "args": ["in0", "out0", 7]})J"));
  REQUIRE_FALSE(e);  // "block" is not a name an expression may use
  CHECK(contains(e.error().message, "shared_bytes: unknown name 'block'"));
  auto ok = extract_kernel_step(reply_with(
      R"J({"kernel": "scan_rows", "grid": "min(ceil_div(out0.numel, 256), 132 * 8)", "block": 256,
          "shared_bytes": "4 * (256 + 1)", "args": ["in0", "out0", 7]})J"));
  REQUIRE(ok);
  auto step = KernelStep::parse(ok->code);
  CHECK(step->grid == std::vector<std::string>{"min(ceil_div(out0.numel, 256), 132 * 8)"});
  CHECK(step->args.back() == "7");
}

TEST_CASE("every malformed field of a kernel step is named", "[agents]") {
  auto e = extract_kernel_step(reply_with(R"J({"kernel": "scan", "grid": [1, 2, 3, 4], "block": [], "args": ["in0", "x.y"]})J"));
  REQUIRE_FALSE(e);
  CHECK(e.error().code == ErrorCode::LlmError);
  const std::string& m = e.error().message;
  CHECK(contains(m, "grid: 1-3 entries"));
  CHECK(contains(m, "block: 1-3 entries"));
  CHECK(contains(m, "args[1]: unknown name 'x'"));
  CHECK(contains(m, "kernel 'scan' is not a __global__ function of the source (it defines: scan_rows)"));
  CHECK(contains(m, "```json"));  // says what to send instead
}

TEST_CASE("a reply without the CUDA or the launch block says which is missing", "[agents]") {
  auto no_cuda = extract_kernel_step("```json\n{\"kernel\": \"k\"}\n```\n");
  REQUIRE_FALSE(no_cuda);
  CHECK(contains(no_cuda.error().message, "no ```cuda block"));
  auto no_launch = extract_kernel_step("```cuda\n" + kCuda + "```\n");
  REQUIRE_FALSE(no_launch);
  CHECK(contains(no_launch.error().message, "no ```json launch block"));
  auto bad_json = extract_kernel_step(reply_with("{\"kernel\": \"scan_rows\", grid: 1}"));
  REQUIRE_FALSE(bad_json);
  CHECK(contains(bad_json.error().message, "not valid JSON"));
  auto cut = extract_kernel_step("```cuda\n" + kCuda);
  REQUIRE_FALSE(cut);
  CHECK(contains(cut.error().message, "cut off inside the CUDA block"));
  auto empty = extract_kernel_step("  \n");
  REQUIRE_FALSE(empty);
  CHECK(contains(empty.error().message, "empty reply"));
}

TEST_CASE("KernelStep::parse refuses what is not a kernel step", "[agents]") {
  CHECK_FALSE(KernelStep::parse("class ModelNew: pass"));
  CHECK_FALSE(KernelStep::parse(R"J({"kernel": "k"})J"));
  auto no_source = KernelStep::parse(R"J({"kernel_step": 1, "kernel": "k"})J");
  REQUIRE_FALSE(no_source);
  CHECK(contains(no_source.error().message, "source: missing"));
}
