// AtenOp steps: any ATen operator by name and overload, resolved once in the dispatcher; its schema
// decides which program inputs feed which tensor arguments and how attributes become IValues.
#include "steps.hpp"

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <optional>
#include <set>

namespace stitchcuda::torch::detail {
namespace {

std::string describe(const Attribute& a) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::int64_t>) return "int " + std::to_string(v);
        else if constexpr (std::is_same_v<T, double>) return "float " + std::to_string(v);
        else if constexpr (std::is_same_v<T, bool>) return v ? "bool true" : "bool false";
        else if constexpr (std::is_same_v<T, std::string>) return "string '" + v + "'";
        else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) return "int list";
        else return "float list";
      },
      a);
}

// The IValue an attribute gives for a schema type, or an explanation of the mismatch.
std::optional<c10::IValue> convert(const Attribute& a, const c10::TypePtr& declared, std::optional<int32_t> fixed_size,
                                   std::string& why) {
  c10::TypePtr type = declared;
  if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
  const auto kind = type->kind();
  auto as_int = [&]() -> std::optional<std::int64_t> {
    if (auto* i = std::get_if<std::int64_t>(&a)) return *i;
    if (auto* b = std::get_if<bool>(&a)) return std::int64_t(*b);
    return std::nullopt;
  };
  auto as_double = [&]() -> std::optional<double> {
    if (auto* d = std::get_if<double>(&a)) return *d;
    if (auto* i = std::get_if<std::int64_t>(&a)) return double(*i);
    return std::nullopt;
  };
  switch (kind) {
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      if (auto i = as_int()) return c10::IValue(*i);
      // Some schemas declare a dtype as `int?` (aten::_to_copy's in the boxed registry): a dtype name
      // is its ScalarType number there.
      if (auto* s = std::get_if<std::string>(&a))
        if (auto d = dtype_from_string(*s)) return c10::IValue(static_cast<std::int64_t>(scalar_type(*d)));
      break;
    case c10::TypeKind::FloatType:
      if (auto d = as_double()) return c10::IValue(*d);
      break;
    case c10::TypeKind::BoolType:
      if (auto* b = std::get_if<bool>(&a)) return c10::IValue(*b);
      if (auto i = std::get_if<std::int64_t>(&a); i && (*i == 0 || *i == 1)) return c10::IValue(*i == 1);
      break;
    case c10::TypeKind::StringType:
      if (auto* s = std::get_if<std::string>(&a)) return c10::IValue(*s);
      break;
    case c10::TypeKind::NumberType:
      if (auto* d = std::get_if<double>(&a)) return c10::IValue(c10::Scalar(*d));
      if (auto* i = std::get_if<std::int64_t>(&a)) return c10::IValue(c10::Scalar(*i));
      if (auto* b = std::get_if<bool>(&a)) return c10::IValue(c10::Scalar(*b));
      break;
    case c10::TypeKind::ScalarTypeType:
      if (auto* s = std::get_if<std::string>(&a)) {
        if (auto d = dtype_from_string(*s)) return c10::IValue(static_cast<std::int64_t>(scalar_type(*d)));
        why = "'" + *s + "' is not a dtype name (f32, f16, bf16, f64, i32, i64, u8, bool)";
        return std::nullopt;
      }
      break;
    case c10::TypeKind::DeviceObjType:
      if (auto* s = std::get_if<std::string>(&a)) {
        try {
          return c10::IValue(c10::Device(*s));
        } catch (const c10::Error&) {
          why = "'" + *s + "' is not a device (cuda, cuda:0, cpu)";
          return std::nullopt;
        }
      }
      break;
    case c10::TypeKind::ListType: {
      auto element = type->castRaw<c10::ListType>()->getElementType()->kind();
      if (element == c10::TypeKind::IntType || element == c10::TypeKind::SymIntType) {
        if (auto* v = std::get_if<std::vector<std::int64_t>>(&a)) return c10::IValue(*v);
        if (auto i = as_int(); i && fixed_size) return c10::IValue(std::vector<std::int64_t>(std::size_t(*fixed_size), *i));
      } else if (element == c10::TypeKind::FloatType) {
        if (auto* v = std::get_if<std::vector<double>>(&a)) return c10::IValue(*v);
      } else if (element == c10::TypeKind::BoolType) {
        if (auto* v = std::get_if<std::vector<std::int64_t>>(&a)) {
          c10::List<bool> bits;
          for (std::int64_t x : *v) bits.push_back(x != 0);
          return c10::IValue(std::move(bits));
        }
      }
      break;
    }
    default:
      why = "arguments of type " + declared->str() + " cannot be given as attributes";
      return std::nullopt;
  }
  why = describe(a) + " does not fit the declared type " + declared->str();
  return std::nullopt;
}

bool is_tensor(const c10::TypePtr& t) { return t->kind() == c10::TypeKind::TensorType; }
bool is_optional_tensor(const c10::TypePtr& t) {
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}
bool is_tensor_list(const c10::TypePtr& t) {
  auto list = t->cast<c10::ListType>();
  return list && list->getElementType()->kind() == c10::TypeKind::TensorType;
}
bool is_optional_tensor_list(const c10::TypePtr& t) {  // Tensor?[]: index.Tensor's indices
  auto list = t->cast<c10::ListType>();
  return list && is_optional_tensor(list->getElementType());
}

}  // namespace

Result<BoundAtenOp> BoundAtenOp::bind(const AtenOp& step, const Program& program) {
  std::string name = step.op, overload;
  if (auto dot = name.find('.'); dot != std::string::npos) overload = name.substr(dot + 1), name.resize(dot);
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle)
    return fail(ErrorCode::InvalidArgument,
                "unknown ATen op '" + step.op + "': no such operator and overload is registered in this PyTorch "
                "(the overload follows the dot, e.g. aten::add.Tensor; aten::relu has the overload '' and is written "
                "without a dot)");
  const c10::FunctionSchema& schema = handle->schema();

  BoundAtenOp bound;
  bound.handle_ = std::make_shared<c10::OperatorHandle>(*handle);
  const auto& args = schema.arguments();
  std::size_t next = 0, n_inputs = step.inputs.size();
  std::set<std::string> used;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const c10::Argument& arg = args[i];
    Slot slot;
    const c10::TypePtr& type = arg.type();
    auto given = step.attributes.find(arg.name());
    if (is_optional_tensor(type) && given != step.attributes.end()) {
      // An absent optional tensor before a present one (layer_norm without weight but with bias)
      // is spelt as the attribute "<name>": "none".
      auto* text = std::get_if<std::string>(&given->second);
      if (!text || *text != "none")
        return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "', argument '" + arg.name() +
                                                    "': an optional tensor takes the attribute \"none\" or an input");
      slot.kind = Slot::optional_absent;
      used.insert(arg.name());
    } else if (is_tensor(type) || is_optional_tensor(type)) {
      if (next < n_inputs) {
        slot.kind = Slot::tensor, slot.first = next++, slot.count = 1;
      } else if (is_optional_tensor(type)) {
        slot.kind = Slot::optional_absent;
      } else {
        return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' needs tensor argument '" + arg.name() +
                                                    "' but the step gives only " + std::to_string(n_inputs) + " input(s)");
      }
    } else if (is_tensor_list(type)) {
      // The list takes what the later tensor arguments leave, or, where several lists share the inputs
      // (lstm's hx and params), as many as the attribute "<name>:count" says.
      std::size_t take = 0;
      if (auto count = step.attributes.find(arg.name() + ":count"); count != step.attributes.end()) {
        auto* k = std::get_if<std::int64_t>(&count->second);
        if (!k || *k < 0 || std::size_t(*k) > n_inputs - next)
          return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "', attribute '" + count->first +
                                                      "': must be a count of at most the " +
                                                      std::to_string(n_inputs - next) + " input(s) left");
        take = std::size_t(*k);
        used.insert(count->first);
      } else {
        std::size_t later = 0;
        for (std::size_t j = i + 1; j < args.size(); ++j) later += is_tensor(args[j].type()) ? 1 : 0;
        take = n_inputs - next >= later ? n_inputs - next - later : 0;
      }
      slot.kind = Slot::tensor_list, slot.first = next, slot.count = take;
      next += take;
    } else if (is_optional_tensor_list(type)) {
      // Tensor?[] (x[:, idx] is index.Tensor(x, [None, idx])): the inputs left for it, in order; with the
      // attribute "<name>:present" (one 0 or 1 per entry), the entries it marks 0 are absent.
      std::size_t later = 0;
      for (std::size_t j = i + 1; j < args.size(); ++j) later += is_tensor(args[j].type()) ? 1 : 0;
      std::size_t left = n_inputs - next >= later ? n_inputs - next - later : 0;
      if (auto mask = step.attributes.find(arg.name() + ":present"); mask != step.attributes.end()) {
        auto* flags = std::get_if<std::vector<std::int64_t>>(&mask->second);
        std::size_t given = 0;
        bool ok = flags != nullptr;
        for (std::size_t k = 0; ok && k < flags->size(); ++k) {
          ok = (*flags)[k] == 0 || (*flags)[k] == 1;
          given += ok && (*flags)[k] == 1 ? 1 : 0;
        }
        if (!ok || given != left)
          return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "', attribute '" + mask->first +
                                                      "': must be a list of 0 (absent) and 1 (the next input) with one 1 for "
                                                      "each of the " + std::to_string(left) + " input(s) left");
        for (std::int64_t f : *flags) slot.present.push_back(f == 1);
        used.insert(mask->first);
      } else {
        slot.present.assign(left, true);
      }
      slot.kind = Slot::optional_tensor_list, slot.first = next, slot.count = left;
      next += left;
    } else if (auto it = step.attributes.find(arg.name()); it != step.attributes.end()) {
      std::string why;
      auto value = convert(it->second, type, arg.N(), why);
      if (!value)
        return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "', argument '" + arg.name() + "': " + why);
      slot.constant = std::move(*value);
      used.insert(arg.name());
    } else if (arg.default_value()) {
      slot.constant = *arg.default_value();
    } else if (type->kind() == c10::TypeKind::OptionalType) {
      slot.constant = c10::IValue();
    } else {
      return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' needs argument '" + arg.name() + "' (" +
                                                  type->str() + "): add it to the step's attributes");
    }
    bound.slots_.push_back(std::move(slot));
  }
  if (next != n_inputs)
    return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' takes " + std::to_string(next) +
                                                " tensor input(s) but the step gives " + std::to_string(n_inputs));
  for (const auto& [key, value] : step.attributes)
    if (!used.count(key)) {
      std::string names;
      for (const auto& a : args) names += " " + a.name();
      return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' has no argument '" + key +
                                                  "' (its arguments:" + names + ")");
    }
  // Programs use functional overloads (the result goes to the step's output buffer), except where a step
  // updates a state in place (a KV cache written at a position): the argument it writes is a state, or a
  // view of one, and is the step's output too.
  for (std::size_t i = 0; i < args.size(); ++i) {
    const c10::AliasInfo* alias = args[i].alias_info();
    if (!alias || !alias->isWrite()) continue;
    const Slot& slot = bound.slots_[i];
    std::optional<BufferId> written;
    if (slot.kind == Slot::tensor) written = step.inputs[slot.first];
    BufferId root = written.value_or(0);
    for (bool found = written.has_value(); found;) {  // through views to the storage's buffer
      found = false;
      for (const Step& s : program.steps)
        if (auto* v = std::get_if<View>(&s); v && v->result == root) root = v->source, found = true;
    }
    const Buffer* b = written ? program.buffer(root) : nullptr;
    if (!b || b->role != BufferRole::state ||
        std::find(step.outputs.begin(), step.outputs.end(), *written) == step.outputs.end())
      return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' writes its argument '" + args[i].name() +
                                                  "' in place; programs use functional overloads (the result goes to "
                                                  "the step's output buffer), except to update a state in place (the "
                                                  "state, or a view of it, given as that argument and as the output)");
  }
  std::size_t tensor_returns = 0;
  bool list_return = false;
  for (const auto& r : schema.returns()) {
    if (is_tensor(r.type())) ++tensor_returns;
    else if (is_tensor_list(r.type())) list_return = true;
    else
      return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' returns a " + r.type()->str() +
                                                  ", which no buffer can hold");
  }
  if (!list_return && tensor_returns != step.outputs.size())
    return fail(ErrorCode::InvalidArgument, "ATen op '" + step.op + "' returns " + std::to_string(tensor_returns) +
                                                " tensor(s) but the step names " + std::to_string(step.outputs.size()) +
                                                " output buffer(s)");
  return bound;
}

std::vector<at::Tensor> BoundAtenOp::call(const std::vector<at::Tensor>& inputs) const {
  ::torch::jit::Stack stack;
  stack.reserve(slots_.size());
  for (const Slot& s : slots_) {
    switch (s.kind) {
      case Slot::tensor: stack.emplace_back(inputs[s.first]); break;
      case Slot::tensor_list:
        stack.emplace_back(std::vector<at::Tensor>(inputs.begin() + long(s.first), inputs.begin() + long(s.first + s.count)));
        break;
      case Slot::optional_tensor_list: {
        c10::List<std::optional<at::Tensor>> list;
        std::size_t k = s.first;
        for (bool present : s.present) list.push_back(present ? std::optional<at::Tensor>(inputs[k++]) : std::nullopt);
        stack.emplace_back(std::move(list));
        break;
      }
      case Slot::optional_absent: stack.emplace_back(); break;
      case Slot::value: stack.push_back(s.constant); break;
    }
  }
  // A program's steps are explicit about dtypes (a graph captured under torch.autocast holds its casts):
  // called while the caller's autocast is on, the dispatcher would cast this op's inputs again.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  handle_->callBoxed(stack);
  std::vector<at::Tensor> out;
  for (c10::IValue& v : stack) {
    if (v.isTensor()) out.push_back(std::move(v).toTensor());
    else if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorVector()) out.push_back(t);
  }
  return out;
}

}  // namespace stitchcuda::torch::detail
