// Problem plans (the Planner's ProblemPlan): parsing from replies with prose and fences, every schema violation in one message, the JSON
// round trip, the schema itself, and the text the Coder and Planner read.
#include "catch_shim.hpp"

#include <nlohmann/json.hpp>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::Hardware;
using stitchcuda::agents::ProblemPlan;
using stitchcuda::agents::problem_plan_schema;
using stitchcuda_test::contains;

namespace {

const char* kPlan = R"({
  "summary": "Fuse the GEMM epilogue {bias, GELU} and the residual add.",
  "steps": [
    {"title": "GEMM with cuBLASLt", "detail": "Row-major, fp32 accumulate."},
    {"title": "Fused epilogue kernel"}
  ],
  "fusion_groups": [
    {"ops": ["linear", "gelu", "add"], "kernel": "k_bias_gelu_add", "rationale": "saves two round trips"}
  ],
  "bottlenecks": ["GEMM compute"],
  "risks": ["erf precision"],
  "constraints": ["fp32 only"],
  "notes": "extra keys are ignored"
})";

}  // namespace

TEST_CASE("a plan parses from a reply with prose and a json fence", "[agents]") {
  auto plan = ProblemPlan::parse(std::string("Here is my plan {as asked}:\n```json\n") + kPlan + "\n```\nDone.");
  REQUIRE(plan);
  CHECK(plan->summary == "Fuse the GEMM epilogue {bias, GELU} and the residual add.");
  REQUIRE(plan->steps.size() == 2);
  CHECK(plan->steps[0].title == "GEMM with cuBLASLt");
  CHECK(plan->steps[0].detail == "Row-major, fp32 accumulate.");
  CHECK(plan->steps[1].detail.empty());
  REQUIRE(plan->fusion_groups.size() == 1);
  CHECK(plan->fusion_groups[0].ops == std::vector<std::string>{"linear", "gelu", "add"});
  CHECK(plan->fusion_groups[0].kernel == "k_bias_gelu_add");
  CHECK(plan->bottlenecks == std::vector<std::string>{"GEMM compute"});
  CHECK(plan->risks == std::vector<std::string>{"erf precision"});
  CHECK(plan->constraints == std::vector<std::string>{"fp32 only"});
}

TEST_CASE("optional arrays may be absent; braces in strings do not end the object", "[agents]") {
  auto plan = ProblemPlan::parse(R"({"summary": "s } {", "steps": [{"title": "t \"}\""}]} trailing {"x": 1})");
  REQUIRE(plan);
  CHECK(plan->summary == "s } {");
  CHECK(plan->steps[0].title == "t \"}\"");
  CHECK(plan->fusion_groups.empty());
  CHECK(plan->bottlenecks.empty());
  CHECK(plan->risks.empty());
  CHECK(plan->constraints.empty());
}

TEST_CASE("every schema violation is reported in one message", "[agents]") {
  auto plan = ProblemPlan::parse(R"({
    "summary": "  ",
    "steps": [{"title": "ok"}, {"detail": "no title"}, "just text", {"title": 3, "detail": 4}],
    "fusion_groups": [{"ops": []}, {"kernel": "k"}, {"ops": ["a", 1]}],
    "risks": "one risk",
    "constraints": ["fine", 2]
  })");
  REQUIRE_FALSE(plan);
  CHECK(plan.error().code == ErrorCode::InvalidArgument);
  const std::string& m = plan.error().message;
  CHECK(contains(m, "plan is invalid: summary: must not be empty"));
  CHECK(contains(m, "steps[1].title: missing"));
  CHECK(contains(m, "steps[2]: expected an object"));
  CHECK(contains(m, "steps[3].title: expected a string"));
  CHECK(contains(m, "steps[3].detail: expected a string"));
  CHECK(contains(m, "fusion_groups[0].ops: expected a non-empty array of strings"));
  CHECK(contains(m, "fusion_groups[1].ops: missing"));
  CHECK(contains(m, "fusion_groups[2].ops: expected a non-empty array of strings"));
  CHECK(contains(m, "risks: expected an array of strings"));
  CHECK(contains(m, "constraints: expected an array of strings"));
  CHECK_FALSE(contains(m, "steps[0]"));

  auto empty = ProblemPlan::parse(R"({"steps": []})");
  REQUIRE_FALSE(empty);
  CHECK(contains(empty.error().message, "summary: missing; steps: expected a non-empty array"));
  auto no_steps = ProblemPlan::parse(R"({"summary": "s", "fusion_groups": {}})");
  REQUIRE_FALSE(no_steps);
  CHECK(contains(no_steps.error().message, "steps: missing"));
  CHECK(contains(no_steps.error().message, "fusion_groups: expected an array"));
}

TEST_CASE("text that is not a plan gives an error with a position", "[agents]") {
  auto none = ProblemPlan::parse("I think we should fuse everything.");
  REQUIRE_FALSE(none);
  CHECK(none.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(none.error().message, "no JSON object"));

  auto broken = ProblemPlan::parse("Plan:\n{\n  \"summary\": \"s\",\n  \"steps\": [{\"title\": \"a\",}]\n}");
  REQUIRE_FALSE(broken);
  CHECK(broken.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(broken.error().message, "does not parse"));
  CHECK(contains(broken.error().message, "line 4"));  // in the reply, where the stray comma is
  // The nested step object of a broken plan is never taken for the plan.
  CHECK_FALSE(contains(broken.error().message, "summary: missing"));

  auto cut = ProblemPlan::parse("{\"summary\": \"s\", \"steps\": [{\"title\": \"a\"");
  REQUIRE_FALSE(cut);
  CHECK(contains(cut.error().message, "never closed"));

  // A balanced region of prose before the plan is skipped.
  auto after_prose = ProblemPlan::parse("Use {fusion} here.\n{\"summary\": \"s\", \"steps\": [{\"title\": \"a\"}]}");
  REQUIRE(after_prose);
  CHECK(after_prose->summary == "s");
}

TEST_CASE("to_json round-trips and describe numbers the steps", "[agents]") {
  auto plan = ProblemPlan::parse(kPlan);
  REQUIRE(plan);
  auto again = ProblemPlan::parse(plan->to_json());
  REQUIRE(again);
  CHECK(again->to_json() == plan->to_json());
  CHECK(again->summary == plan->summary);
  CHECK(again->fusion_groups[0].rationale == "saves two round trips");
  const auto text = plan->describe();
  CHECK(contains(text, "Summary: Fuse the GEMM epilogue"));
  CHECK(contains(text, "1. GEMM with cuBLASLt\n   Row-major, fp32 accumulate.\n2. Fused epilogue kernel\n"));
  CHECK(contains(text, "- linear + gelu + add -> k_bias_gelu_add (saves two round trips)"));
  CHECK(contains(text, "Risks:\n- erf precision"));
  ProblemPlan minimal;
  minimal.summary = "s";
  minimal.steps = {{"only step", ""}};
  CHECK_FALSE(contains(minimal.describe(), "Risks"));
  CHECK_FALSE(contains(minimal.describe(), "Fusion groups"));
}

TEST_CASE("the plan schema is draft-07 JSON Schema matching what parse requires", "[agents]") {
  const auto schema = nlohmann::json::parse(problem_plan_schema());
  CHECK(schema["$schema"] == "http://json-schema.org/draft-07/schema#");
  CHECK(schema["type"] == "object");
  CHECK(schema["required"] == nlohmann::json::array({"summary", "steps"}));
  const auto& props = schema["properties"];
  CHECK(props["steps"]["minItems"] == 1);
  CHECK(props["steps"]["items"]["required"] == nlohmann::json::array({"title"}));
  CHECK(props["fusion_groups"]["items"]["properties"]["ops"]["minItems"] == 1);
  for (const char* key : {"bottlenecks", "risks", "constraints"}) {
    CHECK(props[key]["type"] == "array");
    CHECK(props[key]["items"]["type"] == "string");
  }
  CHECK_FALSE(schema.contains("additionalProperties"));  // extra keys are allowed
}

TEST_CASE("hardware is described in a few lines, unknowns left out", "[agents]") {
  Hardware h;
  h.gpu = "NVIDIA H200";
  h.arch = "sm_90";
  h.sms = 132;
  h.memory_gib = 139.8;
  h.dram_tb_s = 4.8;
  h.fp32_tflops = 67;
  h.tf32_tflops = 494.7;
  h.cuda = "13.0";
  const auto text = h.describe();
  CHECK(contains(text, "GPU: NVIDIA H200 (sm_90), 132 SMs, 139.8 GiB memory\n"));
  CHECK(contains(text, "DRAM 4.8 TB/s, FP32 67 TFLOP/s, TF32 tensor cores 494.7 TFLOP/s"));
  CHECK(contains(text, "below 13.96 FLOP/byte are memory-bound"));
  CHECK(contains(text, "CUDA 13.0"));
  const auto unknown = Hardware{}.describe();
  CHECK(unknown == "GPU: unknown GPU\n");
}
