// The Coder: Skill 1 from coder_plan.md, Skill 2 from coder_feedback.md, the answer contract of the
// problem (a ModelNew or a kernel step), extraction, re-asks, and requests missing their inputs.
#include "agents_fixtures.hpp"

using namespace agents_test;

// ---- Coder -----------------------------------------------------------------------------------------

TEST_CASE("Coder Skill 1 renders coder_plan with the plan and extracts ModelNew", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
  const Problem problem = make_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.skill = rubric::Skill::from_plan;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "Implement the plan below"));  // the shipped coder_plan.md
  CHECK(contains(sent, the_plan_text()));
  CHECK(contains(sent, trimmed(kReference)));
  CHECK(contains(sent, "GPU: NVIDIA H200 (sm_90), 132 SMs"));
  CHECK_FALSE(contains(sent, "Your previous candidate"));
  CHECK(contains(result->extraction.code, "class ModelNew(torch.nn.Module):"));
  CHECK(contains(result->extraction.code, "# marker: FAST"));
  CHECK_FALSE(contains(result->extraction.code, "```"));
  CHECK_FALSE(contains(result->extraction.code, "The kernel is fused."));
  REQUIRE(result->exchanges.size() == 1);
  CHECK(result->exchanges[0].agent == "coder");
  CHECK(result->exchanges[0].prompt_name == "coder_plan");
  CHECK(result->exchanges[0].prompt_sha256 == sha_of("coder_plan"));
}

TEST_CASE("Coder re-asks after a reply without a usable candidate", "[agents]") {
  const std::string bad = GENERATE(std::string("```python\nimport torch\nprint('no model here')\n```\n"),
                                   std::string("```python\nimport torch\nclass ModelNew(torch.nn.Module):\n    def f"));
  auto why = stitchcuda::agents::extract_code(bad);
  REQUIRE_FALSE(why);
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{bad, candidate_reply("SLOW")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 2);
  REQUIRE(result->exchanges.size() == 2);
  CHECK(contains(result->extraction.code, "# marker: SLOW"));
  CHECK(contains(result->extraction.code, "class ModelNew"));
  CHECK(contains(backend->last_user(1), why.error().message));  // says what was wrong
  CHECK(backend->call(1).front().content == backend->last_user(0));
  const auto& second = backend->call(1);
  CHECK(std::any_of(second.begin(), second.end(),
                    [&](const llm::Message& m) { return m.role == "assistant" && m.content == bad; }));

  SECTION("and gives up, keeping every call, when every reply is unusable") {
    auto hopeless = std::make_shared<Recorder>(std::vector<std::string>{bad});
    Coder stubborn(hopeless, shipped_prompts(), nullptr, AgentOptions{{}, 0, 1});
    auto failed = stubborn.write(request);
    REQUIRE(failed);
    CHECK(failed->extraction.code.empty());
    CHECK(contains(failed->problem, "no usable candidate in 2 replies"));
    CHECK(failed->exchanges.size() == 2);
    CHECK(hopeless->calls() == 2);
  }
}

TEST_CASE("Coder Skill 2 renders coder_feedback with the previous candidate and the feedback", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.skill = rubric::Skill::from_feedback;
  request.problem = &problem;
  request.plan = &plan;
  request.previous = "import torch\nclass ModelNew(torch.nn.Module):\n    pass  # previous-version-7\n";
  request.feedback = "The candidate runs but its outputs are wrong.\n- output 0 [4] float32: expected 1, got 0\n";
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "Revise your previous candidate"));  // the shipped coder_feedback.md
  CHECK(contains(sent, "## Your previous candidate"));
  CHECK(contains(sent, trimmed(request.previous)));
  CHECK(contains(sent, trimmed(request.feedback)));
  CHECK(contains(sent, the_plan_text()));  // shown when given
  CHECK(contains(sent, trimmed(kReference)));
  REQUIRE(result->exchanges.size() == 1);
  CHECK(result->exchanges[0].prompt_name == "coder_feedback");
  CHECK(result->exchanges[0].prompt_sha256 == sha_of("coder_feedback"));
  CHECK(contains(result->extraction.code, "# marker: FAST"));
}

TEST_CASE("Coder refuses a request missing its inputs without calling the model", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts());
  const Problem problem = make_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest no_problem;
  no_problem.plan = &plan;
  auto a = coder.write(no_problem);
  REQUIRE_FALSE(a);
  CHECK(a.error().code == ErrorCode::InvalidArgument);

  CoderRequest no_plan;
  no_plan.problem = &problem;
  auto b = coder.write(no_plan);
  REQUIRE_FALSE(b);
  CHECK(b.error().code == ErrorCode::InvalidArgument);

  CoderRequest no_previous;
  no_previous.skill = rubric::Skill::from_feedback;
  no_previous.problem = &problem;
  no_previous.feedback = "fix it";
  auto c = coder.write(no_previous);
  REQUIRE_FALSE(c);
  CHECK(c.error().code == ErrorCode::InvalidArgument);
  CHECK(backend->calls() == 0);
}

// ---- the answer contract: a property of the problem ----------------------------------------------

namespace {

const char* kTarget = "inputs: in0 [4] float32\noutputs: out0 [4] float32";

const char* kStepCuda =
    "extern \"C\" __global__ void add_gelu(const float* x, float* y, int n) {\n"
    "  int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (i < n) y[i] = x[i] + 1.0f;\n"
    "}\n";

std::string step_reply() {
  return std::string("One thread per element.\n\n```cuda\n") + kStepCuda +
         "```\n\n```json\n{\"kernel\": \"add_gelu\", \"grid\": [\"ceil_div(out0.numel, 256)\"], \"block\": [256], "
         "\"args\": [\"in0\", \"out0\", \"out0.numel\"]}\n```\n";
}

Problem kernel_step_problem() {
  Problem p = make_problem();
  p.answer = "kernel_step";
  p.target = kTarget;
  return p;
}

}  // namespace

TEST_CASE("Coder shows the ModelNew contract for a program-mode problem", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
  const Problem problem = make_problem();
  REQUIRE(problem.answer == "model_new");  // the default
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;
  REQUIRE(coder.write(request));
  const std::string sent = backend->last_user(0);
  auto contract = shipped_prompts()->render("answer_model_new", {});
  REQUIRE(contract);
  CHECK(contains(sent, trimmed(*contract)));  // answer_model_new.md, whole, in coder_plan's {{answer}}
  CHECK(contains(sent, "## The contract your answer must meet"));
  CHECK(contains(sent, "defines `class ModelNew(torch.nn.Module)`"));
  CHECK_FALSE(contains(sent, "kernel step"));
  CHECK_FALSE(contains(sent, "{{"));
}

TEST_CASE("Coder asks a graph-mode target for a kernel step and extracts it", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{step_reply()});
  Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
  const Problem problem = kernel_step_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE(result);
  REQUIRE(backend->calls() == 1);
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, "Implement the plan below"));
  CHECK(contains(sent, "*kernel step*"));  // answer_kernel_step.md
  CHECK(contains(sent, kTarget));          // the target, as the contract names its buffers
  CHECK_FALSE(contains(sent, "defines `class ModelNew(torch.nn.Module)`"));
  CHECK_FALSE(contains(sent, "{{"));
  auto step = stitchcuda::agents::KernelStep::parse(result->extraction.code);
  REQUIRE(step);
  CHECK(step->kernel == "add_gelu");
  CHECK(step->source == kStepCuda);
  CHECK(step->args == std::vector<std::string>{"in0", "out0", "out0.numel"});
  CHECK(result->problem.empty());
}

TEST_CASE("Coder takes a ModelNew offered for a kernel step, with a note; neither is re-asked", "[agents]") {
  const Problem problem = kernel_step_problem();
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;

  SECTION("a ModelNew instead of a kernel step is the candidate: judged, never part of the program") {
    auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
    Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
    auto result = coder.write(request);
    REQUIRE(result);
    CHECK(backend->calls() == 1);  // no re-ask
    CHECK(contains(result->extraction.code, "class ModelNew"));
    CHECK_FALSE(stitchcuda::agents::KernelStep::parse(result->extraction.code));
    const auto& notes = result->extraction.notes;
    CHECK(std::find(notes.begin(), notes.end(), "a ModelNew, not a kernel step: judged, never part of the program") !=
          notes.end());
  }
  SECTION("neither: the kernel step's fault is what the model is asked to fix") {
    auto backend = std::make_shared<Recorder>(std::vector<std::string>{"I would fuse them.", step_reply()});
    Coder coder(backend, shipped_prompts(), nullptr, AgentOptions{{}, 0, 2});
    auto result = coder.write(request);
    REQUIRE(result);
    REQUIRE(backend->calls() == 2);
    auto why = stitchcuda::agents::extract_kernel_step("I would fuse them.");
    REQUIRE_FALSE(why);
    CHECK(contains(backend->last_user(1), why.error().message));
    CHECK(contains(backend->last_user(1), "```json block"));
    CHECK_FALSE(contains(backend->last_user(1), "defines class ModelNew"));
    CHECK(stitchcuda::agents::KernelStep::parse(result->extraction.code));
  }
}

TEST_CASE("Coder Skill 2 shows a previous kernel step as CUDA and launch blocks", "[agents]") {
  auto first = stitchcuda::agents::extract_kernel_step(step_reply());
  REQUIRE(first);
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{step_reply()});
  Coder coder(backend, shipped_prompts());
  const Problem problem = kernel_step_problem();
  CoderRequest request;
  request.skill = rubric::Skill::from_feedback;
  request.problem = &problem;
  request.previous = first->code;
  request.feedback = "The candidate runs but its outputs are wrong.\n";
  REQUIRE(coder.write(request));
  const std::string sent = backend->last_user(0);
  CHECK(contains(sent, std::string("## Your previous candidate\n\n```cuda\n") + kStepCuda + "```"));
  CHECK(contains(sent, "```json\n{\"kernel\":\"add_gelu\",\"grid\":[\"ceil_div(out0.numel, 256)\"]"));
  CHECK_FALSE(contains(sent, "\"kernel_step\""));  // not the escaped canonical text
}

TEST_CASE("Coder refuses a problem whose answer it does not know", "[agents]") {
  auto backend = std::make_shared<Recorder>(std::vector<std::string>{candidate_reply("FAST")});
  Coder coder(backend, shipped_prompts());
  Problem problem = make_problem();
  problem.answer = "triton";
  const ProblemPlan plan = parsed(kPlanJson);
  CoderRequest request;
  request.problem = &problem;
  request.plan = &plan;
  auto result = coder.write(request);
  REQUIRE_FALSE(result);
  CHECK(result.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(result.error().message, "triton"));
  CHECK(backend->calls() == 0);
}
