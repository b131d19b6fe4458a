// ProgramFamily (family.hpp): validation of the dims and members, the member choice for a call's sizes,
// and the family file — the program layer's container (detail/container.hpp) under its own magic: a JSON
// manifest of the dims and members, each member's program (`.stitch` bytes without weights) and every
// distinct weight once.
#include <stitchcuda/family.hpp>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/container.hpp>

namespace stitchcuda::program {
namespace {

using nlohmann::json;
using detail::Field;

// The container's header with another magic than a program's: the kinds tell apart by their first 8 bytes.
const detail::ContainerKind kFamilyFile{{'S', 'T', 'I', 'T', 'C', 'H', 'F', '\x01'}, kFamilyArtifactVersion,
                                        "stitchcuda.family", "family file", "not a valid program family file",
                                        "a single program's .stitch file loads with Program::load / Executor::load"};
constexpr std::int64_t kMaxSize = std::numeric_limits<std::int32_t>::max();

tl::unexpected<Error> invalid(std::string message) { return fail(ErrorCode::InvalidArgument, std::move(message)); }

std::string sizes_text(const std::vector<DynamicDim>& dims, const std::vector<std::int64_t>& sizes) {
  std::string s;
  for (std::size_t d = 0; d < sizes.size() && d < dims.size(); ++d)
    s += (d ? ", " : "") + dims[d].name + "=" + std::to_string(sizes[d]);
  return s;
}

std::string tensor_label(const char* role, std::size_t index, const Buffer& b) {
  return std::string(role) + " " + std::to_string(index) + (b.name.empty() ? "" : " ('" + b.name + "')");
}

// Whether axis `axis` of tensor `index` carries a dim, per role.
bool is_dynamic(const std::vector<DynamicDim>& dims, bool input, std::size_t index, std::size_t axis) {
  for (const DynamicDim& d : dims)
    for (const auto& [i, a] : input ? d.inputs : d.outputs)
      if (i == index && a == axis) return true;
  return false;
}

Result<void> check_dims(const std::vector<DynamicDim>& dims) {
  if (dims.empty()) return invalid("dims is empty: a family needs at least one dim whose size varies");
  std::set<std::string> names;
  std::set<std::pair<std::uint32_t, std::uint32_t>> seen_in, seen_out;
  for (std::size_t d = 0; d < dims.size(); ++d) {
    const DynamicDim& dim = dims[d];
    const std::string at = "dims[" + std::to_string(d) + "]";
    if (dim.name.empty()) return invalid(at + ".name is empty: name the dim (\"batch\", \"seq\") for messages");
    if (!names.insert(dim.name).second)
      return invalid(at + ".name '" + dim.name + "' names an earlier dim too: names are unique");
    if (dim.min < 1 || dim.min > kMaxSize)
      return invalid(at + ".min = " + std::to_string(dim.min) + " is outside 1.." + std::to_string(kMaxSize));
    if (dim.max < dim.min || dim.max > kMaxSize)
      return invalid(at + ".max = " + std::to_string(dim.max) + " is outside " + std::to_string(dim.min) + ".." +
                     std::to_string(kMaxSize) + " (min.." + std::to_string(kMaxSize) + ")");
    if (dim.inputs.empty())
      return invalid(at + ".inputs is empty: the size of dim '" + dim.name + "' is read from the inputs, so name an "
                     "(input, axis) that carries it");
    for (auto [axes, seen, what] : {std::tuple{&dim.inputs, &seen_in, "inputs"}, std::tuple{&dim.outputs, &seen_out, "outputs"}})
      for (std::size_t k = 0; k < axes->size(); ++k)
        if (!seen->insert((*axes)[k]).second)
          return invalid(at + "." + what + "[" + std::to_string(k) + "] = (" + std::to_string((*axes)[k].first) + ", " +
                         std::to_string((*axes)[k].second) + ") is named before: an axis carries one dim, once");
  }
  return {};
}

// One member against the dims and, unless it is the reference itself, the reference member's layout.
Result<void> check_one(const std::vector<DynamicDim>& dims, const FamilyMember& m, const std::string& at,
                       const FamilyMember* reference) {
  if (m.sizes.size() != dims.size())
    return invalid(at + ".sizes has " + std::to_string(m.sizes.size()) + " entries for " + std::to_string(dims.size()) +
                   " dims: one size per dim, in the dims' order");
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (m.sizes[d] < dims[d].min || m.sizes[d] > dims[d].max)
      return invalid(at + ".sizes[" + std::to_string(d) + "] = " + std::to_string(m.sizes[d]) + " is outside dim '" +
                     dims[d].name + "''s range " + std::to_string(dims[d].min) + ".." + std::to_string(dims[d].max));
  if (auto ok = m.program.validate(); !ok) return invalid(at + ".program does not validate: " + ok.error().message);
  for (bool input : {true, false}) {
    const char* role = input ? "input" : "output";
    auto mine = io_buffers(m.program, input ? BufferRole::input : BufferRole::output);
    for (std::size_t d = 0; d < dims.size(); ++d) {
      const auto& pairs = input ? dims[d].inputs : dims[d].outputs;
      for (std::size_t k = 0; k < pairs.size(); ++k) {
        const auto [i, a] = pairs[k];
        const std::string field = "dims[" + std::to_string(d) + "]." + role + "s[" + std::to_string(k) + "]";
        if (i >= mine.size())
          return invalid(field + " names " + role + " " + std::to_string(i) + " but " + at + ".program has " +
                         std::to_string(mine.size()) + " " + role + "(s)");
        const TensorSpec& s = mine[i]->spec;
        if (a >= s.shape.size())
          return invalid(field + " names axis " + std::to_string(a) + " of " + at + ".program's " +
                         tensor_label(role, i, *mine[i]) + ", which is " + s.describe() + " (rank " +
                         std::to_string(s.shape.size()) + ")");
        if (s.shape[a] != m.sizes[d])
          return invalid(at + ".program's " + tensor_label(role, i, *mine[i]) + " is " + s.describe() + ": its axis " +
                         std::to_string(a) + " carries dim '" + dims[d].name + "', whose size is " + std::to_string(m.sizes[d]) +
                         " (" + at + ".sizes[" + std::to_string(d) + "])");
      }
    }
    if (!reference || reference == &m) continue;
    auto theirs = io_buffers(reference->program, input ? BufferRole::input : BufferRole::output);
    if (mine.size() != theirs.size())
      return invalid(at + ".program has " + std::to_string(mine.size()) + " " + role + "(s), the first member's has " +
                     std::to_string(theirs.size()) + ": members differ only in their dims' sizes");
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const TensorSpec &s = mine[i]->spec, &r = theirs[i]->spec;
      bool same = s.dtype == r.dtype && s.shape.size() == r.shape.size();
      for (std::size_t a = 0; same && a < s.shape.size(); ++a)
        same = s.shape[a] == r.shape[a] || is_dynamic(dims, input, i, a);
      if (!same)
        return invalid(at + ".program's " + tensor_label(role, i, *mine[i]) + " is " + s.describe() + ", the first member's is " +
                       r.describe() + ": members differ only along their dims' axes");
    }
  }
  return {};
}

tl::unexpected<Error> duplicate(const std::vector<DynamicDim>& dims, const std::string& at, const std::vector<std::int64_t>& sizes,
                                std::size_t earlier) {
  return invalid(at + ".sizes (" + sizes_text(dims, sizes) + ") are members[" + std::to_string(earlier) +
                 "]'s too: one program per sizes");
}

}  // namespace

std::vector<const Buffer*> io_buffers(const Program& program, BufferRole role) {
  std::vector<const Buffer*> out;
  for (const Buffer& b : program.buffers)
    if (b.role == role) out.push_back(&b);
  std::sort(out.begin(), out.end(), [](const Buffer* a, const Buffer* b) { return a->id < b->id; });
  return out;
}

bool is_family_artifact(std::string_view bytes) noexcept { return detail::has_magic(kFamilyFile, bytes); }

Result<void> ProgramFamily::validate() const {
  if (auto ok = check_dims(dims); !ok) return ok;
  if (members.empty()) return invalid("members is empty: a family needs at least one program");
  std::map<std::vector<std::int64_t>, std::size_t> seen;
  for (std::size_t i = 0; i < members.size(); ++i) {
    const std::string at = "members[" + std::to_string(i) + "]";
    if (auto ok = check_one(dims, members[i], at, &members[0]); !ok) return ok;
    if (auto [it, fresh] = seen.emplace(members[i].sizes, i); !fresh) return duplicate(dims, at, members[i].sizes, it->second);
  }
  if (std::all_of(dims.begin(), dims.end(), [](const DynamicDim& d) { return d.pad; })) {
    std::vector<std::int64_t> top;
    for (const DynamicDim& d : dims) top.push_back(d.max);
    if (!seen.count(top))
      return invalid("members has none at the maximum (" + sizes_text(dims, top) + "): every dim pads, so that member "
                     "serves the range's largest calls; add it, or set pad = false on a dim to serve its sizes exactly");
  }
  return {};
}

Result<void> ProgramFamily::check_member(const FamilyMember& member) const {
  if (auto ok = check_dims(dims); !ok) return ok;
  const std::string at = "members[" + std::to_string(members.size()) + "]";  // the index it would take
  if (auto ok = check_one(dims, member, at, members.empty() ? nullptr : &members[0]); !ok) return ok;
  for (std::size_t i = 0; i < members.size(); ++i)
    if (members[i].sizes == member.sizes) return duplicate(dims, at, member.sizes, i);
  return {};
}

std::vector<std::vector<std::int64_t>> ProgramFamily::member_sizes() const {
  std::vector<std::vector<std::int64_t>> out;
  for (const FamilyMember& m : members) out.push_back(m.sizes);
  return out;
}

Result<std::vector<std::int64_t>> ProgramFamily::sizes_of(const std::vector<std::vector<std::int64_t>>& input_shapes) const {
  if (members.empty()) return invalid("the family has no members yet: add one before running it");
  std::vector<TensorSpec> reference;
  for (const Buffer* b : io_buffers(members[0].program, BufferRole::input)) reference.push_back(b->spec);
  return call_sizes(dims, reference, input_shapes);
}

Result<std::size_t> ProgramFamily::select(const std::vector<std::int64_t>& sizes) const {
  return select_member(dims, member_sizes(), sizes);
}

Result<std::vector<std::int64_t>> call_sizes(const std::vector<DynamicDim>& dims, const std::vector<TensorSpec>& reference,
                                             const std::vector<std::vector<std::int64_t>>& input_shapes) {
  if (input_shapes.size() != reference.size())
    return invalid("the family takes " + std::to_string(reference.size()) + " input(s) but " +
                   std::to_string(input_shapes.size()) + " were given");
  for (std::size_t i = 0; i < input_shapes.size(); ++i)
    if (input_shapes[i].size() != reference[i].shape.size())
      return invalid("input " + std::to_string(i) + " has rank " + std::to_string(input_shapes[i].size()) + " but the family's "
                     "input " + std::to_string(i) + " has rank " + std::to_string(reference[i].shape.size()) + " (" +
                     reference[i].describe() + " in its first member)");
  std::vector<std::int64_t> sizes;
  for (const DynamicDim& d : dims) {
    std::optional<std::int64_t> size;
    std::pair<std::uint32_t, std::uint32_t> first{};
    for (const auto& [i, a] : d.inputs) {
      if (i >= input_shapes.size() || a >= input_shapes[i].size())
        return invalid("dim '" + d.name + "' names axis " + std::to_string(a) + " of input " + std::to_string(i) +
                       ", which the call does not have");
      const std::int64_t here = input_shapes[i][a];
      if (!size) size = here, first = {i, a};
      else if (here != *size)
        return invalid("dim '" + d.name + "' is " + std::to_string(*size) + " at input " + std::to_string(first.first) +
                       " axis " + std::to_string(first.second) + " but " + std::to_string(here) + " at input " +
                       std::to_string(i) + " axis " + std::to_string(a) + ": the inputs must agree on it");
    }
    if (!size) return invalid("dim '" + d.name + "' names no input axis to read its size from");
    if (*size < d.min || *size > d.max)
      return invalid("dim '" + d.name + "' is " + std::to_string(*size) + ", outside " + std::to_string(d.min) + ".." +
                     std::to_string(d.max) + ": the family serves that range (split the call, or build the family "
                     "for a wider range)");
    sizes.push_back(*size);
  }
  for (std::size_t i = 0; i < input_shapes.size(); ++i)
    for (std::size_t a = 0; a < input_shapes[i].size(); ++a)
      if (!is_dynamic(dims, true, i, a) && input_shapes[i][a] != reference[i].shape[a])
        return invalid("input " + std::to_string(i) + " axis " + std::to_string(a) + " is " + std::to_string(input_shapes[i][a]) +
                       " but the family's programs take " + std::to_string(reference[i].shape[a]) + " there (" +
                       reference[i].describe() + " in its first member): only the dims' axes vary");
  return sizes;
}

Result<std::size_t> select_member(const std::vector<DynamicDim>& dims, const std::vector<std::vector<std::int64_t>>& member_sizes,
                                  const std::vector<std::int64_t>& sizes) {
  if (sizes.size() != dims.size())
    return invalid(std::to_string(sizes.size()) + " size(s) given for " + std::to_string(dims.size()) + " dims");
  std::optional<std::size_t> best;
  double best_volume = 0;
  for (std::size_t m = 0; m < member_sizes.size(); ++m) {
    const auto& have = member_sizes[m];
    if (have == sizes) return m;
    bool serves = have.size() == sizes.size();
    double volume = 1;
    for (std::size_t d = 0; serves && d < sizes.size(); ++d) {
      serves = have[d] == sizes[d] || (dims[d].pad && have[d] > sizes[d]);
      volume *= double(have[d]);
    }
    if (serves && (!best || volume < best_volume)) best = m, best_volume = volume;
  }
  if (best) return *best;
  std::string message = "no member serves " + sizes_text(dims, sizes) + ": the members are";
  for (std::size_t m = 0; m < member_sizes.size() && m < 8; ++m)
    message += (m ? ", (" : " (") + sizes_text(dims, member_sizes[m]) + ")";
  if (member_sizes.size() > 8) message += " and " + std::to_string(member_sizes.size() - 8) + " more";
  std::string exact;
  for (const DynamicDim& d : dims)
    if (!d.pad) exact += (exact.empty() ? "" : ", ") + ("'" + d.name + "'");
  message += exact.empty() ? "; none is as large in every dim"
                           : "; " + exact + " do(es) not pad, so those sizes are served only exactly";
  return invalid(message);
}

std::string ProgramFamily::serialize() const {
  std::vector<const Program*> programs;
  for (const FamilyMember& m : members) programs.push_back(&m.program);
  const detail::PooledPrograms pooled = detail::pool_weights(programs);
  json members_json = json::array();
  for (std::size_t i = 0; i < members.size(); ++i)
    members_json.push_back({{"sizes", members[i].sizes}, {"weights", pooled.weights[i]}});
  json dims_json = json::array();
  for (const DynamicDim& d : dims)
    dims_json.push_back({{"name", d.name}, {"min", d.min}, {"max", d.max}, {"pad", d.pad}, {"inputs", d.inputs},
                         {"outputs", d.outputs}});
  // Sections in this order: member.0 .. member.N-1, then weight.0 .. weight.K-1.
  std::vector<std::pair<std::string, std::string_view>> sections;
  for (std::size_t i = 0; i < pooled.programs.size(); ++i) sections.emplace_back("member." + std::to_string(i), pooled.programs[i]);
  pooled.add_weight_sections(sections);
  return detail::write_container(kFamilyFile, json{{"dims", dims_json}, {"members", members_json}}, sections);
}

Result<ProgramFamily> ProgramFamily::deserialize(std::string_view bytes) {
  return detail::read_checked<ProgramFamily>(kFamilyFile, bytes, "family", [](const detail::Container& file) {
    Field manifest(file.manifest, "manifest");
    ProgramFamily family;
    for (const Field& d : manifest["dims"].items())
      family.dims.push_back({d["name"].text(), d["min"].integer(0, kMaxSize), d["max"].integer(0, kMaxSize),
                             d["pad"].boolean(), d["inputs"].pairs(), d["outputs"].pairs()});
    std::set<std::string> used;
    const auto members = manifest["members"].items();
    for (std::size_t i = 0; i < members.size(); ++i) {
      FamilyMember m{{}, detail::read_pooled_program(file, "member." + std::to_string(i), members[i]["weights"], used)};
      for (const Field& size : members[i]["sizes"].items()) m.sizes.push_back(size.integer(0, kMaxSize));
      family.members.push_back(std::move(m));
    }
    detail::require_all_used(file, used, "belongs to no member");
    return family;
  });
}

Result<void> ProgramFamily::save(const std::string& path) const { return detail::save_checked(kFamilyFile, path, *this); }

Result<ProgramFamily> ProgramFamily::load(const std::string& path) {
  return detail::load_container_file(kFamilyFile, path, &ProgramFamily::deserialize);
}

}  // namespace stitchcuda::program
