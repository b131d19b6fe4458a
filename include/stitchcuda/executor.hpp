// stitchcuda::program::Executor (defined as stitchcuda::torch::Executor) — runs a Program on a GPU: arena
// from liveness planning, kernels from CUBIN or recompiled, cuBLASLt matmuls with epilogues, ATen ops
// through the dispatcher, views, and the whole forward captured once into a CUDA graph and replayed. Needs
// LibTorch (its caching allocator, dispatcher and streams); the implementation lives in src/torch/, the one
// folder that includes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/program.hpp>

namespace at {
class Tensor;
}

// The Executor is the torch layer's (it lives where LibTorch is included); the program layer names it too,
// where a program's users look for it.
namespace stitchcuda::torch {

/// How an Executor runs its program.
struct ExecutorOptions {
  /// true: capture after one eager warm-up run, then replay; false: always eager (the steps launched
  /// directly); unset: as the program's measured ReplayChoice says (a graph when unmeasured).
  std::optional<bool> graphs;
  int device = -1;           ///< CUDA device; -1: PyTorch's current device
  /// cuBLASLt workspace per instance at most: matmuls choose their algorithms within it, and an instance
  /// allocates the most its chosen algorithms use (none without a matmul).
  std::size_t workspace_bytes = 32u << 20;
  /// Replay through a device-side graph launch: the host enqueues one single-kernel graph whose kernel
  /// tail-launches the captured forward, so host time per run does not grow with the number of steps.
  /// Where the graph or the machine does not allow it, runs replay from the host (stats().host_replay_note).
  bool device_launch = true;
  /// Smallest captured forward (graph nodes) replayed from the device: the device launch adds GPU latency
  /// once but starts each node sooner, so it pays only past a size (measured in docs/program.md).
  std::size_t device_launch_min_nodes = 128;
};

/// Counters since creation.
struct ExecutorStats {
  std::uint64_t runs = 0;          ///< run() calls that succeeded
  std::uint64_t eager_runs = 0;    ///< runs that executed the steps one by one
  std::uint64_t replays = 0;       ///< runs that replayed a captured graph
  std::uint64_t device_launches = 0;  ///< replays launched from the device (one host launch each)
  std::uint64_t captures = 0;      ///< graphs captured (one per stream used)
  std::uint64_t copies_skipped = 0;///< inputs/outputs that were already the graph's static buffers
  std::size_t instances = 0;       ///< per-stream instances (each: arena, workspace, static I/O, graph)
  std::size_t arena_bytes = 0;     ///< planned arena of one instance
  std::size_t workspace_bytes = 0; ///< cuBLASLt workspace of one instance (what its matmuls' algorithms use)
  std::size_t weight_bytes = 0;    ///< weights uploaded into the executor's own memory
  std::size_t shared_weight_bytes = 0;  ///< weights read in place from tensors given at creation
  std::size_t state_bytes = 0;     ///< states allocated (zero-filled) by the executor
  std::size_t shared_state_bytes = 0;  ///< states bound to tensors given at creation
  /// Why replays run from the host although ExecutorOptions::device_launch asked otherwise ("" if not).
  std::string host_replay_note;
};

/// Runs one Program; thread-safe: each stream gets its own instance (arena, static inputs/outputs,
/// captured graph), so threads running on their own streams replay concurrently. States are the
/// executor's, not an instance's: runs of a program with states belong on one stream at a time.
class Executor {
 public:
  /// Validates and plans the program, loads its kernels (the CUBIN when it was built for this device's
  /// architecture, else recompiled from source through the kernel cache), resolves every ATen op in the
  /// dispatcher and checks its arguments, and uploads the weights. Errors name the step at fault.
  static Result<std::shared_ptr<Executor>> create(program::Program program, ExecutorOptions options = {});
  /// As above, reading the weights named in `shared` from the given tensors instead of uploading the
  /// program's bytes: a program running beside the model it was built from uses the model's parameters
  /// in place and holds no second copy of them. Each tensor must have its weight's dtype, shape and
  /// strides, live on the executor's device and start 256-byte aligned; the executor keeps a reference
  /// (the tensor stays alive) and reads whatever the tensor holds at run time. set_weight refuses a shared
  /// weight: write to the tensor instead.
  /// `shared` may also bind states (BufferRole::state, a KV cache): the steps read and update the caller's
  /// tensor in place, run after run. A state left out is allocated zero-filled. Either way its address is
  /// fixed for the executor's life, so a captured graph replays against it.
  static Result<std::shared_ptr<Executor>> create(program::Program program, ExecutorOptions options,
                                                  const std::map<program::BufferId, at::Tensor>& shared);
  /// Program::load + create.
  static Result<std::shared_ptr<Executor>> load(const std::string& path, ExecutorOptions options = {});

  /// Runs the program on `stream` (nullptr: PyTorch's current stream on the device). Inputs and
  /// outputs are in buffer-id order of the input and output buffers; each must match its buffer's
  /// shape, strides and dtype and live on the executor's device. Outputs are written in place.
  Result<void> run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs,
                   void* stream = nullptr);
  /// As above, allocating the outputs.
  Result<std::vector<at::Tensor>> run(const std::vector<at::Tensor>& inputs, void* stream = nullptr);
  /// As above, on raw device pointers (a C++ server without at::Tensor at hand).
  Result<void> run(const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                   void* stream = nullptr);

  /// The graph's own input and output tensors for `stream`: a caller that writes its inputs there and
  /// reads its outputs there (passing these tensors to run) saves the copies in and out.
  Result<std::vector<at::Tensor>> static_inputs(void* stream = nullptr);
  /// See static_inputs.
  Result<std::vector<at::Tensor>> static_outputs(void* stream = nullptr);

  /// Replaces a weight's contents (same shape and dtype); captured graphs see the new values. A weight
  /// shared at creation is the caller's tensor and is refused here.
  Result<void> set_weight(program::BufferId weight, const at::Tensor& value);
  /// The tensor state `id` lives in (the caller's, where shared at creation): reading it shows what the runs
  /// wrote; writing it (in place, between runs) changes what the next run reads.
  Result<at::Tensor> state(program::BufferId id) const;
  /// The state buffer ids, ascending.
  std::vector<program::BufferId> states() const;
  /// Fills every state with zeros (a new sequence for a KV cache); waits for the device.
  Result<void> reset_states();
  /// Frees what runs allocated: every stream's arena, cuBLASLt workspace, split scratch, static inputs
  /// and outputs, and captured graph. The weights and loaded kernels stay; the next run allocates again
  /// (and, replaying, captures again). For a caller that needs the memory back between calls — a
  /// verifier running the reference model, a server idling this program. Waits for the device first;
  /// never call it while a run is in flight on another thread.
  Result<void> release();

  const program::Program& program() const;        ///< what it runs
  const program::BufferPlan& plan() const;        ///< arena layout of the intermediates
  std::vector<program::BufferId> inputs() const;  ///< input buffer ids, in run() order
  std::vector<program::BufferId> outputs() const; ///< output buffer ids, in run() order
  int device() const;                             ///< CUDA device it runs on
  ExecutorStats stats() const;                    ///< counters
  /// What a user should know before trusting the results here, e.g. a program verified on another GPU.
  const std::vector<std::string>& warnings() const;

  struct Impl;
  explicit Executor(std::unique_ptr<Impl> impl);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace stitchcuda::torch

namespace stitchcuda::program {
using torch::Executor;
using torch::ExecutorOptions;
using torch::ExecutorStats;
}  // namespace stitchcuda::program
