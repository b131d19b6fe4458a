// Value types of the program layer: dtypes, tensor specs, op names, the graph IR and ProgramBuilder.
#include <stitchcuda/program.hpp>

#include <cctype>
#include <utility>

namespace stitchcuda::program {

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::boolean: return 1;
  }
  return 0;
}

const char* to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
  }
  return "?";
}

std::optional<DType> dtype_from_string(std::string_view name) noexcept {
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u8,
                  DType::boolean})
    if (name == to_string(d)) return d;
  return std::nullopt;
}

const char* to_string(BufferRole role) noexcept {
  switch (role) {
    case BufferRole::input: return "input";
    case BufferRole::output: return "output";
    case BufferRole::weight: return "weight";
    case BufferRole::intermediate: return "intermediate";
    case BufferRole::state: return "state";
  }
  return "?";
}

const char* to_string(ComputePrecision precision) noexcept {
  switch (precision) {
    case ComputePrecision::fp32: return "fp32";
    case ComputePrecision::tf32x3: return "tf32x3";
    case ComputePrecision::tf32: return "tf32";
    case ComputePrecision::bf16: return "bf16";
  }
  return "?";
}

const char* to_string(Epilogue epilogue) noexcept {
  switch (epilogue) {
    case Epilogue::none: return "none";
    case Epilogue::relu: return "relu";
    case Epilogue::gelu: return "gelu";
    case Epilogue::bias: return "bias";
    case Epilogue::bias_relu: return "bias_relu";
    case Epilogue::bias_gelu: return "bias_gelu";
  }
  return "?";
}

const char* to_string(Replay mode) noexcept {
  switch (mode) {
    case Replay::unmeasured: return "unmeasured";
    case Replay::graph: return "graph";
    case Replay::direct: return "direct";
  }
  return "?";
}

const char* to_string(ViewKind kind) noexcept {
  switch (kind) {
    case ViewKind::reshape: return "reshape";
    case ViewKind::permute: return "permute";
    case ViewKind::slice: return "slice";
  }
  return "?";
}

const char* step_kind(const Step& step) noexcept {
  static constexpr const char* kinds[] = {"kernel", "matmul", "aten", "view"};
  return kinds[step.index()];
}

TensorSpec TensorSpec::contiguous(std::vector<std::int64_t> shape, DType dtype) {
  TensorSpec spec;
  spec.strides.assign(shape.size(), 1);
  for (std::size_t i = shape.size(); i-- > 1;) spec.strides[i - 1] = spec.strides[i] * std::max<std::int64_t>(shape[i], 1);
  spec.shape = std::move(shape);
  spec.dtype = dtype;
  return spec;
}

std::int64_t TensorSpec::numel() const {
  std::int64_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

std::int64_t TensorSpec::storage_elements() const {
  std::int64_t span = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    span += (shape[i] - 1) * (i < strides.size() ? strides[i] : 0);
  }
  return span;
}

std::size_t TensorSpec::storage_bytes() const {
  return std::size_t(storage_elements()) * dtype_size(dtype);
}

bool TensorSpec::is_contiguous() const {
  return strides == contiguous(shape, dtype).strides;
}

namespace {
std::string join(const std::vector<std::int64_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}
}  // namespace

std::string TensorSpec::describe() const {
  std::string s = std::string(to_string(dtype)) + "[" + join(shape) + "]";
  if (!is_contiguous()) s += " strides [" + join(strides) + "]";
  return s;
}

bool is_well_formed_op_name(std::string_view op) {
  auto identifier = [](std::string_view s) {
    if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
    for (char c : s)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') return false;
    return true;
  };
  auto sep = op.find("::");
  if (sep == std::string_view::npos || !identifier(op.substr(0, sep))) return false;
  std::string_view rest = op.substr(sep + 2);
  auto dot = rest.find('.');
  if (dot == std::string_view::npos) return identifier(rest);
  return identifier(rest.substr(0, dot)) && identifier(rest.substr(dot + 1));
}

// ---- Graph ----

ValueId Graph::add_input(TensorSpec spec) {
  values_.push_back(Value{std::move(spec), ValueKind::input, {}, std::nullopt});
  return ValueId(values_.size() - 1);
}

ValueId Graph::add_constant(TensorSpec spec, std::string bytes) {
  values_.push_back(Value{std::move(spec), ValueKind::constant, std::move(bytes), std::nullopt});
  return ValueId(values_.size() - 1);
}

ValueId Graph::add_node(std::string op, std::vector<ValueId> inputs, Attributes attributes, TensorSpec output) {
  auto id = ValueId(values_.size());
  values_.push_back(Value{std::move(output), ValueKind::node, {}, nodes_.size()});
  nodes_.push_back(Node{std::move(op), std::move(inputs), std::move(attributes), id});
  return id;
}

void Graph::mark_output(ValueId value) { outputs_.push_back(value); }

Result<void> Graph::validate() const {
  for (std::size_t v = 0; v < values_.size(); ++v) {
    const Value& value = values_[v];
    if (value.spec.strides.size() != value.spec.shape.size())
      return fail(ErrorCode::InvalidArgument, "value " + std::to_string(v) + ": shape and strides have different ranks");
    if (value.kind == ValueKind::constant && value.constant_bytes.size() != value.spec.storage_bytes())
      return fail(ErrorCode::InvalidArgument,
                  "constant value " + std::to_string(v) + " holds " + std::to_string(value.constant_bytes.size()) +
                      " bytes but " + value.spec.describe() + " needs " + std::to_string(value.spec.storage_bytes()));
  }
  for (std::size_t n = 0; n < nodes_.size(); ++n) {
    const Node& node = nodes_[n];
    std::string where = "node " + std::to_string(n) + " (" + node.op + ")";
    if (!is_well_formed_op_name(node.op))
      return fail(ErrorCode::InvalidArgument,
                  where + ": malformed op name; expected \"namespace::name\" or \"namespace::name.overload\"");
    for (ValueId in : node.inputs)
      if (in >= node.output)
        return fail(ErrorCode::InvalidArgument,
                    where + ": input value " + std::to_string(in) + " is not defined before the node");
  }
  for (ValueId out : outputs_)
    if (out >= values_.size())
      return fail(ErrorCode::InvalidArgument, "graph output " + std::to_string(out) + " is not a value of the graph");
  return {};
}

// ---- Program / ProgramBuilder ----

const Buffer* Program::buffer(BufferId id) const {
  // Builders number buffers densely, so the index is the usual home of an id.
  if (id < buffers.size() && buffers[id].id == id) return &buffers[id];
  for (const Buffer& b : buffers)
    if (b.id == id) return &b;
  return nullptr;
}

const Placement* BufferPlan::find(BufferId buffer) const {
  for (const Placement& p : placements)
    if (p.buffer == buffer) return &p;
  return nullptr;
}

BufferId ProgramBuilder::add(TensorSpec spec, BufferRole role, std::string name) {
  BufferId id = next_id_++;
  program_.buffers.push_back(Buffer{id, std::move(spec), role, std::move(name)});
  return id;
}

BufferId ProgramBuilder::input(TensorSpec spec, std::string name) {
  return add(std::move(spec), BufferRole::input, std::move(name));
}
BufferId ProgramBuilder::output(TensorSpec spec, std::string name) {
  return add(std::move(spec), BufferRole::output, std::move(name));
}
BufferId ProgramBuilder::weight(TensorSpec spec, std::string bytes, std::string name) {
  BufferId id = add(std::move(spec), BufferRole::weight, std::move(name));
  if (!bytes.empty()) program_.weights[id] = std::move(bytes);
  return id;
}
BufferId ProgramBuilder::intermediate(TensorSpec spec, std::string name) {
  return add(std::move(spec), BufferRole::intermediate, std::move(name));
}
BufferId ProgramBuilder::state(TensorSpec spec, std::string name) {
  return add(std::move(spec), BufferRole::state, std::move(name));
}

std::uint32_t ProgramBuilder::kernel(KernelSource kernel) {
  program_.kernels.push_back(std::move(kernel));
  return std::uint32_t(program_.kernels.size() - 1);
}

ProgramBuilder& ProgramBuilder::launch(KernelLaunch launch) {
  program_.steps.emplace_back(std::move(launch));
  return *this;
}
ProgramBuilder& ProgramBuilder::matmul(Matmul matmul) {
  program_.steps.emplace_back(std::move(matmul));
  return *this;
}
ProgramBuilder& ProgramBuilder::aten(std::string op, std::vector<BufferId> inputs, std::vector<BufferId> outputs,
                                     Attributes attributes) {
  program_.steps.emplace_back(AtenOp{std::move(op), std::move(inputs), std::move(attributes), std::move(outputs)});
  return *this;
}
BufferId ProgramBuilder::view(ViewKind kind, BufferId source, TensorSpec spec, std::int64_t storage_offset) {
  BufferId result = add(std::move(spec), BufferRole::intermediate, {});
  program_.steps.emplace_back(View{kind, source, result, storage_offset});
  return result;
}
ProgramBuilder& ProgramBuilder::precision(PrecisionPolicy policy) {
  program_.precision = policy;
  return *this;
}
ProgramBuilder& ProgramBuilder::verified_on(HardwareInfo hardware) {
  program_.verified_on = std::move(hardware);
  return *this;
}

Result<Program> ProgramBuilder::build() {
  Program built = std::move(program_);
  program_ = Program{};
  next_id_ = 0;
  if (auto ok = built.validate(); !ok) return tl::unexpected(ok.error());
  return built;
}

}  // namespace stitchcuda::program
