// Program::validate: every check that needs no GPU and no dispatcher — ids, write-before-read order,
// shapes and dtypes, aliasing, kernel signatures, op names, precision and outputs.
#include <stitchcuda/program.hpp>

#include <set>
#include <unordered_map>

#include <stitchcuda/detail/step_access.hpp>

namespace stitchcuda::program {
namespace {

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The dtype a kernel's pointer parameter points to ("const float*" -> f32); nothing for void* and
// types this check does not know (it then stays silent rather than guess).
std::optional<DType> pointee_dtype(std::string type) {
  if (auto c = type.find("const "); c == 0) type = type.substr(6);
  while (!type.empty() && (type.back() == '*' || type.back() == ' ')) type.pop_back();
  static const std::map<std::string, DType> known = {
      {"float", DType::f32},          {"double", DType::f64},    {"half", DType::f16},
      {"__half", DType::f16},         {"__nv_bfloat16", DType::bf16}, {"nv_bfloat16", DType::bf16},
      {"int", DType::i32},            {"int32_t", DType::i32},   {"long long", DType::i64},
      {"int64_t", DType::i64},        {"unsigned char", DType::u8}, {"uint8_t", DType::u8},
      {"bool", DType::boolean}};
  auto it = known.find(type);
  if (it == known.end()) return std::nullopt;
  return it->second;
}

// Which KernelArg alternative a scalar parameter type wants (variant index), or nothing if unknown.
std::optional<std::size_t> scalar_index(const std::string& type) {
  static const std::map<std::string, std::size_t> known = {
      {"int", 1}, {"int32_t", 1}, {"unsigned", 1}, {"unsigned int", 1}, {"uint32_t", 1},
      {"long long", 2}, {"int64_t", 2}, {"long", 2}, {"size_t", 2}, {"uint64_t", 2},
      {"float", 3}, {"double", 4}};
  std::string t = type.rfind("const ", 0) == 0 ? type.substr(6) : type;
  auto it = known.find(t);
  if (it == known.end()) return std::nullopt;
  return it->second;
}

const char* scalar_name(std::size_t index) {
  static constexpr const char* names[] = {"buffer", "i32", "i64", "f32", "f64"};
  return names[index];
}

bool is_floating(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::f64; }

bool uses_bias(Epilogue e) { return e == Epilogue::bias || e == Epilogue::bias_relu || e == Epilogue::bias_gelu; }

class Checker {
 public:
  explicit Checker(const Program& p) : p_(p) {}

  std::vector<std::string> run() {
    // Step checks do arithmetic on shapes; with a malformed spec they would only add noise (or overflow).
    if (!check_buffers()) return std::move(problems_);
    check_kernels();
    for (std::size_t i = 0; i < p_.steps.size(); ++i) check_step(int(i), p_.steps[i]);
    for (const Buffer& b : p_.buffers)
      if (b.role == BufferRole::output && !ever_written_.count(b.id))
        problems_.push_back("output buffer " + label(b.id) + " is never written by any step");
    return std::move(problems_);
  }

 private:
  std::string label(BufferId id) const {
    auto it = by_id_.find(id);
    std::string s = "#" + std::to_string(id);
    if (it != by_id_.end() && !it->second->name.empty()) s = "'" + it->second->name + "' (" + s + ")";
    return s;
  }
  const Buffer& buf(BufferId id) const { return *by_id_.at(id); }
  BufferId root(BufferId id) const {
    auto it = view_source_.find(id);
    return it == view_source_.end() ? id : root(it->second);
  }
  // Bytes from the start of the root storage to a view's first element.
  std::int64_t byte_offset(BufferId id) const {
    auto it = view_source_.find(id);
    if (it == view_source_.end()) return 0;
    return byte_offset(it->second) + view_offset_.at(id) * std::int64_t(dtype_size(buf(id).spec.dtype));
  }
  // Whether two buffers' byte ranges in one storage intersect (conservative for strided views).
  bool overlap(BufferId a, BufferId b) const {
    if (root(a) != root(b)) return false;
    std::int64_t a0 = byte_offset(a), a1 = a0 + std::int64_t(buf(a).spec.storage_bytes());
    std::int64_t b0 = byte_offset(b), b1 = b0 + std::int64_t(buf(b).spec.storage_bytes());
    return a0 < b1 && b0 < a1;
  }

  // False when some spec is unusable for arithmetic (rank mismatch, negative or oversized extents).
  bool check_buffers() {
    bool usable = true;
    for (const Buffer& b : p_.buffers) {
      if (!by_id_.emplace(b.id, &b).second) {
        problems_.push_back("buffer id " + std::to_string(b.id) + " is used by two buffers");
        continue;
      }
      const TensorSpec& s = b.spec;
      std::string where = std::string(to_string(b.role)) + " buffer " + label(b.id);
      if (s.strides.size() != s.shape.size()) {
        problems_.push_back(where + ": shape " + shape_text(s.shape) + " and strides " + shape_text(s.strides) +
                            " have different ranks");
        usable = false;
        continue;
      }
      // Extents and strides stay below 2^40 elements each and the spans below 2^48 bytes, so no
      // later product or sum of them can overflow.
      constexpr std::int64_t kMax = std::int64_t(1) << 40;
      std::int64_t span = 1, count = 1;
      bool sane = true;
      for (std::size_t d = 0; d < s.shape.size() && sane; ++d) {
        sane = s.shape[d] >= 0 && s.shape[d] < kMax && s.strides[d] >= 0 && s.strides[d] < kMax;
        if (sane && s.shape[d] > 0) {
          span += (s.shape[d] - 1) * s.strides[d];
          count *= s.shape[d];
          sane = span < kMax * 256 && count < kMax * 256;
        }
      }
      if (!sane) {
        problems_.push_back(where + ": shape " + shape_text(s.shape) + " with strides " + shape_text(s.strides) +
                            " has a negative or implausibly large extent or stride");
        usable = false;
        continue;
      }
      // A state holds the previous runs' values (zeros before the first): readable from the first step.
      if (b.role == BufferRole::input || b.role == BufferRole::weight || b.role == BufferRole::state) {
        written_.insert(b.id);
        ever_written_.insert(b.id);
      }
      if (b.role == BufferRole::state && s.numel() == 0)
        problems_.push_back(where + " is empty: a state holds values between runs (give it at least one element)");
    }
    for (const auto& [id, bytes] : p_.weights) {
      auto it = by_id_.find(id);
      if (it == by_id_.end() || it->second->role != BufferRole::weight)
        problems_.push_back("weight data is given for " + label(id) + ", which is not a weight buffer");
      else if (usable && bytes.size() != it->second->spec.storage_bytes())
        problems_.push_back("weight buffer " + label(id) + " holds " + std::to_string(bytes.size()) + " bytes but " +
                            it->second->spec.describe() + " needs " + std::to_string(it->second->spec.storage_bytes()));
    }
    return usable;
  }

  void check_kernels() {
    for (std::size_t k = 0; k < p_.kernels.size(); ++k) {
      const KernelSource& ks = p_.kernels[k];
      if (ks.name.empty()) problems_.push_back("kernel " + std::to_string(k) + " has no entry point name");
      if (ks.source.empty() && ks.cubin.empty())
        problems_.push_back("kernel " + std::to_string(k) + " ('" + ks.name + "') has neither source nor cubin");
      if (!ks.cubin.empty() && ks.arch.empty())
        problems_.push_back("kernel " + std::to_string(k) + " ('" + ks.name + "') has a cubin but no architecture");
    }
  }

  void check_step(int index, const Step& step) {
    std::string where = "step " + std::to_string(index) + " (" + step_kind(step) + ")";
    auto report = [&](const std::string& what) { problems_.push_back(where + ": " + what); };
    detail::StepAccess acc = detail::access_of(step);

    bool dangling = false;
    for (auto* list : {&acc.reads, &acc.writes})
      for (BufferId id : *list)
        if (!by_id_.count(id)) {
          report("buffer #" + std::to_string(id) + " does not exist");
          dangling = true;
        }
    if (dangling) return;  // shape checks would only repeat the same problem

    for (BufferId r : acc.reads)
      if (!written_.count(r))
        report("reads " + std::string(to_string(buf(r).role)) + " buffer " + label(r) +
               " before any step writes it");
    for (BufferId w : acc.writes) {
      BufferRole role = buf(root(w)).role;
      if (role == BufferRole::input || role == BufferRole::weight)
        report("writes " + label(w) + ", whose storage is " + to_string(role) + " buffer " + label(root(w)) +
               ": inputs and weights are read-only");
    }
    // Aliasing: two different buffers over overlapping bytes of one storage, one of them written by
    // the step, race (the step reads values it is overwriting, or two results clobber each other).
    for (BufferId w : acc.writes) {
      for (BufferId r : acc.reads)
        if (r != w && overlap(r, w))
          report("writes " + label(w) + " while reading " + label(r) + ", which shares its storage (a view): "
                 "the step would read values it is overwriting");
    }
    for (std::size_t i = 0; i < acc.writes.size(); ++i)
      for (std::size_t j = i + 1; j < acc.writes.size(); ++j)
        if (acc.writes[i] == acc.writes[j] || overlap(acc.writes[i], acc.writes[j]))
          report("two outputs alias: " + label(acc.writes[i]) + " and " + label(acc.writes[j]) +
                 " share storage");

    std::visit([&](const auto& s) { check(s, report); }, step);

    for (BufferId w : acc.writes) {
      written_.insert(w);
      ever_written_.insert(w);
      ever_written_.insert(root(w));
    }
  }

  template <class Report>
  void check(const KernelLaunch& k, Report& report) {
    if (k.kernel >= p_.kernels.size()) {
      report("kernel index " + std::to_string(k.kernel) + " is outside the kernel table (" +
             std::to_string(p_.kernels.size()) + " kernels)");
      return;
    }
    const KernelSource& ks = p_.kernels[k.kernel];
    if (k.grid[0] == 0 || k.grid[1] == 0 || k.grid[2] == 0 || k.block[0] == 0 || k.block[1] == 0 || k.block[2] == 0)
      report("grid and block extents must be at least 1");
    if (std::uint64_t(k.block[0]) * k.block[1] * k.block[2] > 1024)
      report("block has more than 1024 threads");
    if (ks.signature.empty()) return;
    if (k.args.size() != ks.signature.size()) {
      report("kernel '" + ks.name + "' declares " + std::to_string(ks.signature.size()) + " parameters but " +
             std::to_string(k.args.size()) + " arguments are bound");
      return;
    }
    for (std::size_t i = 0; i < k.args.size(); ++i) {
      const std::string& type = ks.signature[i];
      std::string param = "argument " + std::to_string(i) + " of '" + ks.name + "' (" + type + ")";
      bool pointer = type.find('*') != std::string::npos;
      const BufferArg* b = std::get_if<BufferArg>(&k.args[i]);
      if (pointer != (b != nullptr)) {
        report(param + (pointer ? " wants a buffer but is bound to a scalar" : " wants a scalar but is bound to a buffer"));
        continue;
      }
      if (b) {
        auto want = pointee_dtype(type);
        DType have = buf(b->buffer).spec.dtype;
        if (want && *want != have)
          report(param + " points to " + to_string(*want) + " but " + label(b->buffer) + " is " + to_string(have));
        if (type.rfind("const ", 0) == 0 && b->access != Access::read)
          report(param + " is const but the step says the kernel writes " + label(b->buffer));
      } else if (auto want = scalar_index(type); want && *want != k.args[i].index()) {
        report(param + " wants " + scalar_name(*want) + " but is bound to " + scalar_name(k.args[i].index()));
      }
    }
  }

  template <class Report>
  void check(const Matmul& m, Report& report) {
    const TensorSpec &a = buf(m.a).spec, &b = buf(m.b).spec, &c = buf(m.c).spec;
    if (a.shape.size() < 2 || b.shape.size() < 2 || c.shape.size() < 2) {
      report("a, b and c need at least two dimensions (a is " + a.describe() + ", b is " + b.describe() +
             ", c is " + c.describe() + ")");
      return;
    }
    if (!is_floating(a.dtype) || a.dtype != b.dtype)
      report("a and b must share one floating dtype (a is " + a.describe() + ", b is " + b.describe() + ")");
    if (c.dtype != a.dtype && c.dtype != DType::f32)
      report("c must be " + std::string(to_string(a.dtype)) + " or f32, not " + to_string(c.dtype));
    auto last2 = [](const TensorSpec& s, bool t) {
      std::int64_t r = s.shape[s.shape.size() - 2], q = s.shape.back();
      return t ? std::pair{q, r} : std::pair{r, q};
    };
    auto [m_rows, k_a] = last2(a, m.transpose_a);
    auto [k_b, n_cols] = last2(b, m.transpose_b);
    if (k_a != k_b)
      report("inner dimensions differ: a" + std::string(m.transpose_a ? " (transposed)" : "") + " is " +
             shape_text(a.shape) + " (k = " + std::to_string(k_a) + "), b" + (m.transpose_b ? " (transposed)" : "") +
             " is " + shape_text(b.shape) + " (k = " + std::to_string(k_b) + ")");
    if (c.shape[c.shape.size() - 2] != m_rows || c.shape.back() != n_cols)
      report("c is " + shape_text(c.shape) + " but the product is [" + std::to_string(m_rows) + ", " +
             std::to_string(n_cols) + "]");
    auto leading = [](const TensorSpec& s) { return s.numel() / std::max<std::int64_t>(1, s.shape[s.shape.size() - 2] * s.shape.back()); };
    if (m.batch < 1) report("batch count must be at least 1");
    if (leading(c) != m.batch)
      report("batch count is " + std::to_string(m.batch) + " but c's leading dimensions hold " + std::to_string(leading(c)));
    for (auto [name, spec] : {std::pair{"a", &a}, std::pair{"b", &b}})
      if (leading(*spec) != 1 && leading(*spec) != m.batch)
        report(std::string(name) + "'s leading dimensions hold " + std::to_string(leading(*spec)) +
               " matrices; expected 1 (broadcast) or the batch count " + std::to_string(m.batch));
    if (uses_bias(m.epilogue) != m.bias.has_value())
      report(m.bias ? "a bias buffer is given but the epilogue '" + std::string(to_string(m.epilogue)) + "' adds none"
                    : "epilogue '" + std::string(to_string(m.epilogue)) + "' needs a bias buffer");
    if (m.bias) {
      const TensorSpec& bias = buf(*m.bias).spec;
      if (bias.numel() != n_cols || bias.dtype != c.dtype)
        report("bias is " + bias.describe() + " but must hold n = " + std::to_string(n_cols) + " elements of " +
               to_string(c.dtype));
    }
    if (m.precision == ComputePrecision::tf32x3 && (a.dtype != DType::f32 || c.dtype != DType::f32))
      report("tf32x3 splits fp32 operands into TF32 parts: a, b and c must be f32 (a is " + a.describe() +
             ", c is " + c.describe() + "); use fp32, or tf32/bf16 for other dtypes");
    if (m.precision > p_.precision.matmul)
      report("computes in " + std::string(to_string(m.precision)) + " but the program's precision policy allows at most " +
             to_string(p_.precision.matmul));
  }

  template <class Report>
  void check(const AtenOp& op, Report& report) {
    if (!is_well_formed_op_name(op.op))
      report("malformed op name \"" + op.op + "\"; expected \"namespace::name\" or \"namespace::name.overload\"");
    if (op.outputs.empty()) report("ATen op " + op.op + " has no outputs");
  }

  template <class Report>
  void check(const View& v, Report& report) {
    const TensorSpec &src = buf(v.source).spec, &dst = buf(v.result).spec;
    if (v.result == v.source) {
      report("a view cannot be its own source");
      return;
    }
    if (buf(v.result).role != BufferRole::intermediate)
      report("view result " + label(v.result) + " must be an intermediate buffer, not " + to_string(buf(v.result).role));
    if (view_source_.count(v.result) || ever_written_.count(v.result))
      report("view result " + label(v.result) + " already has storage of its own");
    if (src.dtype != dst.dtype)
      report("a view keeps the dtype: source is " + src.describe() + ", result is " + dst.describe());
    switch (v.kind) {
      case ViewKind::reshape:
        if (src.numel() != dst.numel())
          report("reshape changes the element count: " + src.describe() + " (" + std::to_string(src.numel()) +
                 ") to " + dst.describe() + " (" + std::to_string(dst.numel()) + ")");
        if (!src.is_contiguous() || !dst.is_contiguous())
          report("reshape without a copy needs contiguous source and result");
        break;
      case ViewKind::permute:
        if (src.numel() != dst.numel() || src.shape.size() != dst.shape.size())
          report("permute must keep the rank and element count: " + src.describe() + " to " + dst.describe());
        break;
      case ViewKind::slice:
        if (dst.numel() > src.numel())
          report("a slice cannot hold more elements than its source: " + src.describe() + " to " + dst.describe());
        break;
    }
    if (v.storage_offset < 0 || v.storage_offset > src.storage_elements() - dst.storage_elements())
      report("the view spans elements [" + std::to_string(v.storage_offset) + ", " +
             (v.storage_offset > (std::int64_t(1) << 50) ? std::string("...")
                                                          : std::to_string(v.storage_offset + dst.storage_elements())) +
             ") but its source has " +
             std::to_string(src.storage_elements()));
    view_source_[v.result] = v.source;
    view_offset_[v.result] = v.storage_offset;
  }

  const Program& p_;
  std::vector<std::string> problems_;
  std::unordered_map<BufferId, const Buffer*> by_id_;
  std::unordered_map<BufferId, BufferId> view_source_;
  std::unordered_map<BufferId, std::int64_t> view_offset_;  // elements into the source
  std::set<BufferId> written_;       // holds defined values before the current step
  std::set<BufferId> ever_written_;  // includes storage written through views
};

}  // namespace

Result<void> Program::validate() const {
  std::vector<std::string> problems = Checker(*this).run();
  if (problems.empty()) return {};
  std::string log;
  for (const std::string& p : problems) log += p + "\n";
  std::string message = "invalid program: " + problems.front();
  if (problems.size() > 1) message += " (and " + std::to_string(problems.size() - 1) + " more problems; see the log)";
  return fail(ErrorCode::InvalidArgument, std::move(message), std::move(log));
}

}  // namespace stitchcuda::program
