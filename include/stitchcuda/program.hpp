// stitchcuda::program — the stitched program as data: graph IR, buffers, steps, validation,
// liveness planning and the `.stitch` artifact. No CUDA or LibTorch header: this layer is pure data.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <stitchcuda/error.hpp>

namespace stitchcuda::program {

/// Element type of a tensor.
enum class DType : std::uint8_t { f32, f16, bf16, f64, i32, i64, u8, boolean };

/// Bytes per element.
std::size_t dtype_size(DType dtype) noexcept;
/// Stable name: "f32", "f16", "bf16", "f64", "i32", "i64", "u8", "bool".
const char* to_string(DType dtype) noexcept;
/// The dtype called `name` (as to_string writes it), or nothing.
std::optional<DType> dtype_from_string(std::string_view name) noexcept;

/// Shape, strides (in elements) and dtype of a tensor.
struct TensorSpec {
  std::vector<std::int64_t> shape;    ///< extents, outermost first
  std::vector<std::int64_t> strides;  ///< elements between neighbours along each dimension
  DType dtype = DType::f32;           ///< element type

  /// A row-major contiguous tensor.
  static TensorSpec contiguous(std::vector<std::int64_t> shape, DType dtype = DType::f32);
  /// Product of the extents (1 for a scalar).
  std::int64_t numel() const;
  /// Elements of storage the tensor spans: 1 + sum((extent - 1) * stride); 0 when empty.
  std::int64_t storage_elements() const;
  /// storage_elements() * dtype_size(dtype).
  std::size_t storage_bytes() const;
  /// Whether the strides are row-major contiguous for the shape.
  bool is_contiguous() const;
  /// "f32[2, 3]" (strides are added when not contiguous).
  std::string describe() const;
  bool operator==(const TensorSpec&) const = default;
};

/// One attribute value of an op: int, double, bool, string, int list or double list.
using Attribute = std::variant<std::int64_t, double, bool, std::string, std::vector<std::int64_t>,
                               std::vector<double>>;
/// Attributes by name (ordered, so serialization is deterministic).
using Attributes = std::map<std::string, Attribute>;

/// Whether `op` reads "namespace::name" or "namespace::name.overload" (identifiers only).
/// Whether such an op exists needs the ATen dispatcher: the torch layer checks that when it binds ops.
bool is_well_formed_op_name(std::string_view op);

/// Index of a value in a Graph: its inputs, constants and node outputs, in creation order.
using ValueId = std::uint32_t;

/// An ATen-level dataflow graph, as capture produces it before planning turns it into a Program.
class Graph {
 public:
  /// What produces a value.
  enum class ValueKind { input, constant, node };
  /// A value: its spec and what produces it.
  struct Value {
    TensorSpec spec;            ///< shape, strides, dtype
    ValueKind kind = ValueKind::input;  ///< producer
    std::string constant_bytes; ///< raw data of a constant
    std::optional<std::size_t> node;    ///< producing node, for kind == node
  };
  /// One ATen op applied to earlier values.
  struct Node {
    std::string op;               ///< "aten::add.Tensor"
    std::vector<ValueId> inputs;  ///< earlier values
    Attributes attributes;        ///< non-tensor arguments
    ValueId output = 0;           ///< the value it produces
  };

  /// Adds a graph input.
  ValueId add_input(TensorSpec spec);
  /// Adds a constant holding `bytes` (its size must match the spec's storage).
  ValueId add_constant(TensorSpec spec, std::string bytes);
  /// Adds a node; its output spec is given by the caller (capture knows it).
  ValueId add_node(std::string op, std::vector<ValueId> inputs, Attributes attributes, TensorSpec output);
  /// Marks a value as a graph output.
  void mark_output(ValueId value);

  /// Op names, input ids (defined earlier), constant sizes and outputs; the first problem names the node.
  Result<void> validate() const;

  const std::vector<Value>& values() const { return values_; }    ///< every value
  const std::vector<Node>& nodes() const { return nodes_; }       ///< nodes in order
  const std::vector<ValueId>& outputs() const { return outputs_; }///< graph outputs

 private:
  std::vector<Value> values_;
  std::vector<Node> nodes_;
  std::vector<ValueId> outputs_;
};

/// Identifier of a buffer in a Program.
using BufferId = std::uint32_t;

/// Who owns a buffer's memory.
enum class BufferRole : std::uint8_t {
  input,         ///< bound by the caller at run time
  output,        ///< bound by the caller at run time, written by the program
  weight,        ///< constant data stored in the artifact
  intermediate,  ///< placed in the arena by liveness planning
  /// Read and updated in place across runs (a KV cache): the executor binds it at creation (the caller's
  /// tensor, or its own zero-filled one) and keeps its address for its life. Steps may read it before any
  /// step writes it (it holds the previous runs' values) and write it in place; it is never an output, and
  /// the artifact records its spec only (a loaded program starts with zeros).
  state,
};
/// "input", "output", "weight", "intermediate", "state".
const char* to_string(BufferRole role) noexcept;

/// A tensor the program reads or writes.
struct Buffer {
  BufferId id = 0;                   ///< unique in its program
  TensorSpec spec;                   ///< shape, strides, dtype
  BufferRole role = BufferRole::intermediate;  ///< who owns its memory
  std::string name;                  ///< optional, for messages and bindings
};

/// Matmul precision, from exact to fastest; a program's policy caps what its steps may use.
/// tf32x3: fp32 operands split into a TF32 part and its remainder, multiplied as three TF32 tensor-core
/// products (hi*hi + hi*lo + lo*hi, the hi*hi product summed in chunks of at most 512 along K with
/// round-to-nearest fp32 additions): about fp32's accuracy at tensor-core speed, fp32 operands only.
enum class ComputePrecision : std::uint8_t { fp32, tf32x3, tf32, bf16 };
/// "fp32", "tf32x3", "tf32", "bf16".
const char* to_string(ComputePrecision precision) noexcept;

/// cuBLASLt epilogue fused into a matmul.
enum class Epilogue : std::uint8_t { none, relu, gelu, bias, bias_relu, bias_gelu };
/// "none", "relu", "gelu", "bias", "bias_relu", "bias_gelu".
const char* to_string(Epilogue epilogue) noexcept;

/// A kernel of the program: source to recompile, and machine code for the architecture it was built for.
struct KernelSource {
  std::string source;                ///< CUDA C++ source
  std::string name;                  ///< entry point (extern "C" name or name expression)
  std::vector<std::string> options;  ///< NVRTC options that matter for recompiling ("--use_fast_math")
  std::string cubin;                 ///< machine code (may be empty: compile from source)
  std::string arch;                  ///< architecture of cubin, e.g. "sm_90a"
  std::vector<std::string> signature;  ///< declared parameter types ("const float*", "int"); empty: unknown
};

/// How a kernel touches a buffer argument.
enum class Access : std::uint8_t { read, write, read_write };

/// A buffer passed to a kernel as a device pointer.
struct BufferArg {
  BufferId buffer = 0;          ///< the buffer
  Access access = Access::read; ///< what the kernel does with it
  bool operator==(const BufferArg&) const = default;
};
/// One kernel argument: a buffer or a scalar of the kernel's parameter type.
using KernelArg = std::variant<BufferArg, std::int32_t, std::int64_t, float, double>;

/// Launch of a kernel from the program's kernel table; the configuration was computed at build time.
struct KernelLaunch {
  std::uint32_t kernel = 0;                   ///< index into Program::kernels
  std::array<std::uint32_t, 3> grid{1, 1, 1}; ///< blocks
  std::array<std::uint32_t, 3> block{1, 1, 1};///< threads per block
  std::uint32_t shared_mem_bytes = 0;         ///< dynamic shared memory
  std::vector<KernelArg> args;                ///< in declaration order
};

/// A cuBLASLt matmul: c = epilogue(alpha * op(a) @ op(b) + beta * c [+ bias]), batched over leading dims.
struct Matmul {
  BufferId a = 0, b = 0, c = 0;       ///< operands [batch..., rows, cols]; c is the result
  std::optional<BufferId> bias;       ///< [n], for the bias epilogues
  bool transpose_a = false;           ///< use a's last two dims transposed
  bool transpose_b = false;           ///< use b's last two dims transposed
  std::int64_t batch = 1;             ///< product of c's leading dims
  double alpha = 1.0;                 ///< scale of the product
  double beta = 0.0;                  ///< scale of c's previous contents (non-zero reads c)
  Epilogue epilogue = Epilogue::none; ///< fused epilogue
  ComputePrecision precision = ComputePrecision::fp32;  ///< must be allowed by the program's policy
};

/// Any ATen op by name and overload, for everything not generated.
struct AtenOp {
  std::string op;                 ///< "aten::add.Tensor"
  std::vector<BufferId> inputs;   ///< tensor arguments, in schema order
  Attributes attributes;          ///< non-tensor arguments by schema name
  std::vector<BufferId> outputs;  ///< results, written by the op
};

/// What kind of view a View step takes.
enum class ViewKind : std::uint8_t { reshape, permute, slice };
/// "reshape", "permute", "slice".
const char* to_string(ViewKind kind) noexcept;

/// A view of one buffer as another buffer id, without a copy; the result buffer's spec is the view's.
struct View {
  ViewKind kind = ViewKind::reshape;  ///< how the view was taken
  BufferId source = 0;                ///< viewed buffer
  BufferId result = 0;                ///< intermediate buffer that aliases source's storage
  std::int64_t storage_offset = 0;    ///< elements from source's first element
};

/// One step of a program, run in order.
using Step = std::variant<KernelLaunch, Matmul, AtenOp, View>;
/// "kernel", "matmul", "aten", "view".
const char* step_kind(const Step& step) noexcept;

/// What the program's matmuls may trade for speed (PyTorch's defaults: fp32 matmuls, TF32 convolutions).
struct PrecisionPolicy {
  ComputePrecision matmul = ComputePrecision::fp32;  ///< the lossiest precision a Matmul may use
  bool cudnn_tf32 = true;                            ///< convolutions through cuDNN may use TF32
  bool operator==(const PrecisionPolicy&) const = default;
};

/// The machine a program was verified on (empty fields: not verified).
struct HardwareInfo {
  std::string device;      ///< "NVIDIA H200"
  std::string arch;        ///< "sm_90a"
  std::string driver;      ///< driver version, "13000"
  std::string cuda;        ///< CUDA toolkit/runtime version, "13.0"
  std::string torch;       ///< torch version, when torch was present
  bool operator==(const HardwareInfo&) const = default;
};

/// Where liveness planning put one buffer.
struct Placement {
  BufferId buffer = 0;     ///< the buffer (views included)
  BufferId storage = 0;    ///< the buffer owning the storage (itself unless a view)
  std::size_t offset = 0;  ///< bytes from the arena's start
  std::size_t bytes = 0;   ///< storage the buffer spans
  int first_step = 0;      ///< first step that writes its storage
  int last_step = 0;       ///< last step that touches its storage
  /// false: the storage takes no arena bytes (offset is 0) and lives only from first_step to last_step
  /// in PyTorch's caching allocator, as in eager mode: an ATen step writes it first and the tensor that op
  /// returns becomes it (the executor adopts it), or it is large (BufferPlan::large_storage_bytes) and
  /// the executor allocates it before first_step (`allocated`). Either way it is let go after last_step.
  bool in_arena = true;
  bool allocated = false;  ///< outside the arena and allocated by the executor (not an ATen step's result)
};

/// Arena layout of a program's intermediate buffers. Storages an ATen step writes first are not in
/// the arena (Placement::in_arena): the op allocates its result through PyTorch's caching allocator, as
/// in eager mode, and the executor lets it go after its last use. Nor are storages of large_storage_bytes
/// or more: one arena is as large as the widest step's arena storages for the whole run, while the ATen
/// results come and go beside it, so a convolution stack's peak would be its arena plus its widest ATen
/// step rather than its widest step (the executor allocates those before their first step, one
/// allocator call for megabytes of traffic). The byte counts below cover the arena's storages only.
struct BufferPlan {
  static constexpr std::size_t alignment = 256;  ///< every storage starts at a multiple of this
  static constexpr std::size_t large_storage_bytes = std::size_t(32) << 20;  ///< and larger: outside the arena
  std::vector<Placement> placements;  ///< every intermediate buffer, views included
  std::size_t arena_bytes = 0;        ///< peak: size of the one arena
  std::size_t live_bound_bytes = 0;   ///< sum of live arena storages (aligned) at the widest step
  int widest_step = -1;               ///< the step where that sum peaks (-1: no arena storages)
  std::size_t unshared_bytes = 0;     ///< what the arena would need without any reuse

  /// The placement of `buffer`, or null when it is not in the arena.
  const Placement* find(BufferId buffer) const;
};

/// How a program ran fastest on the machine that built it, both ways timed on its example inputs:
/// replayed as one CUDA graph (saves host time per launch, copies inputs and outputs through the graph's
/// own buffers) or launched step by step. An Executor follows it unless told otherwise.
enum class Replay : std::uint8_t {
  unmeasured,  ///< nobody timed it: replay as a graph
  graph,
  direct,
};
/// "unmeasured", "graph", "direct".
const char* to_string(Replay mode) noexcept;
struct ReplayChoice {
  Replay mode = Replay::unmeasured;
  std::string reason;  ///< the measurement, e.g. "CUDA graph replay 0.106 ms, direct launches 0.037 ms per call"
  bool operator==(const ReplayChoice&) const = default;
};

/// A stitched program: buffers, a kernel table, steps in order, weights, precision and provenance.
/// Build one with ProgramBuilder, or load one from a `.stitch` artifact.
struct Program {
  std::vector<Buffer> buffers;                 ///< every buffer, unique ids
  std::vector<KernelSource> kernels;           ///< kernel table for KernelLaunch steps
  std::vector<Step> steps;                     ///< run in order
  std::map<BufferId, std::string> weights;     ///< raw bytes of weight buffers (may be bound later)
  PrecisionPolicy precision;                   ///< what matmuls may use
  HardwareInfo verified_on;                    ///< where it was verified
  ReplayChoice replay;                         ///< graph replay or direct launches, as measured there

  /// The buffer with this id, or null.
  const Buffer* buffer(BufferId id) const;
  /// Checks ids, write-before-read order, shapes and dtypes, aliasing, op names and outputs.
  /// The error's message names the first problem (step index and kind); its log lists them all.
  Result<void> validate() const;
  /// Liveness planning of the intermediate buffers into one arena (validates first).
  Result<BufferPlan> plan() const;

  /// The `.stitch` bytes (see docs/program.md for the layout).
  std::string serialize() const;
  /// Reads `.stitch` bytes: magic, version, bounds, checksums, manifest fields, then validate().
  static Result<Program> deserialize(std::string_view bytes);
  /// Writes the artifact atomically (a temporary file in the same folder, then renamed).
  Result<void> save(const std::string& path) const;
  /// Reads and checks an artifact written by save.
  static Result<Program> load(const std::string& path);
};

/// `.stitch` container format version written by this library.
inline constexpr std::uint32_t kArtifactVersion = 1;

/// Assembles a Program step by step; build() validates it.
class ProgramBuilder {
 public:
  /// Adds a caller-bound input.
  BufferId input(TensorSpec spec, std::string name = {});
  /// Adds a caller-bound output.
  BufferId output(TensorSpec spec, std::string name = {});
  /// Adds a weight; `bytes` may be empty when bound later, else must match the spec's storage.
  BufferId weight(TensorSpec spec, std::string bytes = {}, std::string name = {});
  /// Adds an intermediate buffer for the arena.
  BufferId intermediate(TensorSpec spec, std::string name = {});
  /// Adds a state: a tensor the program reads and updates in place across runs (BufferRole::state).
  BufferId state(TensorSpec spec, std::string name = {});
  /// Adds a kernel to the table; returns its index.
  std::uint32_t kernel(KernelSource kernel);

  /// Appends a kernel launch.
  ProgramBuilder& launch(KernelLaunch launch);
  /// Appends a matmul.
  ProgramBuilder& matmul(Matmul matmul);
  /// Appends an ATen op.
  ProgramBuilder& aten(std::string op, std::vector<BufferId> inputs, std::vector<BufferId> outputs,
                       Attributes attributes = {});
  /// Appends a view of `source` with `spec` as a new intermediate buffer; returns that buffer.
  BufferId view(ViewKind kind, BufferId source, TensorSpec spec, std::int64_t storage_offset = 0);
  /// Sets the precision policy.
  ProgramBuilder& precision(PrecisionPolicy policy);
  /// Records the hardware the program was verified on.
  ProgramBuilder& verified_on(HardwareInfo hardware);

  /// The program so far, unchecked (for tests of validation and for tools).
  const Program& peek() const { return program_; }
  /// The validated program (the builder is left empty).
  Result<Program> build();

 private:
  BufferId add(TensorSpec spec, BufferRole role, std::string name);
  Program program_;
  BufferId next_id_ = 0;
};

/// Compiles every kernel of `program` whose CUBIN is missing or built for another architecture, and
/// records the CUBIN, its architecture and the declared signature, so the saved artifact loads without
/// NVRTC on a machine of that architecture. `arch` empty: the current device's (else sm_90a).
Result<void> compile_kernels(Program& program, const std::string& arch = {});

}  // namespace stitchcuda::program
