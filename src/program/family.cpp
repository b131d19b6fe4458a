// ProgramFamily (family.hpp): validation of the dims and members, the member choice for a call's sizes,
// and the family file — the `.stitch` container's header layout under its own magic, a JSON manifest,
// then each member's program (as `.stitch` bytes without weights) and every distinct weight once.
#include <stitchcuda/family.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/sha256.hpp>

namespace stitchcuda::program {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// The header of a `.stitch` file (magic, version, manifest length, manifest SHA-256) with another magic,
// so that Program::load's header check holds and the two kinds tell apart by their first 8 bytes.
constexpr char kFamilyMagic[8] = {'S', 'T', 'I', 'T', 'C', 'H', 'F', '\x01'};
constexpr std::size_t kHeader = 8 + 4 + 8 + 32;
constexpr std::uint64_t kMaxManifest = 64ull << 20;
constexpr std::int64_t kMaxSize = std::numeric_limits<std::int32_t>::max();
constexpr const char* kFormat = "stitchcuda.family";

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

// ---- the file ----

// Header integers are little-endian, as the `.stitch` header's; this library builds for such hosts only.
static_assert(std::endian::native == std::endian::little);
template <class T>
void append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}
template <class T>
T read_at(std::string_view in, std::size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof value);
  return value;
}

struct Malformed {
  std::string what;
};

// A field of the untrusted manifest, or Malformed naming its path.
const json& field(const json& j, const char* key, const std::string& path) {
  if (!j.is_object()) throw Malformed{path + " is not an object"};
  auto it = j.find(key);
  if (it == j.end()) throw Malformed{"missing field '" + path + "." + key + "'"};
  return *it;
}

const json& list(const json& j, const std::string& path) {
  if (!j.is_array()) throw Malformed{path + " is not a list"};
  return j;
}

std::int64_t integer(const json& j, const std::string& path, std::int64_t lo, std::int64_t hi) {
  if (!j.is_number_integer() || (j.is_number_unsigned() && j.get<std::uint64_t>() > std::uint64_t(hi)) ||
      j.get<std::int64_t>() < lo || j.get<std::int64_t>() > hi)
    throw Malformed{path + " is not an integer in " + std::to_string(lo) + ".." + std::to_string(hi)};
  return j.get<std::int64_t>();
}

std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs(const json& j, const std::string& path) {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
  for (std::size_t k = 0; k < list(j, path).size(); ++k) {
    const std::string at = path + "[" + std::to_string(k) + "]";
    if (!j[k].is_array() || j[k].size() != 2) throw Malformed{at + " is not an (index, axis) pair"};
    constexpr std::int64_t u32 = std::numeric_limits<std::uint32_t>::max();
    out.emplace_back(std::uint32_t(integer(j[k][0], at + "[0]", 0, u32)), std::uint32_t(integer(j[k][1], at + "[1]", 0, u32)));
  }
  return out;
}

tl::unexpected<Error> corrupt(const std::string& what) { return invalid("not a valid program family file: " + what); }

}  // namespace

std::vector<const Buffer*> io_buffers(const Program& program, BufferRole role) {
  std::vector<const Buffer*> out;
  for (const Buffer& b : program.buffers)
    if (b.role == role) out.push_back(&b);
  std::sort(out.begin(), out.end(), [](const Buffer* a, const Buffer* b) { return a->id < b->id; });
  return out;
}

bool is_family_artifact(std::string_view bytes) noexcept {
  return bytes.size() >= sizeof(kFamilyMagic) && std::memcmp(bytes.data(), kFamilyMagic, sizeof(kFamilyMagic)) == 0;
}

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
  // Every distinct weight once: members of one model hold the same bytes for the same parameter, so each
  // is compared with the stored weights of its size (a byte compare, no second hash of the weights).
  std::vector<const std::string*> pool;
  std::multimap<std::size_t, std::size_t> pool_by_size;
  json members_json = json::array();
  std::vector<std::string> programs;
  for (const FamilyMember& m : members) {
    json weights = json::array();
    for (const auto& [id, bytes] : m.program.weights) {
      std::optional<std::size_t> found;
      for (auto [it, end] = pool_by_size.equal_range(bytes.size()); it != end && !found; ++it)
        if (*pool[it->second] == bytes) found = it->second;
      if (!found) {
        found = pool.size();
        pool.push_back(&bytes);
        pool_by_size.emplace(bytes.size(), *found);
      }
      weights.push_back({id, *found});
    }
    Program stripped = m.program;  // a copy, not field by field: a field added to Program is never lost
    stripped.weights.clear();
    programs.push_back(stripped.serialize());
    members_json.push_back({{"sizes", m.sizes}, {"weights", weights}});
  }
  json dims_json = json::array();
  for (const DynamicDim& d : dims)
    dims_json.push_back({{"name", d.name}, {"min", d.min}, {"max", d.max}, {"pad", d.pad}, {"inputs", d.inputs},
                         {"outputs", d.outputs}});
  // Sections in this order: member.0 .. member.N-1, then weight.0 .. weight.K-1.
  json sections = json::array();
  auto section = [&](const std::string& name, std::string_view bytes) {
    sections.push_back({{"name", name}, {"size", bytes.size()}, {"sha256", detail::sha256_hex(bytes)}});
  };
  for (std::size_t i = 0; i < programs.size(); ++i) section("member." + std::to_string(i), programs[i]);
  for (std::size_t k = 0; k < pool.size(); ++k) section("weight." + std::to_string(k), *pool[k]);
  const std::string manifest = json{{"format", kFormat}, {"version", kFamilyArtifactVersion},
                                    {"library", stitchcuda::version()}, {"dims", dims_json},
                                    {"members", members_json}, {"sections", sections}}.dump(1);
  std::string out(kFamilyMagic, sizeof(kFamilyMagic));
  append(out, std::uint32_t(kFamilyArtifactVersion));
  append(out, std::uint64_t(manifest.size()));
  auto digest = detail::Sha256().update(manifest).digest();
  out.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  out += manifest;
  for (const std::string& p : programs) out += p;
  for (const std::string* w : pool) out += *w;
  return out;
}

Result<ProgramFamily> ProgramFamily::deserialize(std::string_view bytes) {
  if (bytes.size() < kHeader)
    return corrupt("it holds " + std::to_string(bytes.size()) + " bytes, fewer than the " + std::to_string(kHeader) +
                   "-byte header (truncated?)");
  if (!is_family_artifact(bytes))
    return corrupt("wrong magic bytes (a single program's .stitch file loads with Program::load / Executor::load)");
  if (auto v = read_at<std::uint32_t>(bytes, 8); v != kFamilyArtifactVersion)
    return corrupt("format version " + std::to_string(v) + " is not supported; this library reads version " +
                   std::to_string(kFamilyArtifactVersion) + " (re-export the family with a matching StitchCUDA)");
  const std::uint64_t manifest_size = read_at<std::uint64_t>(bytes, 12);
  if (manifest_size > bytes.size() - kHeader || manifest_size > kMaxManifest)
    return corrupt("the manifest claims " + std::to_string(manifest_size) + " bytes but " +
                   std::to_string(bytes.size() - kHeader) + " follow the header (truncated?)");
  const std::string_view manifest_text = bytes.substr(kHeader, manifest_size);
  if (auto digest = detail::Sha256().update(manifest_text).digest(); std::memcmp(bytes.data() + 20, digest.data(), digest.size()))
    return corrupt("the manifest's SHA-256 does not match (the file was modified or damaged)");
  std::string_view payload = bytes.substr(kHeader + manifest_size);
  ProgramFamily family;
  try {
    const json manifest = json::parse(manifest_text.begin(), manifest_text.end(), nullptr, false);
    if (manifest.is_discarded()) throw Malformed{"the manifest is not valid JSON"};
    if (field(manifest, "format", "manifest") != kFormat)
      throw Malformed{"manifest.format is not \"" + std::string(kFormat) + "\""};
    if (field(manifest, "version", "manifest") != kFamilyArtifactVersion)
      throw Malformed{"manifest.version differs from the header's format version"};
    // Sections follow one another in the manifest's order and fill the payload exactly.
    std::map<std::string, std::string_view> sections;
    const json& listed = list(field(manifest, "sections", "manifest"), "manifest.sections");
    for (std::size_t s = 0; s < listed.size(); ++s) {
      const std::string at = "manifest.sections[" + std::to_string(s) + "]";
      const json& name = field(listed[s], "name", at);
      const json& sha = field(listed[s], "sha256", at);
      if (!name.is_string() || !sha.is_string()) throw Malformed{at + " has a name or sha256 that is not a string"};
      const auto size =
          std::uint64_t(integer(field(listed[s], "size", at), at + ".size", 0, std::numeric_limits<std::int64_t>::max()));
      if (size > payload.size())
        throw Malformed{"section '" + name.get<std::string>() + "' claims " + std::to_string(size) + " bytes but " +
                        std::to_string(payload.size()) + " remain (truncated?)"};
      const std::string_view data = payload.substr(0, size);
      payload.remove_prefix(size);
      if (detail::sha256_hex(data) != sha.get<std::string>())
        throw Malformed{"section '" + name.get<std::string>() + "' fails its SHA-256 check (the file was modified or damaged)"};
      if (!sections.emplace(name.get<std::string>(), data).second)
        throw Malformed{"section '" + name.get<std::string>() + "' appears twice"};
    }
    if (!payload.empty()) throw Malformed{std::to_string(payload.size()) + " bytes follow the last section"};

    const json& dims = list(field(manifest, "dims", "manifest"), "manifest.dims");
    for (std::size_t d = 0; d < dims.size(); ++d) {
      const std::string at = "manifest.dims[" + std::to_string(d) + "]";
      const json& name = field(dims[d], "name", at);
      const json& pad = field(dims[d], "pad", at);
      if (!name.is_string()) throw Malformed{at + ".name is not a string"};
      if (!pad.is_boolean()) throw Malformed{at + ".pad is not true or false"};
      family.dims.push_back({name.get<std::string>(), integer(field(dims[d], "min", at), at + ".min", 0, kMaxSize),
                             integer(field(dims[d], "max", at), at + ".max", 0, kMaxSize), pad.get<bool>(),
                             pairs(field(dims[d], "inputs", at), at + ".inputs"),
                             pairs(field(dims[d], "outputs", at), at + ".outputs")});
    }
    std::set<std::string> used;
    const json& members = list(field(manifest, "members", "manifest"), "manifest.members");
    for (std::size_t i = 0; i < members.size(); ++i) {
      const std::string at = "manifest.members[" + std::to_string(i) + "]", name = "member." + std::to_string(i);
      auto program_bytes = sections.find(name);
      if (program_bytes == sections.end()) throw Malformed{"missing section '" + name + "'"};
      used.insert(name);
      auto program = Program::deserialize(program_bytes->second);
      if (!program) throw Malformed{"section '" + name + "' holds " + program.error().message};
      FamilyMember m{{}, std::move(*program)};
      const json& sizes = list(field(members[i], "sizes", at), at + ".sizes");
      for (std::size_t d = 0; d < sizes.size(); ++d)
        m.sizes.push_back(integer(sizes[d], at + ".sizes[" + std::to_string(d) + "]", 0, kMaxSize));
      const auto weights = pairs(field(members[i], "weights", at), at + ".weights");
      for (const auto& [id, k] : weights) {
        const std::string weight = "weight." + std::to_string(k);
        auto data = sections.find(weight);
        if (data == sections.end()) throw Malformed{at + ".weights names section '" + weight + "', which the file lacks"};
        used.insert(weight);
        if (!m.program.weights.emplace(id, std::string(data->second)).second)
          throw Malformed{at + ".weights names buffer " + std::to_string(id) + " twice"};
      }
      family.members.push_back(std::move(m));
    }
    for (const auto& [name, data] : sections)  // nothing in the file goes unchecked
      if (!used.count(name)) throw Malformed{"section '" + name + "' belongs to no member"};
  } catch (const Malformed& m) {
    return corrupt(m.what);
  } catch (const std::exception& e) {  // a safety net: the checks above leave nlohmann nothing to throw
    return corrupt(std::string("unexpected parse failure: ") + e.what());
  }
  if (auto ok = family.validate(); !ok) return corrupt("the stored family does not validate: " + ok.error().message);
  return family;
}

Result<void> ProgramFamily::save(const std::string& path) const {
  if (auto ok = validate(); !ok) return ok;
  static std::atomic<unsigned> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  const std::string data = serialize();
  bool written = false;
  if (std::ofstream out(tmp, std::ios::binary | std::ios::trunc); out) {
    out.write(data.data(), std::streamsize(data.size()));
    written = bool(out.flush());
  }
  std::error_code ec;
  if (written) fs::rename(tmp, path, ec);  // atomic in one folder: readers see the old file or the new one
  if (!written || ec) {
    fs::remove(tmp, ec);
    return fail(ErrorCode::IoError, "cannot write the family file '" + path + "' (through '" + tmp + "'): check that the "
                                    "folder exists and is writable, and that the disk has room");
  }
  return {};
}

Result<ProgramFamily> ProgramFamily::load(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return fail(ErrorCode::NotFound, "no family file at '" + path + "'");
  const std::uintmax_t size = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in) return fail(ErrorCode::IoError, "cannot open '" + path + "' for reading");
  std::string data;
  try {
    data.resize(size);
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::IoError, "'" + path + "' (" + std::to_string(size) + " bytes) does not fit in memory");
  }
  if (!in.read(data.data(), std::streamsize(size)))
    return fail(ErrorCode::IoError, "reading '" + path + "' failed (the file changed while it was read?)");
  auto family = deserialize(data);
  if (!family) {
    Error e = family.error();
    e.message = "'" + path + "' is " + e.message;
    return tl::unexpected(std::move(e));
  }
  return family;
}

}  // namespace stitchcuda::program
