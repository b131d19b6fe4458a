// stitchcuda_server_cpu: the batching server's command line and serving loop (examples/cpp/server/cli.cpp)
// with the tests' CPU runner in place of the GPU ones, so that scripts/server-load's checks run against a
// real server process where no GPU is present (tests/python/test_server_load.py). It serves an artifact
// whose program is one linear step, x f32[B, K] -> y = x @ w^T + bias (cpu_runner.hpp's linear_program, or
// one built alike from Python); `--eager FILE` names another such artifact, computed the same way: the CPU
// stands in for LibTorch eager too.
#include <memory>
#include <string>
#include <variant>

#include "cli.hpp"
#include "server/cpu_runner.hpp"

namespace {

using namespace stitchcuda_server;
namespace program = stitchcuda::program;

// Why CpuLinearRunner cannot compute `p`, or "".
std::string not_linear(const program::Program& p) {
  const auto* mm = p.steps.size() == 1 ? std::get_if<program::Matmul>(&p.steps[0]) : nullptr;
  if (!mm || !mm->bias || mm->transpose_a || !mm->transpose_b || mm->alpha != 1.0 || mm->beta != 0.0 ||
      !p.weights.count(mm->b) || !p.weights.count(*mm->bias))
    return "the CPU stand-in computes one step, a matmul x @ w^T + bias with w and bias weights; this program has " +
           std::to_string(p.steps.size()) + " steps";
  return "";
}

Loaded cpu_program(program::Program p, const ServedModel&, int) {
  if (auto why = not_linear(p); !why.empty()) return {nullptr, why, false};
  return {std::make_unique<stitchcuda_test::CpuLinearRunner>(p), {}, false};
}

Loaded cpu_family(program::ProgramFamily f, const ServedModel& model, int workers) {
  return cpu_program(std::move(f.members.at(0).program), model, workers);  // every member holds the same weights
}

Loaded cpu_eager(const std::string& path, const ServedModel& model, int workers) {
  auto p = program::Program::load(path);
  if (!p) return {nullptr, "--eager " + path + ": " + p.error().describe(), false};
  return cpu_program(std::move(*p), model, workers);
}

}  // namespace

int main(int argc, char** argv) { return serve_main(argc, argv, {cpu_program, cpu_family, cpu_eager}); }
