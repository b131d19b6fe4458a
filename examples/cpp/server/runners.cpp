// The GPU runners (runners.hpp): pinned staging buffers per worker, one CUDA stream per worker, the program
// through the Executor, a family through the FamilyExecutor, or a TorchScript module through LibTorch eager.
#include "runners.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/script.h>

#include <algorithm>
#include <cstring>

#include <stitchcuda/executor.hpp>
#include <stitchcuda/family_executor.hpp>

namespace stitchcuda_server {

namespace program = stitchcuda::program;

static at::ScalarType scalar_type(program::DType d) {
  switch (d) {
    case program::DType::f32: return at::kFloat;
    case program::DType::f16: return at::kHalf;
    case program::DType::bf16: return at::kBFloat16;
    case program::DType::f64: return at::kDouble;
    case program::DType::i32: return at::kInt;
    case program::DType::i64: return at::kLong;
    case program::DType::u8: return at::kByte;
    case program::DType::boolean: return at::kBool;
  }
  return at::kFloat;
}

static std::vector<std::int64_t> batched(const TensorSlot& s, std::int64_t batch) {
  std::vector<std::int64_t> shape{batch};
  shape.insert(shape.end(), s.shape.begin(), s.shape.end());
  return shape;
}

// One worker's stream and pinned host buffers: copies in and out run asynchronously on the stream.
struct Lane {
  c10::cuda::CUDAStream stream;
  std::vector<at::Tensor> host_in, host_out;
};

static std::vector<Lane> lanes(const ServedModel& model, int workers, int device) {
  std::vector<Lane> out;
  auto pinned = [&](const TensorSlot& s) {
    return at::empty(batched(s, model.max_batch), at::TensorOptions().dtype(scalar_type(s.dtype)).pinned_memory(true));
  };
  for (int w = 0; w < workers; ++w) {
    Lane lane{c10::cuda::getStreamFromPool(false, c10::DeviceIndex(device)), {}, {}};
    for (const auto& s : model.inputs) lane.host_in.push_back(pinned(s));
    for (const auto& s : model.outputs) lane.host_out.push_back(pinned(s));
    out.push_back(std::move(lane));
  }
  return out;
}

static void stage_in(Lane& lane, const std::vector<std::string>& inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i) std::memcpy(lane.host_in[i].data_ptr(), inputs[i].data(), inputs[i].size());
}

// The batch's rows of the pinned buffers, which hold the largest batch.
static std::vector<at::Tensor> first_rows(const std::vector<at::Tensor>& host, std::int64_t rows) {
  std::vector<at::Tensor> out;
  for (const auto& h : host) out.push_back(h.narrow(0, 0, rows));
  return out;
}

static void stage_out(Lane& lane, std::vector<std::string>& outputs, std::int64_t rows) {
  lane.stream.synchronize();
  for (std::size_t o = 0; o < outputs.size(); ++o)
    outputs[o].assign(static_cast<const char*>(lane.host_out[o].data_ptr()), lane.host_out[o].narrow(0, 0, rows).nbytes());
}

// Rows of a batch the batcher handed over: its first input's bytes over one sample's.
static std::int64_t rows_of(const ServedModel& model, const std::vector<std::string>& inputs) {
  return std::int64_t(inputs[0].size() / model.inputs[0].bytes());
}

namespace {

class ProgramRunner : public Runner {
 public:
  ProgramRunner(std::shared_ptr<program::Executor> ex, const ServedModel& model, int workers)
      : ex_(std::move(ex)), lanes_(lanes(model, workers, ex_->device())) {}
  std::string run(int worker, const std::vector<std::string>& inputs, std::vector<std::string>& outputs) override {
    Lane& lane = lanes_[std::size_t(worker)];
    c10::cuda::CUDAGuard device{c10::DeviceIndex(ex_->device())};
    c10::cuda::CUDAStreamGuard on(lane.stream);
    // The graph's own buffers for this stream: writing there saves the executor a copy in and out.
    auto in = ex_->static_inputs(lane.stream.stream());
    auto out = ex_->static_outputs(lane.stream.stream());
    if (!in || !out) return (!in ? in.error() : out.error()).describe();
    stage_in(lane, inputs);
    for (std::size_t i = 0; i < in->size(); ++i) (*in)[i].copy_(lane.host_in[i], /*non_blocking=*/true);
    if (auto r = ex_->run(*in, *out, lane.stream.stream()); !r) return r.error().describe();
    for (std::size_t o = 0; o < out->size(); ++o) lane.host_out[o].copy_((*out)[o], /*non_blocking=*/true);
    stage_out(lane, outputs, lane.host_out[0].size(0));
    return {};
  }

 private:
  std::shared_ptr<program::Executor> ex_;
  std::vector<Lane> lanes_;
};

class FamilyRunner : public Runner {
 public:
  FamilyRunner(std::shared_ptr<program::FamilyExecutor> ex, const ServedModel& model, int workers)
      : ex_(std::move(ex)), model_(model), lanes_(lanes(model, workers, ex_->device())) {}
  std::string run(int worker, const std::vector<std::string>& inputs, std::vector<std::string>& outputs) override {
    Lane& lane = lanes_[std::size_t(worker)];
    const std::int64_t rows = rows_of(model_, inputs);
    c10::cuda::CUDAGuard device{c10::DeviceIndex(ex_->device())};
    c10::cuda::CUDAStreamGuard on(lane.stream);
    stage_in(lane, inputs);
    std::vector<at::Tensor> in;
    for (const auto& h : first_rows(lane.host_in, rows))
      in.push_back(h.to(at::Device(at::kCUDA, c10::DeviceIndex(ex_->device())), /*non_blocking=*/true));
    auto out = ex_->run(in, lane.stream.stream());
    if (!out) return out.error().describe();
    auto host_out = first_rows(lane.host_out, rows);
    for (std::size_t o = 0; o < out->size(); ++o) {
      if ((*out)[o].sizes() != host_out[o].sizes())
        return "the family's output " + std::to_string(o) + " has " + std::to_string((*out)[o].size(0)) +
               " rows for a batch of " + std::to_string(rows);
      host_out[o].copy_((*out)[o], /*non_blocking=*/true);
    }
    stage_out(lane, outputs, rows);
    return {};
  }

 private:
  std::shared_ptr<program::FamilyExecutor> ex_;
  ServedModel model_;
  std::vector<Lane> lanes_;
};

class EagerRunner : public Runner {
 public:
  EagerRunner(torch::jit::Module module, const ServedModel& model, int workers, int device)
      : module_(std::move(module)), model_(model), device_(device), lanes_(lanes(model, workers, device)) {}
  std::string run(int worker, const std::vector<std::string>& inputs, std::vector<std::string>& outputs) override {
    Lane& lane = lanes_[std::size_t(worker)];
    c10::cuda::CUDAGuard device{c10::DeviceIndex(device_)};
    c10::cuda::CUDAStreamGuard on(lane.stream);
    c10::InferenceMode inference;
    const std::int64_t rows = rows_of(model_, inputs);
    stage_in(lane, inputs);
    std::vector<c10::IValue> args;
    for (auto& h : first_rows(lane.host_in, rows))
      args.emplace_back(h.to(at::Device(at::kCUDA, c10::DeviceIndex(device_)), /*non_blocking=*/true));
    auto result = module_.forward(args);
    std::vector<at::Tensor> got;
    if (result.isTensor()) got.push_back(result.toTensor());
    else if (result.isTuple())
      for (auto& v : result.toTupleRef().elements()) got.push_back(v.toTensor());
    else return "the module's forward returned " + result.tagKind() + ", not a tensor or a tuple of tensors";
    if (got.size() != model_.outputs.size())
      return "the module returned " + std::to_string(got.size()) + " outputs, the program has " +
             std::to_string(model_.outputs.size());
    auto host_out = first_rows(lane.host_out, rows);
    for (std::size_t o = 0; o < got.size(); ++o) {
      if (got[o].sizes() != host_out[o].sizes() || got[o].scalar_type() != host_out[o].scalar_type())
        return "the module's output " + std::to_string(o) + " does not match the program's '" + model_.outputs[o].name + "'";
      host_out[o].copy_(got[o], /*non_blocking=*/true);
    }
    stage_out(lane, outputs, rows);
    return {};
  }

 private:
  torch::jit::Module module_;
  ServedModel model_;
  int device_;
  std::vector<Lane> lanes_;
};

}  // namespace

Loaded program_runner(program::Program p, const ServedModel& model, int workers) {
  auto ex = program::Executor::create(std::move(p));
  if (!ex) return {nullptr, ex.error().describe(), ex.error().code == stitchcuda::ErrorCode::Unavailable};
  for (const auto& w : (*ex)->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  return {std::make_unique<ProgramRunner>(std::move(*ex), model, workers), {}, false};
}

Loaded family_runner(program::ProgramFamily family, const ServedModel& model, int workers) {
  // Every member stays resident: a server meets every batch size in turn, and releasing a member (which
  // waits for the device) to run another would stall the batches at each switch.
  const std::size_t members = family.members.size();
  auto ex = program::FamilyExecutor::create(std::move(family), {}, {.max_resident = std::max<std::size_t>(members, 1)});
  if (!ex) return {nullptr, ex.error().describe(), ex.error().code == stitchcuda::ErrorCode::Unavailable};
  for (const auto& w : (*ex)->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  return {std::make_unique<FamilyRunner>(std::move(*ex), model, workers), {}, false};
}

Loaded eager_runner(const std::string& module_path, const ServedModel& model, int workers) {
  if (!at::hasCUDA() || c10::cuda::device_count() == 0) return {nullptr, "no CUDA device", true};
  const int device = c10::cuda::current_device();
  try {
    auto module = torch::jit::load(module_path, at::Device(at::kCUDA, c10::DeviceIndex(device)));
    module.eval();
    return {std::make_unique<EagerRunner>(std::move(module), model, workers, device), {}, false};
  } catch (const std::exception& e) {
    return {nullptr, "loading the TorchScript module " + module_path + ": " + e.what(), false};
  }
}

}  // namespace stitchcuda_server
