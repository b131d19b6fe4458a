// The server's GPU runners behind the Runner interface: the stitched program (Executor), a program family
// (FamilyExecutor) or, for the load test's baseline, the same model as a TorchScript module in LibTorch
// eager. Only runners.cpp includes torch.
#pragma once

#include <memory>
#include <string>

#include "batcher.hpp"

namespace stitchcuda_server {

/// A runner and what it serves, or why there is none (`unavailable`: no GPU here).
struct Loaded {
  std::unique_ptr<Runner> runner;
  std::string why;
  bool unavailable = false;
};

/// Runs `program` with an Executor, one CUDA stream (and its graph's static buffers) per worker.
Loaded program_runner(stitchcuda::program::Program program, const ServedModel& model, int workers);
/// Runs `family` with a FamilyExecutor, one CUDA stream per worker: each batch at its own size.
Loaded family_runner(stitchcuda::program::ProgramFamily family, const ServedModel& model, int workers);
/// Runs the TorchScript module saved at `module_path` (torch.jit.save) on the GPU, one stream per worker;
/// its forward takes the program's inputs in order and returns a tensor or a tuple of the program's outputs.
Loaded eager_runner(const std::string& module_path, const ServedModel& model, int workers);

}  // namespace stitchcuda_server
