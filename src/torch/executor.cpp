// The program runtime: one Executor per Program, one Instance per stream. An instance owns the arena
// (from liveness planning, allocated through PyTorch's caching allocator), a cuBLASLt workspace, the
// static input/output tensors and, after one eager warm-up run, a CUDA graph of the whole forward.
#include <stitchcuda/executor.hpp>
#include <stitchcuda/jit.hpp>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include <stitchcuda/detail/cuda_driver.hpp>
#include <stitchcuda/detail/step_access.hpp>
#include "steps.hpp"

namespace stitchcuda::torch {

// The Executor runs the program layer's Program, Step, BufferPlan...
using namespace stitchcuda::program;

namespace {

using detail::scalar_type;

const char* dtype_name(c10::ScalarType t) {
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u8, DType::boolean})
    if (scalar_type(d) == t) return to_string(d);
  return c10::toString(t);
}

std::string describe(const at::Tensor& t) {
  std::string s = std::string(dtype_name(t.scalar_type())) + "[";
  for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  s += "]";
  if (!t.is_contiguous()) {
    s += " strides (";
    for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.stride(i));
    s += ")";
  }
  return s + " on " + t.device().str();
}

std::string step_label(const Program& p, std::size_t i) {
  std::string label = "step " + std::to_string(i) + " (" + step_kind(p.steps[i]);
  if (auto* op = std::get_if<AtenOp>(&p.steps[i])) label += " " + op->op;
  if (auto* k = std::get_if<KernelLaunch>(&p.steps[i]); k && k->kernel < p.kernels.size())
    label += " '" + p.kernels[k->kernel].name + "'";
  return label + ")";
}

Error at_step(const Program& p, std::size_t i, Error e) {
  e.message = step_label(p, i) + ": " + e.message;
  return e;
}

// Whether `t` has exactly the buffer's shape, strides and dtype.
bool matches(const at::Tensor& t, const TensorSpec& spec) {
  if (t.scalar_type() != scalar_type(spec.dtype) || t.dim() != std::int64_t(spec.shape.size())) return false;
  for (std::size_t i = 0; i < spec.shape.size(); ++i) {
    if (t.size(std::int64_t(i)) != spec.shape[i]) return false;
    if (spec.shape[i] > 1 && t.stride(std::int64_t(i)) != spec.strides[i]) return false;
  }
  return true;
}

// ParamInfo for a declared C type: what the driver needs to pack arguments of a CUBIN without PTX.
std::optional<jit::ParamInfo> param_of(const std::string& type) {
  using jit::ParamKind;
  if (!type.empty() && type.back() == '*') return jit::ParamInfo{ParamKind::U64, 8, 8};
  struct Row { const char* name; ParamKind kind; std::size_t size; };
  static const Row rows[] = {
      {"int", ParamKind::S32, 4},          {"int32_t", ParamKind::S32, 4},       {"unsigned", ParamKind::U32, 4},
      {"unsigned int", ParamKind::U32, 4}, {"uint32_t", ParamKind::U32, 4},      {"float", ParamKind::F32, 4},
      {"double", ParamKind::F64, 8},       {"long long", ParamKind::S64, 8},     {"int64_t", ParamKind::S64, 8},
      {"long", ParamKind::S64, 8},         {"size_t", ParamKind::U64, 8},        {"uint64_t", ParamKind::U64, 8},
      {"unsigned long long", ParamKind::U64, 8}, {"bool", ParamKind::U8, 1}};
  std::string t = type;
  if (t.rfind("const ", 0) == 0) t.erase(0, 6);
  for (const Row& r : rows)
    if (t == r.name) return jit::ParamInfo{r.kind, r.size, r.size};
  return std::nullopt;
}

bool is_identifier(const std::string& s) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
  return true;
}

// The kernel of a KernelSource: its CUBIN when built for `arch` (no NVRTC needed), else recompiled.
Result<jit::Kernel> load_kernel(const KernelSource& ks, const std::string& arch) {
  if (!ks.cubin.empty() && ks.arch == arch && !ks.signature.empty() && is_identifier(ks.name)) {
    auto binary = std::make_shared<jit::Binary>();
    binary->program_name = ks.name + ".cu";
    binary->arch = ks.arch;
    binary->cubin = ks.cubin;
    jit::KernelInfo info{ks.name, {}};
    bool known = true;
    for (const std::string& type : ks.signature) {
      auto p = param_of(type);
      if (!p) { known = false; break; }
      info.params.push_back(*p);
    }
    if (known) {
      binary->kernels.push_back(std::move(info));
      auto module = jit::Module::create(binary);
      module->set_origin("artifact");
      return module->kernel(ks.name);
    }
  }
  jit::CompileOptions options;
  options.arch = arch;
  options.extra_flags = ks.options;
  if (!is_identifier(ks.name)) options.name_expressions.push_back(ks.name);
  auto module = jit::build(ks.source, options, ks.name + ".cu");
  if (!module) return tl::unexpected(module.error());
  return (*module)->kernel(ks.name);
}

}  // namespace

// One stream's state: everything a run touches, so instances never share mutable memory.
struct Instance {
  std::mutex mu;
  at::Tensor arena, workspace;
  std::size_t workspace_bytes = 0;  // workspace's size: the most the matmuls' chosen algorithms use
  // The split operands of tf32x3 matmuls whose parts are small (one at a time: steps run in order); a
  // matmul whose parts take large_storage_bytes or more allocates its own at its step instead.
  at::Tensor split_scratch;
  std::vector<at::Tensor> tensors;  // by buffer slot; intermediates bound to the arena
  std::vector<at::Tensor> static_in, static_out;
  std::vector<std::unique_ptr<detail::PreparedMatmul>> matmuls;  // by step (null for others)
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  bool warmed = false;
  // Device-side replay: the forward instantiated for device launch, and a one-kernel graph whose
  // kernel tail-launches it (writing the device's cudaGraphLaunch result to `launch_status`).
  cudaGraphExec_t device_exec = nullptr;
  cudaGraphExec_t launcher = nullptr;
  at::Tensor launch_status;
  bool device_launch_tried = false;
  void drop_device_launch() {
    if (launcher) cudaGraphExecDestroy(launcher);
    if (device_exec) cudaGraphExecDestroy(device_exec);
    launcher = device_exec = nullptr;
  }
  ~Instance() { drop_device_launch(); }
};

// The launcher of device-side replay. A graph may be launched from the device only by a kernel that
// itself runs inside a graph; the tail launch starts the forward when the launcher's graph finishes,
// and the stream's next work waits for both (they share one execution environment).
constexpr const char* kGraphLauncherSource = R"(
extern "C" __global__ void stitchcuda_tail_launch(cudaGraphExec_t forward, int* status) {
  *status = (int)cudaGraphLaunch(forward, cudaStreamGraphTailLaunch);
}
)";

// ATen ops whose captured replay depends on PyTorch advancing generator offsets in CUDAGraph::replay.
bool draws_random_numbers(const std::string& op) {
  for (const char* word : {"rand", "dropout", "bernoulli", "normal", "multinomial", "exponential", "geometric",
                           "cauchy", "uniform"})
    if (op.find(word) != std::string::npos) return true;
  return false;
}

struct Executor::Impl {
  Program program;
  BufferPlan plan;
  ExecutorOptions options;
  int device = 0;
  std::string arch;
  std::unordered_map<BufferId, std::size_t> slot;  // buffer id -> index in Program::buffers
  std::vector<BufferId> input_ids, output_ids;
  // By slot: an intermediate outside the arena (an ATen step writes it first), whose slot takes the
  // tensor the op returns instead of a copy; its views are taken from whatever the slot holds at run time.
  std::vector<char> adoptable;
  // By step: the slots of storages outside the arena (and their views) whose last use is that step; the
  // run lets go of them there, so PyTorch's allocator (or a capture's private pool) reuses the memory.
  std::vector<std::vector<std::size_t>> free_after;
  // By step: the slots of large storages outside the arena (Placement::allocated) whose first step it is;
  // the run allocates them just before it.
  std::vector<std::vector<std::size_t>> allocate_before;
  // By step: the output slots first touched there (directly or through a view). run(inputs), which
  // allocates the outputs, allocates each one just before that step, not before the first, so the
  // program's early steps run without its outputs' memory; an ATen step that writes an output first
  // hands over its own result when its layout matches (no copy, no second tensor of that size).
  std::vector<std::vector<std::size_t>> outputs_before;
  std::vector<char> adopt_output;  // by slot: an output an ATen step writes first, directly
  std::vector<jit::Kernel> kernels;                // by kernel table index
  std::vector<std::string> warnings;
  std::vector<std::optional<detail::BoundAtenOp>> aten;  // by step
  std::map<BufferId, at::Tensor> weights;          // device copies, or the caller's tensors where shared
  std::set<BufferId> shared;                       // weights read in place from the caller's tensors
  std::size_t weight_bytes = 0, shared_weight_bytes = 0;
  std::map<BufferId, at::Tensor> states;           // fixed for the executor's life: the caller's where shared
  std::size_t state_bytes = 0, shared_state_bytes = 0;
  const jit::detail::DriverApi* driver = nullptr;

  std::mutex instances_mu;
  std::size_t workspace_in_use = 0;  // the largest instance's cuBLASLt workspace (guarded by instances_mu)
  std::map<void*, std::unique_ptr<Instance>> instances;
  std::atomic<std::uint64_t> runs{0}, eager_runs{0}, replays{0}, captures{0}, copies_skipped{0}, device_launches{0};
  std::string no_device_launch;  // set at creation when the program rules device-side replay out
  std::mutex launcher_mu;        // guards launcher_kernel and host_replay_note
  std::optional<jit::Kernel> launcher_kernel;
  std::string host_replay_note;  // why runs replay from the host although device launch was asked for

  at::TensorOptions options_for(const TensorSpec& s) const {
    return at::TensorOptions().dtype(scalar_type(s.dtype)).device(at::kCUDA, c10::DeviceIndex(device));
  }
  const TensorSpec& spec(BufferId id) const { return program.buffers[slot.at(id)].spec; }
  // Whether `result` can become the buffer of spec `s`: same layout and device, and no storage shared
  // with the step's inputs (a view of an input would alias a value the program overwrites or frees).
  bool adopt(const at::Tensor& result, const TensorSpec& s, const std::vector<at::Tensor>& inputs) const {
    if (result.strides() != c10::IntArrayRef(s.strides) || !result.is_cuda() || result.get_device() != device ||
        !result.has_storage())
      return false;
    for (const at::Tensor& a : inputs)
      if (a.defined() && a.has_storage() && result.storage().is_alias_of(a.storage())) return false;
    return true;
  }

  void* resolve(void* stream) const {
    return stream ? stream : static_cast<void*>(c10::cuda::getCurrentCUDAStream(c10::DeviceIndex(device)).stream());
  }
  Result<Instance*> instance(void* stream);
  Result<void> ensure_static(Instance& in);
  Result<void> execute(Instance& in, void* stream, bool own_outputs = false);
  Result<void> run(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs, bool allocate, void* stream);
  Result<void> check_io(const std::vector<at::Tensor>& given, const std::vector<BufferId>& ids, const char* what) const;
  Result<void> copy(const at::Tensor& dst, const at::Tensor& src, void* stream);
  Result<jit::Kernel> graph_launcher();
  std::string launch_from_device(Instance& in, cudaStream_t stream);
};

Result<jit::Kernel> Executor::Impl::graph_launcher() {
  std::lock_guard<std::mutex> lock(launcher_mu);
  if (!launcher_kernel) {
    jit::CompileOptions options;
    options.arch = arch;
    options.device_runtime = true;
    auto module = jit::build(kGraphLauncherSource, options, "graph_launcher.cu");
    if (!module) return tl::unexpected(module.error());
    auto kernel = (*module)->kernel("stitchcuda_tail_launch");
    if (!kernel) return tl::unexpected(kernel.error());
    launcher_kernel = std::move(*kernel);
  }
  return *launcher_kernel;
}

// Sets up device-side replay of `in`'s captured forward and runs it once (this run's forward):
// "" when that worked, else why not, with nothing run and nothing left behind.
std::string Executor::Impl::launch_from_device(Instance& in, cudaStream_t stream) {
  if (!no_device_launch.empty()) return no_device_launch;
  std::size_t nodes = 0;
  if (cudaGraphGetNodes(in.graph->raw_cuda_graph(), nullptr, &nodes) == cudaSuccess && nodes < options.device_launch_min_nodes)
    return "the forward has " + std::to_string(nodes) + " graph nodes, fewer than device_launch_min_nodes (" +
           std::to_string(options.device_launch_min_nodes) + "): launching it from the host is faster there";
  (void)cudaGetLastError();
  auto kernel = graph_launcher();
  if (!kernel) return "the device graph launcher could not be built: " + kernel.error().message;
  auto give_up = [&](const std::string& what, cudaError_t e) {
    (void)cudaGetLastError();  // a failed setup call must not surface in the caller's next check
    in.drop_device_launch();
    return what + " (" + cudaGetErrorString(e) + ")";
  };
  if (cudaError_t e = cudaGraphInstantiateWithFlags(&in.device_exec, in.graph->raw_cuda_graph(),
                                                    cudaGraphInstantiateFlagDeviceLaunch);
      e != cudaSuccess) {
    in.device_exec = nullptr;
    return give_up("the captured forward cannot be launched from the device", e);
  }
  if (cudaError_t e = cudaGraphUpload(in.device_exec, stream); e != cudaSuccess)
    return give_up("uploading the forward graph for device launch failed", e);
  in.launch_status = at::full({1}, -1, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, c10::DeviceIndex(device)));
  jit::LaunchConfig cfg;
  cfg.grid = {1, 1, 1};
  cfg.block = {1, 1, 1};
  jit::KernelArgs args;
  args.pointer(static_cast<const void*>(in.device_exec)).pointer(in.launch_status.data_ptr());
  auto prepared = kernel->prepare(cfg, std::move(args));
  if (!prepared) {
    in.drop_device_launch();
    return "the device graph launcher could not be prepared: " + prepared.error().message;
  }
  // The launcher's graph: captured on a side stream (thread-local mode leaves other threads alone).
  auto side = c10::cuda::getStreamFromPool(false, c10::DeviceIndex(device));
  cudaGraph_t launcher_graph = nullptr;
  if (cudaError_t e = cudaStreamBeginCapture(side.stream(), cudaStreamCaptureModeThreadLocal); e != cudaSuccess)
    return give_up("capturing the device graph launcher failed", e);
  auto launched = prepared->launch(side.stream());
  cudaError_t ended = cudaStreamEndCapture(side.stream(), &launcher_graph);
  if (!launched) {
    if (launcher_graph) cudaGraphDestroy(launcher_graph);
    in.drop_device_launch();
    return "capturing the device graph launcher failed: " + launched.error().message;
  }
  if (ended != cudaSuccess) return give_up("capturing the device graph launcher failed", ended);
  cudaError_t made = cudaGraphInstantiate(&in.launcher, launcher_graph, 0);
  cudaGraphDestroy(launcher_graph);
  if (made != cudaSuccess) {
    in.launcher = nullptr;
    return give_up("instantiating the device graph launcher failed", made);
  }
  // The first device-side replay is this run's forward; its status says whether the device accepted it.
  if (cudaError_t e = cudaGraphLaunch(in.launcher, stream); e != cudaSuccess)
    return give_up("launching the device graph launcher failed", e);
  const int status = in.launch_status.item<int>();  // waits for the stream
  if (status != 0) return give_up("the device refused the graph launch", cudaError_t(status));
  return "";
}

Result<Instance*> Executor::Impl::instance(void* stream) {
  std::lock_guard<std::mutex> lock(instances_mu);
  if (auto it = instances.find(stream); it != instances.end()) return it->second.get();
  auto in = std::make_unique<Instance>();
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(this->device));
    in->arena = at::empty({std::int64_t(std::max<std::size_t>(plan.arena_bytes, 1))},
                          at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::DeviceIndex(device)));
    in->tensors.resize(program.buffers.size());
    auto* base = static_cast<std::uint8_t*>(in->arena.data_ptr());
    for (const Placement& p : plan.placements) {
      // Views are taken by their View step; an ATen step's own result arrives when it runs.
      if (p.buffer != p.storage || !p.in_arena) continue;
      const TensorSpec& s = spec(p.buffer);
      in->tensors[slot.at(p.buffer)] = at::from_blob(base + p.offset, s.shape, s.strides, options_for(s));
    }
    for (const auto& [id, t] : weights) in->tensors[slot.at(id)] = t;
    for (const auto& [id, t] : states) in->tensors[slot.at(id)] = t;
    in->matmuls.resize(program.steps.size());
    for (std::size_t i = 0; i < program.steps.size(); ++i)
      if (auto* m = std::get_if<Matmul>(&program.steps[i])) {
        auto prepared = detail::PreparedMatmul::create(*m, program, options.workspace_bytes);
        if (!prepared) return tl::unexpected(at_step(program, i, prepared.error()));
        in->matmuls[i] = std::move(*prepared);
      }
    // The workspace the chosen algorithms use, not the cap they were chosen within (32 MiB by default,
    // beside an LSTM's or a VGG's working set; many algorithms use none).
    std::size_t scratch = 0, workspace = 0;
    for (const auto& m : in->matmuls) {
      if (!m) continue;
      workspace = std::max(workspace, m->workspace_needed());
      if (m->scratch_bytes() < BufferPlan::large_storage_bytes) scratch = std::max(scratch, m->scratch_bytes());
    }
    if (workspace) {
      in->workspace_bytes = (workspace + 255) / 256 * 256;
      in->workspace = at::empty({std::int64_t(in->workspace_bytes)},
                                at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::DeviceIndex(device)));
    }
    workspace_in_use = std::max<std::size_t>(workspace_in_use, in->workspace_bytes);
    if (scratch)
      in->split_scratch = at::empty({std::int64_t(scratch)},
                                    at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::DeviceIndex(device)));
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("allocating the program's buffers failed: ") + e.what_without_backtrace());
  }
  Instance* raw = in.get();
  instances.emplace(stream, std::move(in));
  return raw;
}

// The static inputs and outputs a captured graph reads and writes: allocated at the first capture (or
// when asked for), never for an instance that only launches directly — at KernelBench's sizes they are
// a copy of every input and output.
Result<void> Executor::Impl::ensure_static(Instance& in) {
  if (in.static_in.size() == input_ids.size() && in.static_out.size() == output_ids.size()) return {};
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(this->device));
    std::vector<at::Tensor> ins, outs;
    for (BufferId id : input_ids) {
      const TensorSpec& s = spec(id);
      ins.push_back(at::empty_strided(s.shape, s.strides, options_for(s)));
    }
    for (BufferId id : output_ids) {
      const TensorSpec& s = spec(id);
      outs.push_back(at::empty_strided(s.shape, s.strides, options_for(s)));
    }
    in.static_in = std::move(ins);
    in.static_out = std::move(outs);
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("allocating the graph's static inputs and outputs failed: ") +
                                          e.what_without_backtrace());
  }
  return {};
}

Result<void> Executor::Impl::copy(const at::Tensor& dst, const at::Tensor& src, void* stream) {
  if (dst.data_ptr() == src.data_ptr()) {
    copies_skipped++;
    return {};
  }
  // Both match the buffer's spec, so one copy of the storage span moves every element.
  std::size_t span = dst.numel() ? 1 : 0;
  for (std::int64_t d = 0; span && d < dst.dim(); ++d) span += std::size_t((dst.size(d) - 1) * dst.stride(d));
  CUresult r = driver->MemcpyAsync(reinterpret_cast<CUdeviceptr>(dst.data_ptr()), reinterpret_cast<CUdeviceptr>(src.data_ptr()),
                                   span * dst.element_size(), static_cast<CUstream>(stream));
  if (r != CUDA_SUCCESS) return tl::unexpected(jit::detail::cuda_error(r, "copying a program input or output"));
  return {};
}

Result<void> Executor::Impl::check_io(const std::vector<at::Tensor>& given, const std::vector<BufferId>& ids,
                                      const char* what) const {
  if (given.size() != ids.size())
    return fail(ErrorCode::InvalidArgument, std::string("the program takes ") + std::to_string(ids.size()) + " " + what +
                                                "(s) but " + std::to_string(given.size()) + " were given");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const Buffer& b = program.buffers[slot.at(ids[i])];
    const at::Tensor& t = given[i];
    std::string name = std::string(what) + " " + std::to_string(i) + (b.name.empty() ? "" : " ('" + b.name + "')");
    if (!t.defined()) return fail(ErrorCode::InvalidArgument, name + " is an undefined tensor");
    if (!t.is_cuda() || t.get_device() != device)
      return fail(ErrorCode::InvalidArgument, name + " is on " + t.device().str() + " but the program runs on cuda:" +
                                                  std::to_string(device) + ": move it with .to('cuda:" + std::to_string(device) + "')");
    if (!matches(t, b.spec))
      return fail(ErrorCode::InvalidArgument, name + " must be " + b.spec.describe() + " but is " + describe(t) +
                                                  (t.is_contiguous() ? "" : ": pass .contiguous()"));
  }
  return {};
}

// `own_outputs`: the output slots are empty and the run allocates each before the step that first
// touches it (outputs_before), or adopts an ATen step's result as it (adopt_output).
Result<void> Executor::Impl::execute(Instance& in, void* stream, bool own_outputs) {
  const auto& steps = program.steps;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const Step& step = steps[i];
    Result<void> ok{};
    try {
      for (std::size_t k : allocate_before[i]) {
        const TensorSpec& s = program.buffers[k].spec;
        in.tensors[k] = at::empty_strided(s.shape, s.strides, options_for(s));
      }
      if (own_outputs)
        for (std::size_t k : outputs_before[i])
          if (!adopt_output[k] || !std::holds_alternative<AtenOp>(step)) {
            const TensorSpec& s = program.buffers[k].spec;
            in.tensors[k] = at::empty_strided(s.shape, s.strides, options_for(s));
          }
      if (auto* k = std::get_if<KernelLaunch>(&step)) {
        jit::KernelArgs args;
        for (const KernelArg& a : k->args) {
          if (auto* b = std::get_if<BufferArg>(&a)) args.pointer(in.tensors[slot.at(b->buffer)].data_ptr());
          else if (auto* v = std::get_if<std::int32_t>(&a)) args.i32(*v);
          else if (auto* v = std::get_if<std::int64_t>(&a)) args.i64(*v);
          else if (auto* v = std::get_if<float>(&a)) args.f32(*v);
          else if (auto* v = std::get_if<double>(&a)) args.f64(*v);
        }
        jit::LaunchConfig cfg;
        cfg.grid = {k->grid[0], k->grid[1], k->grid[2]};
        cfg.block = {k->block[0], k->block[1], k->block[2]};
        cfg.shared_mem_bytes = k->shared_mem_bytes;
        cfg.stream = stream;
        cfg.device = device;
        ok = kernels[k->kernel].launch(cfg, args);
      } else if (auto* m = std::get_if<Matmul>(&step)) {
        const at::Tensor* bias = m->bias ? &in.tensors[slot.at(*m->bias)] : nullptr;
        const auto& prepared = *in.matmuls[i];
        // Large split parts live for their step only, like a large storage: PyTorch's allocator (or the
        // capture's private pool) gives them the memory of storages already let go, and takes it back after
        // (stream-ordered: the current stream is `stream`), so the program's peak is its widest step's live
        // set plus this step's parts, not its widest step plus the largest parts of any step.
        at::Tensor own_scratch;
        if (prepared.scratch_bytes() >= BufferPlan::large_storage_bytes)
          own_scratch = at::empty({std::int64_t(prepared.scratch_bytes())},
                                  at::TensorOptions().dtype(at::kByte).device(at::kCUDA, c10::DeviceIndex(device)));
        const at::Tensor& scratch = own_scratch.defined() ? own_scratch : in.split_scratch;
        ok = prepared.run(in.tensors[slot.at(m->a)], in.tensors[slot.at(m->b)], in.tensors[slot.at(m->c)], bias,
                          in.workspace.defined() ? in.workspace.data_ptr() : nullptr, in.workspace_bytes, stream,
                          scratch.defined() ? scratch.data_ptr() : nullptr);
      } else if (auto* op = std::get_if<AtenOp>(&step)) {
        std::vector<at::Tensor> args;
        args.reserve(op->inputs.size());
        for (BufferId id : op->inputs) args.push_back(in.tensors[slot.at(id)]);
        std::vector<at::Tensor> results = aten[i]->call(args);
        if (results.size() != op->outputs.size())
          ok = fail(ErrorCode::InvalidArgument, "returned " + std::to_string(results.size()) + " tensor(s) for " +
                                                    std::to_string(op->outputs.size()) + " output buffer(s)");
        for (std::size_t r = 0; ok && r < results.size(); ++r) {
          const std::size_t k = slot.at(op->outputs[r]);
          const TensorSpec& s = spec(op->outputs[r]);
          at::Tensor& out = in.tensors[k];
          if (!in.warmed &&
              (results[r].sizes() != c10::IntArrayRef(s.shape) || results[r].scalar_type() != scalar_type(s.dtype)))
            ok = fail(ErrorCode::InvalidArgument, "result " + std::to_string(r) + " is " + describe(results[r]) +
                                                      " but its buffer is " + s.describe());
          else if (out.defined() && out.is_same(results[r]))
            continue;  // an in-place update of a state: the op wrote the buffer itself
          else if ((adoptable[k] || (own_outputs && adopt_output[k] && !out.defined())) && adopt(results[r], s, args))
            out = results[r];  // no copy: a convolution's output is often the largest tensor of the step
          else {
            if (!out.defined()) out = at::empty_strided(s.shape, s.strides, options_for(s));  // a view of an input
            out.copy_(results[r]);
          }
        }
      } else if (auto* v = std::get_if<View>(&step)) {
        const at::Tensor& src = in.tensors[slot.at(v->source)];
        const TensorSpec& s = spec(v->result);
        in.tensors[slot.at(v->result)] = src.as_strided(s.shape, s.strides, src.storage_offset() + v->storage_offset);
      }
    } catch (const c10::Error& e) {
      ok = fail(ErrorCode::CudaError, e.what_without_backtrace());
    }
    if (!ok) return tl::unexpected(at_step(program, i, ok.error()));
    for (std::size_t k : free_after[i]) in.tensors[k] = at::Tensor();
  }
  return {};
}

Executor::Executor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Executor::~Executor() = default;

Result<std::shared_ptr<Executor>> Executor::create(Program program, ExecutorOptions options) {
  return create(std::move(program), options, {});
}

Result<std::shared_ptr<Executor>> Executor::create(Program program, ExecutorOptions options,
                                                   const std::map<BufferId, at::Tensor>& shared) {
  auto plan = program.plan();  // validates first
  if (!plan) return tl::unexpected(plan.error());
  // Everything that needs no GPU is checked first, so a bad program fails the same way everywhere.
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (!impl->options.graphs) impl->options.graphs = program.replay.mode != Replay::direct;
  impl->plan = std::move(*plan);
  impl->program = std::move(program);
  Impl& x = *impl;
  for (std::size_t i = 0; i < x.program.buffers.size(); ++i) {
    const Buffer& b = x.program.buffers[i];
    x.slot[b.id] = i;
    if (b.role == BufferRole::input) x.input_ids.push_back(b.id);
    if (b.role == BufferRole::output) x.output_ids.push_back(b.id);
  }
  std::sort(x.input_ids.begin(), x.input_ids.end());
  std::sort(x.output_ids.begin(), x.output_ids.end());
  x.adoptable.assign(x.program.buffers.size(), 0);
  x.free_after.assign(x.program.steps.size(), {});
  x.allocate_before.assign(x.program.steps.size(), {});
  for (const Placement& p : x.plan.placements) {
    if (p.in_arena) continue;
    if (p.buffer == p.storage && p.allocated) x.allocate_before[std::size_t(p.first_step)].push_back(x.slot.at(p.buffer));
    else if (p.buffer == p.storage) x.adoptable[x.slot.at(p.buffer)] = 1;
    x.free_after[std::size_t(p.last_step)].push_back(x.slot.at(p.buffer));
  }
  // Views of the caller's inputs and outputs go after their last use too: a run keeps no reference to
  // the caller's tensors (a view would hold an input of several GB alive until the next run).
  {
    std::unordered_map<BufferId, BufferId> root_of;
    std::unordered_map<BufferId, std::size_t> last_use;
    for (std::size_t i = 0; i < x.program.steps.size(); ++i) {
      if (auto* v = std::get_if<View>(&x.program.steps[i])) {
        auto it = root_of.find(v->source);
        root_of[v->result] = it == root_of.end() ? v->source : it->second;
      }
      program::detail::StepAccess acc = program::detail::access_of(x.program.steps[i]);
      for (auto* list : {&acc.reads, &acc.writes})
        for (BufferId id : *list) last_use[id] = i;
    }
    for (const auto& [view, root] : root_of) {
      BufferRole role = x.program.buffers[x.slot.at(root)].role;
      if (role == BufferRole::input || role == BufferRole::output) x.free_after[last_use.at(view)].push_back(x.slot.at(view));
    }
    // Each output's first step (through its views too), and whether that step is an ATen op writing it.
    x.outputs_before.assign(x.program.steps.size(), {});
    x.adopt_output.assign(x.program.buffers.size(), 0);
    std::set<BufferId> placed;
    for (std::size_t i = 0; i < x.program.steps.size(); ++i) {
      program::detail::StepAccess acc = program::detail::access_of(x.program.steps[i]);
      for (auto* list : {&acc.reads, &acc.writes})
        for (BufferId id : *list) {
          auto it = root_of.find(id);
          const BufferId root = it == root_of.end() ? id : it->second;
          if (x.program.buffers[x.slot.at(root)].role != BufferRole::output || !placed.insert(root).second) continue;
          x.outputs_before[i].push_back(x.slot.at(root));
          if (auto* op = std::get_if<AtenOp>(&x.program.steps[i]))
            x.adopt_output[x.slot.at(root)] =
                std::find(op->outputs.begin(), op->outputs.end(), root) != op->outputs.end() &&
                std::find(op->inputs.begin(), op->inputs.end(), root) == op->inputs.end();
        }
    }
  }
  x.aten.resize(x.program.steps.size());
  for (std::size_t i = 0; i < x.program.steps.size(); ++i)
    if (auto* op = std::get_if<AtenOp>(&x.program.steps[i])) {
      auto bound = detail::BoundAtenOp::bind(*op, x.program);
      if (!bound) return tl::unexpected(at_step(x.program, i, bound.error()));
      x.aten[i] = std::move(*bound);
    }
  auto drv = jit::detail::driver();
  if (!drv) return tl::unexpected(drv.error());
  x.driver = *drv;
  if (jit::Driver::device_count() == 0)
    return fail(ErrorCode::Unavailable, "no CUDA device: a program runs on a GPU (it can be built, validated, planned "
                                        "and saved without one)");
  try {
    x.device = options.device >= 0 ? options.device : int(c10::cuda::current_device());
  } catch (const c10::Error& e) {
    return fail(ErrorCode::Unavailable, std::string("PyTorch sees no CUDA device: ") + e.what_without_backtrace());
  }
  auto info = jit::Driver::device(x.device);
  if (!info) return tl::unexpected(info.error());
  x.arch = info->arch();
  if (const HardwareInfo& hw = x.program.verified_on; !hw.arch.empty() && hw.arch != x.arch)
    x.warnings.push_back("the program was verified on " + (hw.device.empty() ? hw.arch : hw.device + " (" + hw.arch + ")") +
                         " but runs on " + info->name + " (" + x.arch + "): its kernels are recompiled from source "
                         "and its results are unverified here; verify it again on this GPU");
  for (const KernelSource& ks : x.program.kernels) {
    auto k = load_kernel(ks, x.arch);
    if (!k) {
      Error e = k.error();
      e.message = "kernel '" + ks.name + "': " + e.message;
      return tl::unexpected(std::move(e));
    }
    x.kernels.push_back(std::move(*k));
  }
  // Arguments against the kernels' parameters, so a wrong scalar type fails here, naming the step.
  for (std::size_t i = 0; i < x.program.steps.size(); ++i) {
    auto* k = std::get_if<KernelLaunch>(&x.program.steps[i]);
    if (!k) continue;
    const auto& params = x.kernels[k->kernel].params();
    if (params.size() != k->args.size())
      return fail(ErrorCode::InvalidArgument, step_label(x.program, i) + ": the kernel takes " + std::to_string(params.size()) +
                                                  " argument(s) but the step passes " + std::to_string(k->args.size()));
    for (std::size_t a = 0; a < params.size(); ++a) {
      std::size_t size = std::visit([](const auto& v) -> std::size_t {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, BufferArg>) return sizeof(void*);
        else return sizeof(T);
      }, k->args[a]);
      if (size != params[a].size)
        return fail(ErrorCode::InvalidArgument, step_label(x.program, i) + ": argument " + std::to_string(a) + " is " +
                                                    std::to_string(size) + " bytes but the kernel's parameter is " +
                                                    jit::to_string(params[a].kind) + " (" + std::to_string(params[a].size) +
                                                    " bytes)");
    }
  }
  for (std::size_t i = 0; i < x.program.steps.size() && x.no_device_launch.empty(); ++i)
    if (auto* a = std::get_if<AtenOp>(&x.program.steps[i]); a && draws_random_numbers(a->op))
      x.no_device_launch = step_label(x.program, i) + " (" + a->op + ") draws random numbers, and only PyTorch's "
                           "host-side replay advances the generator between runs";
  for (const auto& [id, t] : shared) {
    auto found = x.slot.find(id);
    const BufferRole role = found == x.slot.end() ? BufferRole::intermediate : x.program.buffers[found->second].role;
    if (role != BufferRole::weight && role != BufferRole::state)
      return fail(ErrorCode::InvalidArgument, "buffer " + std::to_string(id) + " is not a weight or state of this "
                                              "program: only those can be shared");
    const Buffer& b = x.program.buffers[found->second];
    std::string name = std::string("shared ") + to_string(role) + " " + std::to_string(id) +
                       (b.name.empty() ? "" : " ('" + b.name + "')");
    const bool weight = role == BufferRole::weight;
    const std::string otherwise = weight ? ", or leave it out to upload the program's own copy"
                                         : ", or leave it out for a zero-filled state of the executor's own";
    if (!t.defined()) return fail(ErrorCode::InvalidArgument, name + " is an undefined tensor");
    if (!t.is_cuda() || t.get_device() != x.device)
      return fail(ErrorCode::InvalidArgument, name + " is on " + t.device().str() + " but the program runs on cuda:" +
                                                  std::to_string(x.device) + ": share a tensor on that device" + otherwise);
    if (!matches(t, b.spec))
      return fail(ErrorCode::InvalidArgument, name + " must be " + b.spec.describe() + " but is " + describe(t) +
                                                  (weight ? ": share the tensor the weight was built from"
                                                          : ": share a tensor of the state's layout") + otherwise);
    if (reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 256 != 0)
      return fail(ErrorCode::InvalidArgument, name + " does not start 256-byte aligned (kernels load it in vectors): "
                                                  "share a whole tensor (torch allocates at 256-byte boundaries)" + otherwise);
  }
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(x.device));
    for (const Buffer& b : x.program.buffers) {
      if (b.role == BufferRole::state) {
        if (auto it = shared.find(b.id); it != shared.end()) {
          x.states[b.id] = it->second;  // the caller's tensor: read and updated in place
          x.shared_state_bytes += b.spec.storage_bytes();
        } else {
          x.states[b.id] = at::zeros(b.spec.shape, x.options_for(b.spec)).as_strided(b.spec.shape, b.spec.strides);
          x.state_bytes += b.spec.storage_bytes();
        }
        continue;
      }
      if (b.role != BufferRole::weight) continue;
      if (auto it = shared.find(b.id); it != shared.end()) {
        x.weights[b.id] = it->second;  // a reference: the caller's tensor is read in place
        x.shared.insert(b.id);
        x.shared_weight_bytes += b.spec.storage_bytes();
        continue;
      }
      x.weight_bytes += b.spec.storage_bytes();
      auto dev = at::empty_strided(b.spec.shape, b.spec.strides, x.options_for(b.spec));
      auto it = x.program.weights.find(b.id);
      if (it != x.program.weights.end() && !it->second.empty()) {
        auto host = at::from_blob(const_cast<char*>(it->second.data()), b.spec.shape, b.spec.strides,
                                  at::TensorOptions().dtype(scalar_type(b.spec.dtype)));
        dev.copy_(host);
      } else {
        dev.zero_();  // bound later with set_weight; zeros rather than garbage until then
      }
      x.weights[b.id] = dev;
    }
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("uploading the weights failed: ") + e.what_without_backtrace());
  }
  return std::make_shared<Executor>(std::move(impl));
}

Result<std::shared_ptr<Executor>> Executor::load(const std::string& path, ExecutorOptions options) {
  auto p = Program::load(path);
  if (!p) return tl::unexpected(p.error());
  return create(std::move(*p), options);
}

Result<void> Executor::run(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, void* stream) {
  if (auto r = impl_->check_io(outputs, impl_->output_ids, "output"); !r) return r;
  std::vector<at::Tensor> given = outputs;
  return impl_->run(inputs, given, /*allocate=*/false, stream);
}

// `allocate`: `outputs` is filled with tensors of the run's own (see outputs_before), else it holds the
// caller's, which the run writes in place.
Result<void> Executor::Impl::run(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>& outputs, bool allocate,
                                 void* stream) {
  Impl& x = *this;
  if (auto r = x.check_io(inputs, x.input_ids, "input"); !r) return r;
  stream = x.resolve(stream);
  auto got = x.instance(stream);
  if (!got) return tl::unexpected(got.error());
  Instance& in = **got;
  std::lock_guard<std::mutex> lock(in.mu);
  try {
    c10::cuda::CUDAGuard device_guard(c10::DeviceIndex(x.device));
    c10::cuda::CUDAStreamGuard stream_guard(
        c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), c10::DeviceIndex(x.device)));
    if (!in.warmed || !*x.options.graphs) {
      // Eager: the caller's tensors are the program's inputs and outputs.
      for (std::size_t i = 0; i < inputs.size(); ++i) in.tensors[x.slot.at(x.input_ids[i])] = inputs[i];
      for (std::size_t i = 0; i < x.output_ids.size(); ++i)
        in.tensors[x.slot.at(x.output_ids[i])] = allocate ? at::Tensor() : outputs[i];
      auto ok = x.execute(in, stream, allocate);
      if (allocate && ok) {
        outputs.clear();
        for (BufferId id : x.output_ids) {
          at::Tensor& t = in.tensors[x.slot.at(id)];
          if (!t.defined()) {  // touched by no step (the validator requires a write; kept for safety)
            const TensorSpec& s = x.spec(id);
            t = at::empty_strided(s.shape, s.strides, x.options_for(s));
          }
          outputs.push_back(t);
        }
      }
      for (BufferId id : x.input_ids) in.tensors[x.slot.at(id)] = at::Tensor();
      for (BufferId id : x.output_ids) in.tensors[x.slot.at(id)] = at::Tensor();
      if (!ok) return ok;
      in.warmed = true;
      x.eager_runs++;
      x.runs++;
      return {};
    }
    if (!in.graph) {
      // Capture on a side stream ordered after the caller's work; captures are serialized process-wide
      // and thread-local, so other threads keep launching and replaying meanwhile.
      static std::mutex capture_mu;
      std::lock_guard<std::mutex> capture_lock(capture_mu);
      if (auto r = x.ensure_static(in); !r) return r;
      for (std::size_t i = 0; i < x.input_ids.size(); ++i) in.tensors[x.slot.at(x.input_ids[i])] = in.static_in[i];
      for (std::size_t i = 0; i < x.output_ids.size(); ++i) in.tensors[x.slot.at(x.output_ids[i])] = in.static_out[i];
      auto side = c10::cuda::getStreamFromPool(false, c10::DeviceIndex(x.device));
      side.synchronize();
      if (CUresult r = x.driver->StreamSynchronize(static_cast<CUstream>(stream)); r != CUDA_SUCCESS)
        return tl::unexpected(jit::detail::cuda_error(r, "waiting for the stream before capture"));
      auto graph = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/true);  // device replay instantiates it again
      Result<void> ok{};
      {
        c10::cuda::CUDAStreamGuard capture_guard(side);
        graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        ok = x.execute(in, side.stream());
        graph->capture_end();
      }
      if (!ok) return ok;
      graph->instantiate();
      in.graph = std::move(graph);
      x.captures++;
    }
    for (std::size_t i = 0; i < inputs.size(); ++i)
      if (auto r = x.copy(in.static_in[i], inputs[i], stream); !r) return r;
    const auto cuda_stream = static_cast<cudaStream_t>(stream);
    bool from_device = false;
    if (in.launcher) {
      if (cudaError_t e = cudaGraphLaunch(in.launcher, cuda_stream); e != cudaSuccess)
        return fail(ErrorCode::CudaError, std::string("launching the program's graph failed: ") + cudaGetErrorString(e));
      from_device = true;
    } else if (x.options.device_launch && !in.device_launch_tried) {
      in.device_launch_tried = true;
      std::string why = x.launch_from_device(in, cuda_stream);
      from_device = why.empty();
      if (!from_device) {
        std::lock_guard<std::mutex> lock(x.launcher_mu);
        if (x.host_replay_note.empty()) x.host_replay_note = std::move(why);
      }
    }
    if (from_device) x.device_launches++;
    else in.graph->replay();
    if (allocate) {  // as late as they can be: after the replay, just before the copies out
      outputs.clear();
      for (BufferId id : x.output_ids) {
        const TensorSpec& s = x.spec(id);
        outputs.push_back(at::empty_strided(s.shape, s.strides, x.options_for(s)));
      }
    }
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (auto r = x.copy(outputs[i], in.static_out[i], stream); !r) return r;
    x.replays++;
    x.runs++;
    return {};
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("running the program failed: ") + e.what_without_backtrace());
  }
}

Result<std::vector<at::Tensor>> Executor::run(const std::vector<at::Tensor>& inputs, void* stream) {
  std::vector<at::Tensor> outputs;
  if (auto r = impl_->run(inputs, outputs, /*allocate=*/true, stream); !r) return tl::unexpected(r.error());
  return outputs;
}

Result<void> Executor::run(const std::vector<const void*>& inputs, const std::vector<void*>& outputs, void* stream) {
  Impl& x = *impl_;
  auto wrap = [&](const void* ptr, BufferId id) {
    const TensorSpec& s = x.spec(id);
    return at::from_blob(const_cast<void*>(ptr), s.shape, s.strides, x.options_for(s));
  };
  if (inputs.size() != x.input_ids.size() || outputs.size() != x.output_ids.size())
    return fail(ErrorCode::InvalidArgument, "the program takes " + std::to_string(x.input_ids.size()) + " input(s) and " +
                                                std::to_string(x.output_ids.size()) + " output(s); got " +
                                                std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  std::vector<at::Tensor> in, out;
  try {
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i]) return fail(ErrorCode::InvalidArgument, "input " + std::to_string(i) + " is a null pointer");
      in.push_back(wrap(inputs[i], x.input_ids[i]));
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i]) return fail(ErrorCode::InvalidArgument, "output " + std::to_string(i) + " is a null pointer");
      out.push_back(wrap(outputs[i], x.output_ids[i]));
    }
  } catch (const c10::Error& e) {
    return fail(ErrorCode::InvalidArgument, std::string("wrapping the device pointers failed: ") + e.what_without_backtrace());
  }
  return run(in, out, stream);
}

Result<std::vector<at::Tensor>> Executor::static_inputs(void* stream) {
  auto in = impl_->instance(impl_->resolve(stream));
  if (!in) return tl::unexpected(in.error());
  std::lock_guard<std::mutex> lock((*in)->mu);
  if (auto r = impl_->ensure_static(**in); !r) return tl::unexpected(r.error());
  return (*in)->static_in;
}

Result<std::vector<at::Tensor>> Executor::static_outputs(void* stream) {
  auto in = impl_->instance(impl_->resolve(stream));
  if (!in) return tl::unexpected(in.error());
  std::lock_guard<std::mutex> lock((*in)->mu);
  if (auto r = impl_->ensure_static(**in); !r) return tl::unexpected(r.error());
  return (*in)->static_out;
}

Result<void> Executor::set_weight(BufferId weight, const at::Tensor& value) {
  auto it = impl_->weights.find(weight);
  if (it == impl_->weights.end())
    return fail(ErrorCode::InvalidArgument, "buffer " + std::to_string(weight) + " is not a weight of this program");
  if (impl_->shared.count(weight))
    return fail(ErrorCode::InvalidArgument, "weight " + std::to_string(weight) + " is read in place from the tensor shared "
                                            "at creation: write to that tensor instead (every run reads it)");
  const TensorSpec& s = impl_->spec(weight);
  if (value.sizes().vec() != s.shape || value.scalar_type() != scalar_type(s.dtype))
    return fail(ErrorCode::InvalidArgument, "weight " + std::to_string(weight) + " must be " + s.describe() + " but the value is " +
                                                describe(value));
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(impl_->device));
    it->second.copy_(value);  // in place: every instance and captured graph sees the new values
    c10::cuda::device_synchronize();
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("setting the weight failed: ") + e.what_without_backtrace());
  }
  return {};
}

Result<at::Tensor> Executor::state(BufferId id) const {
  auto it = impl_->states.find(id);
  if (it == impl_->states.end())
    return fail(ErrorCode::InvalidArgument, "buffer " + std::to_string(id) + " is not a state of this program (its "
                                            "states: " + std::to_string(impl_->states.size()) + ", see states())");
  return it->second;
}

std::vector<BufferId> Executor::states() const {
  std::vector<BufferId> ids;
  for (const auto& [id, t] : impl_->states) ids.push_back(id);
  return ids;
}

Result<void> Executor::reset_states() {
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(impl_->device));
    c10::cuda::device_synchronize();  // no run in flight still reads or writes them
    for (auto& [id, t] : impl_->states) t.zero_();
    c10::cuda::device_synchronize();
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("resetting the states failed: ") + e.what_without_backtrace());
  }
  return {};
}

Result<void> Executor::release() {
  std::lock_guard<std::mutex> lock(impl_->instances_mu);
  try {
    c10::cuda::CUDAGuard guard(c10::DeviceIndex(impl_->device));
    // The arena may have been allocated on another stream than the one its kernels ran on: nothing may
    // still read it when the caching allocator hands it out again.
    c10::cuda::device_synchronize();
    impl_->instances.clear();
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("releasing the program's buffers failed: ") + e.what_without_backtrace());
  }
  return {};
}

const Program& Executor::program() const { return impl_->program; }
const BufferPlan& Executor::plan() const { return impl_->plan; }
std::vector<BufferId> Executor::inputs() const { return impl_->input_ids; }
std::vector<BufferId> Executor::outputs() const { return impl_->output_ids; }
int Executor::device() const { return impl_->device; }
const std::vector<std::string>& Executor::warnings() const { return impl_->warnings; }

ExecutorStats Executor::stats() const {
  ExecutorStats s;
  s.runs = impl_->runs, s.eager_runs = impl_->eager_runs, s.replays = impl_->replays, s.captures = impl_->captures;
  s.copies_skipped = impl_->copies_skipped, s.device_launches = impl_->device_launches;
  {
    std::lock_guard<std::mutex> lock(impl_->launcher_mu);
    s.host_replay_note = impl_->host_replay_note;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->instances_mu);
    s.instances = impl_->instances.size();
    s.workspace_bytes = impl_->workspace_in_use;
  }
  s.arena_bytes = impl_->plan.arena_bytes;
  s.weight_bytes = impl_->weight_bytes, s.shared_weight_bytes = impl_->shared_weight_bytes;
  s.state_bytes = impl_->state_bytes, s.shared_state_bytes = impl_->shared_state_bytes;
  return s;
}

}  // namespace stitchcuda::torch
