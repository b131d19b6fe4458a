// stitchcuda::FamilyExecutor (defined as stitchcuda::torch::FamilyExecutor) — runs a ProgramFamily: each
// call goes to the member built for its sizes, or to a larger one with its inputs zero-padded and its
// outputs narrowed back; one Executor per member, the members' equal weights uploaded once, and at most
// max_resident members holding their working memory. Needs LibTorch, like the Executor (src/torch/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/executor.hpp>
#include <stitchcuda/family.hpp>

namespace stitchcuda::torch {

/// How a FamilyExecutor keeps its members.
struct FamilyOptions {
  /// At most this many members hold their working memory (arena, workspace, static buffers, CUDA graph);
  /// running another releases the least recently run one (which waits for the device). >= 1.
  std::size_t max_resident = 4;
};

/// One member's counters.
struct FamilyMemberStats {
  std::vector<std::int64_t> sizes;  ///< the member's sizes, one per dim
  std::uint64_t calls = 0;          ///< calls it served
  std::uint64_t padded_calls = 0;   ///< of those, calls of smaller sizes padded to its own
  bool resident = false;            ///< holds its working memory now
  ExecutorStats executor;           ///< its Executor's counters
};

/// Counters since creation.
struct FamilyStats {
  std::uint64_t runs = 0;           ///< run() calls that succeeded
  std::uint64_t padded_runs = 0;    ///< of those, runs served by a larger member
  std::uint64_t releases = 0;       ///< members whose working memory went back (max_resident)
  std::size_t resident = 0;         ///< members holding their working memory now
  std::size_t weight_bytes = 0;     ///< weights uploaded, each distinct one once for all members
  std::size_t shared_weight_bytes = 0;  ///< weights read in place from tensors given by the caller
  std::vector<FamilyMemberStats> members;  ///< in member order
};

/// Runs a ProgramFamily; thread-safe like Executor: concurrent run() calls (each stream its own instance in
/// each member), add_member beside them.
class FamilyExecutor {
 public:
  /// Validates the family, then creates every member's Executor (kernels loaded, ATen ops resolved, see
  /// Executor::create), uploading each distinct weight once and sharing it among the members.
  static Result<std::shared_ptr<FamilyExecutor>> create(program::ProgramFamily family, ExecutorOptions options = {},
                                                        FamilyOptions family_options = {});
  /// As above, reading member i's weights named in shared[i] from those tensors (Executor::create's
  /// `shared`): members built beside a model use its parameters in place. shared is empty or one map a member.
  static Result<std::shared_ptr<FamilyExecutor>> create(program::ProgramFamily family, ExecutorOptions options,
                                                        FamilyOptions family_options,
                                                        const std::vector<std::map<program::BufferId, at::Tensor>>& shared);
  /// ProgramFamily::load + create.
  static Result<std::shared_ptr<FamilyExecutor>> load(const std::string& path, ExecutorOptions options = {},
                                                      FamilyOptions family_options = {});

  /// Runs the member that serves the inputs' sizes on `stream` (nullptr: PyTorch's current stream). Inputs
  /// are in the members' input order; a size outside a dim's range, or one no member serves, is an error
  /// naming it. A padded call copies its inputs into zeroed tensors of the member's sizes and returns its
  /// outputs narrowed back to the call's (made contiguous where the narrowed axis is not the outermost).
  /// The outputs are the caller's: no later run writes them.
  Result<std::vector<at::Tensor>> run(const std::vector<at::Tensor>& inputs, void* stream = nullptr);
  /// Adds a member built later (a size met for the first time); checked as ProgramFamily::check_member.
  /// Safe beside run() calls, which see it from their next call on.
  Result<void> add_member(std::vector<std::int64_t> sizes, program::Program program,
                          const std::map<program::BufferId, at::Tensor>& shared = {});
  /// Every member's Executor::release: all working memory goes back until the next runs. Waits for the
  /// device; never while a run is in flight on another thread.
  Result<void> release();

  const std::vector<program::DynamicDim>& dims() const;  ///< the family's dims
  std::vector<std::vector<std::int64_t>> member_sizes() const;  ///< in member order
  int device() const;                                     ///< CUDA device it runs on
  FamilyStats stats() const;                              ///< counters
  /// The members' Executor warnings, each once (a family verified on another GPU says so once).
  std::vector<std::string> warnings() const;

  struct Impl;
  explicit FamilyExecutor(std::unique_ptr<Impl> impl);
  ~FamilyExecutor();
  FamilyExecutor(const FamilyExecutor&) = delete;
  FamilyExecutor& operator=(const FamilyExecutor&) = delete;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace stitchcuda::torch

namespace stitchcuda::program {
using torch::FamilyExecutor;
using torch::FamilyOptions;
using torch::FamilyStats;
using torch::FamilyMemberStats;
}  // namespace stitchcuda::program

namespace stitchcuda {
using torch::FamilyExecutor;
using torch::FamilyOptions;
}  // namespace stitchcuda
