// The Replanner: a new ProblemPlan when progress stalls, from the old plan and one line per attempt.
// It asks like the Planner (same validation and re-asks), with prompts/replanner.md.
#include <stitchcuda/agents.hpp>

namespace stitchcuda::agents {

Result<ProblemPlanResult> Replanner::replan(const Problem& problem, const ProblemPlan& previous,
                                            const std::vector<AttemptSummary>& history) const {
  std::string lines;
  for (const AttemptSummary& a : history) lines += "attempt " + std::to_string(a.index) + ": " + a.outcome + "\n";
  return ask("replanner", "replanner",
             {{"reference", problem.reference},
              {"hardware", problem.hardware.describe()},
              {"previous_plan", previous.describe()},
              {"history", lines},
              {"profile", problem.profile}},
             lines + previous.summary);
}

}  // namespace stitchcuda::agents
