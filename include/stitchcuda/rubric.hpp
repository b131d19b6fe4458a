// stitchcuda::rubric — scores a verified candidate on the four StitchCUDA rubric items (anti-hacking,
// CUDA engineering, operator coverage, skill compliance) and turns speed-up and score into the reward.
// Deterministic detectors; an optional Judge (an LLM, later) may refine them. Pure data, no CUDA header.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>

namespace stitchcuda::rubric {

// ---- inputs ------------------------------------------------------------------------------------

/// How much a Verifier finding undermines the result (docs/verify.md).
enum class Severity : std::uint8_t {
  minor,  ///< suspicious; costs rubric points
  major,  ///< the result cannot be trusted; the reward is 0
};
/// "minor", "major".
const char* to_string(Severity severity) noexcept;
/// The severity called `name` ("minor"/"major", as the Verifier writes it), or nothing.
std::optional<Severity> severity_from_string(std::string_view name) noexcept;

/// One Verifier rule that fired (static or dynamic).
struct Finding {
  std::string rule;                    ///< stable id, "torch-does-heavy-work"
  Severity severity = Severity::minor; ///< major or minor
  std::string evidence;                ///< the code or measurement that triggered it
};

/// What the Verifier concluded about a candidate.
struct VerifyOutcome {
  bool compiled = false;          ///< the candidate loaded and its kernels compiled
  bool correct = false;           ///< every correctness trial passed
  double speedup = 0.0;           ///< over eager PyTorch (s of the reward); 0 when not timed
  std::vector<Finding> findings;  ///< every finding, static and dynamic
  /// false: the candidate was compiled and checked statically but never run (no GPU), so whether it
  /// is correct is unknown — the reward says "unverified", not "incorrect". (Last, so that aggregate
  /// initializations written before it keep their meaning.)
  bool verified = true;
};

/// The code a candidate consists of. CUDA given inline in Python must be passed in `cuda` as well:
/// Python string literals are not scanned for CUDA.
struct Candidate {
  std::vector<std::string> cuda;  ///< CUDA C++ sources, one entry per compiled source
  std::string python;             ///< Python host source (`ModelNew`)
};

/// Resource use of one compiled kernel (from the JIT's kernel attributes).
struct KernelAttributes {
  std::string name;               ///< entry point
  int registers = 0;              ///< registers per thread
  std::size_t shared_bytes = 0;   ///< static + dynamic shared memory per block
};

/// One operator of the reference and whether the candidate's custom kernels now do its work.
struct OperatorShare {
  std::string op;        ///< "aten::mm", "softmax"…
  double share = 0.0;    ///< share of the reference's GPU time (any non-negative weight works)
  bool covered = false;  ///< a custom kernel of the candidate computes it
};

/// Measured facts, each optional: a detector without its fact scores neutrally or ignores it.
struct Facts {
  std::vector<KernelAttributes> kernels;   ///< the candidate's compiled kernels
  std::optional<int> reference_launches;   ///< kernel launches per reference forward
  std::optional<int> candidate_launches;   ///< kernel launches per candidate forward
  std::vector<OperatorShare> operators;    ///< the reference's operators by GPU time
};

/// The Coder's two atomic skills.
enum class Skill : std::uint8_t {
  from_plan = 1,      ///< Skill 1: write from the Planner's plan
  from_feedback = 2,  ///< Skill 2: revise from the Verifier's feedback
};

/// What the Coder was asked to do, and what it did.
struct Task {
  Skill skill = Skill::from_plan;  ///< which skill produced the candidate
  std::vector<std::string> asks;   ///< plan steps (Skill 1) or the feedback's asks (Skill 2)
  Candidate previous;              ///< Skill 2: the candidate that was revised (empty: unknown)
  /// Skill 2: the Verifier's result on `previous` (unknown: nullopt). A repair ask is judged by comparing
  /// it with the new outcome: the failure it was about is gone, persists, or cannot be told (not run).
  std::optional<VerifyOutcome> previous_outcome;
  std::string summary;             ///< the Coder's own account; shown to a Judge, never trusted by detectors
};

/// Everything the rubric reads about one candidate.
struct Input {
  Candidate candidate;    ///< the code
  VerifyOutcome outcome;  ///< the Verifier's result
  Facts facts;            ///< measured facts (optional parts)
  Task task;              ///< what was asked
};

// ---- source detectors --------------------------------------------------------------------------

/// `cuda` with comments and string/character literals blanked (raw strings included), keeping length
/// and newlines so offsets and lines still match. Strings that are operands of `asm(...)` are kept:
/// inline PTX is code.
std::string strip_cuda(std::string_view cuda);
/// `python` with comments and string literals (triple-quoted and prefixed ones too) blanked, same rules.
std::string strip_python(std::string_view python);

/// A CUDA technique the engineering item looks for.
enum class Technique : std::uint8_t {
  shared_tiling,   ///< `__shared__` plus a block barrier (`__syncthreads`, `bar.sync`, `.sync()`…)
  vectorized,      ///< float4/int4/half2… types, `__ldg`, PTX `ld.global.v4` / `.nc`
  tensor_cores,    ///< `wmma`, `mma_sync`, PTX `mma.sync`, `wgmma.*`, `tcgen05.mma`
  async_copies,    ///< PTX `cp.async*` (TMA: `cp.async.bulk`), `memcpy_async`, `CUtensorMap`
  warp_shuffles,   ///< `__shfl*_sync`, `__reduce_*_sync`, PTX `shfl.sync` / `redux.sync`
  fused_launches,  ///< fewer kernel launches per forward than the reference (a fact, not source)
};
/// "shared-memory tiling", "vectorized access", "tensor cores", "async copies", "warp shuffles",
/// "fused launches".
const char* to_string(Technique technique) noexcept;
/// Number of Technique values.
inline constexpr std::size_t kTechniqueCount = 6;

/// Where a technique was seen: "cuda[0]:12: __shared__ float tile[32][33];".
struct Sighting {
  Technique technique = Technique::shared_tiling;  ///< what
  std::size_t source = 0;  ///< index into Candidate::cuda
  int line = 0;            ///< 1-based line in that source
  std::string excerpt;     ///< the line, trimmed and clipped
  std::string describe() const;
};

/// What the source detectors found in a candidate's CUDA (fused_launches is never set here).
struct Techniques {
  std::vector<Sighting> sightings;  ///< first sighting of each technique found, in Technique order
  int kernels = 0;                  ///< `__global__` definitions and declarations seen
  /// Whether `technique` was seen.
  bool has(Technique technique) const;
};

/// Runs the source detectors over every CUDA source (comments and strings do not count).
Techniques detect_techniques(const std::vector<std::string>& cuda);

// ---- items and scores --------------------------------------------------------------------------

/// The four rubric items, in scoring order.
enum class Dimension : std::uint8_t { anti_hacking, cuda_engineering, operator_coverage, skill_compliance };
/// "anti-hacking", "cuda-engineering", "operator-coverage", "skill-compliance".
const char* to_string(Dimension dimension) noexcept;

/// One scored item.
struct Item {
  Dimension dimension = Dimension::anti_hacking;  ///< which item
  int score = 3;                                  ///< 1 (worst) … 5 (best)
  std::string reason;                             ///< one sentence: why this score
  std::vector<std::string> evidence;              ///< what the score rests on (findings, lines, facts)
};
/// The four items, indexed by Dimension.
using Items = std::array<Item, 4>;

/// The rubric's verdict on one candidate.
struct Scorecard {
  Items items;             ///< indexed by Dimension
  bool judged = false;     ///< a Judge refined the items
  std::string judge_note;  ///< why a Judge's answer was not used or was adjusted ("" when none)

  /// Sum of the four scores (4 … 20).
  int total() const;
  const Item& operator[](Dimension d) const { return items[static_cast<std::size_t>(d)]; }
  Item& operator[](Dimension d) { return items[static_cast<std::size_t>(d)]; }
  /// One line per item: "anti-hacking 5/5: no findings.".
  std::string describe() const;
};

/// The deterministic detector of each item (Rubric::score runs all four).
Item score_anti_hacking(const Input& input);
Item score_cuda_engineering(const Input& input);
Item score_operator_coverage(const Input& input);
Item score_skill_compliance(const Input& input);

/// Refines the deterministic items; an LLM judge implements it. It may fail: the rubric then keeps
/// the deterministic items. It may lower anti-hacking, never raise it above the detector's score.
class Judge {
 public:
  virtual ~Judge() = default;
  /// Returns the four items (same order, scores 1–5) given the input and the detectors' items.
  virtual Result<Items> refine(const Input& input, const Items& items) = 0;
};

/// Scores candidates: the four detectors, then the Judge if there is one.
class Rubric {
 public:
  /// `judge` may be null (deterministic only).
  explicit Rubric(std::shared_ptr<Judge> judge = nullptr) : judge_(std::move(judge)) {}
  /// The scorecard of one candidate. Never fails: a failing or invalid Judge answer (error, thrown
  /// exception, wrong order, score outside 1–5) leaves the deterministic items and says so in judge_note.
  /// A candidate that did not compile scores 1 on every item (total 4, the least a compiled candidate
  /// can score): its code is not credited for techniques or steps it never ran; the detectors' evidence
  /// is kept and no Judge is asked.
  Scorecard score(const Input& input) const;

 private:
  std::shared_ptr<Judge> judge_;
};

// ---- reward ------------------------------------------------------------------------------------

/// Constants of R = I_correct · (1 − I_hack) · min((s + τ)(1 + λ·r̂), R_max); defaults are the released ones.
struct RewardConfig {
  double tau = 0.3;              ///< τ, added to the speed-up
  double r_max = 5.0;            ///< R_max, the cap
  double lambda_plan = 1.0;      ///< λ for Skill 1
  double lambda_feedback = 0.7;  ///< λ for Skill 2
  /// Finite values, r_max > 0, tau ≥ 0, 0 ≤ λ ≤ 2 (so 1 + λ·r̂ stays ≥ 0).
  Result<void> validate() const;
};

/// r̂ = (total − 4)/16 − 0.5: −0.5 for all 1s, 0 for all 3s, +0.5 for all 5s.
double normalized_rubric(int total) noexcept;

/// The reward and the parts it was made of, for logs and trajectories.
struct Reward {
  double value = 0.0;       ///< R
  bool correct = false;     ///< I_correct: compiled and correct
  bool hack = false;        ///< I_hack: any major finding
  double speedup = 0.0;     ///< s as used (a negative or non-finite speed-up counts as 0)
  int total = 0;            ///< rubric total, 4 … 20
  double normalized = 0.0;  ///< r̂
  double lambda = 0.0;      ///< λ of the skill
  double shaped = 0.0;      ///< (s + τ)(1 + λ·r̂) before the cap
  bool capped = false;      ///< shaped exceeded R_max
  std::string zero_reason;  ///< why R is 0 by an indicator ("not compiled", "incorrect", "unverified", "hack: rule…")
  /// "R=2.875 (s=2, tau=0.3, total=16, r=0.25, lambda=1)" or "R=0: incorrect".
  std::string describe() const;
};

/// The reward of a candidate. InvalidArgument when the config is invalid or a score is outside 1–5.
Result<Reward> reward(const VerifyOutcome& outcome, const Scorecard& scores, Skill skill,
                      const RewardConfig& config = {});

}  // namespace stitchcuda::rubric
