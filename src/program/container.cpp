// The program layer's one container reader and writer (detail/container.hpp): the header, the manifest
// and its sha256-checked sections, the file read against its size and saved atomically, untrusted JSON
// read field by field, and programs stored side by side with their weights pooled.
#include <stitchcuda/detail/container.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include <stitchcuda/detail/sha256.hpp>

namespace stitchcuda::program::detail {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// Header integers are little-endian; this library builds for such hosts only.
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

}  // namespace

bool has_magic(const ContainerKind& kind, std::string_view bytes) noexcept {
  return bytes.size() >= sizeof(kind.magic) && std::memcmp(bytes.data(), kind.magic, sizeof(kind.magic)) == 0;
}

tl::unexpected<Error> corrupt(const ContainerKind& kind, const std::string& what) {
  return fail(ErrorCode::InvalidArgument, std::string(kind.invalid) + ": " + what);
}

std::string write_container(const ContainerKind& kind, json manifest,
                            const std::vector<std::pair<std::string, std::string_view>>& sections) {
  manifest["format"] = kind.format;
  manifest["version"] = kind.version;
  manifest["library"] = stitchcuda::version();
  json table = json::array();
  std::uint64_t offset = 0;
  for (const auto& [name, bytes] : sections) {
    table.push_back({{"name", name}, {"offset", offset}, {"size", bytes.size()}, {"sha256", stitchcuda::detail::sha256_hex(bytes)}});
    offset += bytes.size();
  }
  manifest["sections"] = std::move(table);
  const std::string text = manifest.dump(1);
  std::string out(kind.magic, sizeof(kind.magic));
  append(out, std::uint32_t(kind.version));
  append(out, std::uint64_t(text.size()));
  auto digest = stitchcuda::detail::Sha256().update(text).digest();
  out.append(reinterpret_cast<const char*>(digest.data()), digest.size());
  out.reserve(out.size() + text.size() + offset);
  out += text;
  for (const auto& section : sections) out += section.second;
  return out;
}

std::string_view Container::section(const std::string& name) const {
  auto it = sections.find(name);
  if (it == sections.end()) throw Malformed{"missing section '" + name + "'"};
  return it->second;
}

Result<Container> read_container(const ContainerKind& kind, std::string_view bytes) {
  if (bytes.size() < kContainerHeaderBytes)
    return corrupt(kind, "the file holds " + std::to_string(bytes.size()) + " bytes, fewer than the " +
                             std::to_string(kContainerHeaderBytes) + "-byte header (truncated?)");
  if (!has_magic(kind, bytes)) return corrupt(kind, std::string("wrong magic bytes (") + kind.wrong_magic + ")");
  if (auto v = read_at<std::uint32_t>(bytes, 8); v != kind.version)
    return corrupt(kind, "format version " + std::to_string(v) + " is not supported; this library reads version " +
                             std::to_string(kind.version) + " (re-export the " + kind.noun + " with a matching StitchCUDA)");
  const std::uint64_t manifest_size = read_at<std::uint64_t>(bytes, 12);
  if (manifest_size > bytes.size() - kContainerHeaderBytes || manifest_size > kMaxManifestBytes)
    return corrupt(kind, "the manifest claims " + std::to_string(manifest_size) + " bytes but only " +
                             std::to_string(bytes.size() - kContainerHeaderBytes) + " follow the header (truncated?)");
  const std::string_view manifest_text = bytes.substr(kContainerHeaderBytes, manifest_size);
  if (auto digest = stitchcuda::detail::Sha256().update(manifest_text).digest(); std::memcmp(bytes.data() + 20, digest.data(), digest.size()))
    return corrupt(kind, "the manifest's SHA-256 does not match (the file was modified or damaged)");
  std::string_view payload = bytes.substr(kContainerHeaderBytes + manifest_size);
  Container file;
  try {
    file.manifest = json::parse(manifest_text.begin(), manifest_text.end(), nullptr, /*allow_exceptions=*/false);
    if (file.manifest.is_discarded()) throw Malformed{"the manifest is not valid JSON"};
    Field manifest(file.manifest, "manifest");
    if (manifest["format"].text() != kind.format)
      throw Malformed{"manifest.format is not \"" + std::string(kind.format) + "\""};
    if (manifest["version"].integer() != kind.version)
      throw Malformed{"manifest.version differs from the header's format version"};
    // Sections follow one another in the manifest's order and fill the payload exactly: a gap, an overlap
    // or a trailing byte is damage. ("offset", where written, must say the same.)
    std::uint64_t at = 0;
    for (const Field& s : manifest["sections"].items()) {
      const std::string name = s["name"].text();
      const std::uint64_t size = s["size"].size();
      if (s.has("offset") && s["offset"].size() != at)
        throw Malformed{"section '" + name + "' claims offset " + std::to_string(s["offset"].size()) +
                        " but the sections before it end at " + std::to_string(at) + " (the file was modified or damaged)"};
      if (size > payload.size() - at)
        throw Malformed{"section '" + name + "' claims " + std::to_string(size) + " bytes but " +
                        std::to_string(payload.size() - at) + " remain (truncated?)"};
      const std::string_view data = payload.substr(at, size);
      if (stitchcuda::detail::sha256_hex(data) != s["sha256"].text())
        throw Malformed{"section '" + name + "' fails its SHA-256 check (the file was modified or damaged)"};
      if (!file.sections.emplace(name, data).second) throw Malformed{"section '" + name + "' appears twice"};
      at += size;
    }
    if (at != payload.size()) throw Malformed{std::to_string(payload.size() - at) + " bytes follow the last section"};
  } catch (const Malformed& m) {
    return corrupt(kind, m.what);
  }
  return file;
}

Result<std::string> read_container_file(const ContainerKind& kind, const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return fail(ErrorCode::NotFound, "no " + std::string(kind.noun) + " at '" + path + "'");
  const std::uintmax_t size = fs::file_size(path, ec);
  if (ec) return fail(ErrorCode::IoError, "cannot read the size of '" + path + "': " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(ErrorCode::IoError, "cannot open '" + path + "' for reading");
  // The header first: its manifest length is checked against the file's size, and held to what a manifest
  // can be, before anything the size of the file is allocated.
  std::string data(std::min<std::uintmax_t>(size, kContainerHeaderBytes), '\0');
  in.read(data.data(), std::streamsize(data.size()));
  if (std::uintmax_t(in.gcount()) != data.size()) return fail(ErrorCode::IoError, "reading '" + path + "' failed");
  if (data.size() == kContainerHeaderBytes) {
    const auto manifest_size = read_at<std::uint64_t>(data, 12);
    if (manifest_size > size - kContainerHeaderBytes || manifest_size > kMaxManifestBytes)
      return fail(ErrorCode::InvalidArgument, "'" + path + "' is " + kind.invalid + ": the manifest claims " +
                                                  std::to_string(manifest_size) + " bytes of a " + std::to_string(size) +
                                                  "-byte file (at most " + std::to_string(kMaxManifestBytes) + ")");
  }
  try {
    data.resize(size);
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::IoError, "'" + path + "' (" + std::to_string(size) + " bytes) does not fit in memory");
  }
  if (size > kContainerHeaderBytes) {
    in.read(data.data() + kContainerHeaderBytes, std::streamsize(size - kContainerHeaderBytes));
    if (std::uintmax_t(in.gcount()) != size - kContainerHeaderBytes)
      return fail(ErrorCode::IoError, "reading '" + path + "' failed (the file changed while it was read?)");
  }
  return data;
}

Result<void> write_file_atomically(const ContainerKind& kind, const std::string& path, const std::string& bytes) {
  static std::atomic<unsigned> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  bool written = false;
  if (std::ofstream out(tmp, std::ios::binary | std::ios::trunc); out) {
    out.write(bytes.data(), std::streamsize(bytes.size()));
    written = bool(out.flush());
  }
  std::error_code ec;
  if (written) fs::rename(tmp, path, ec);  // atomic within one folder
  if (!written || ec) {
    const std::string why = ec ? ec.message() : "check that the folder exists and is writable, and that the disk has room";
    fs::remove(tmp, ec);
    return fail(ErrorCode::IoError, "cannot write the " + std::string(kind.noun) + " '" + path + "' (through '" + tmp +
                                        "'): " + why);
  }
  return {};
}

// ---- Field ----

Field Field::operator[](const char* key) const {
  if (!j_.is_object()) throw Malformed{path_ + " is not an object"};
  auto it = j_.find(key);
  if (it == j_.end()) throw Malformed{"missing field '" + path_ + "." + key + "'"};
  return Field(*it, path_ + "." + key);
}

std::vector<Field> Field::items() const {
  if (!j_.is_array()) throw Malformed{path_ + " is not a list"};
  std::vector<Field> out;
  for (std::size_t i = 0; i < j_.size(); ++i) out.emplace_back(j_[i], path_ + "[" + std::to_string(i) + "]");
  return out;
}

std::vector<std::pair<std::string, Field>> Field::members() const {
  if (!j_.is_object()) throw Malformed{path_ + " is not an object"};
  std::vector<std::pair<std::string, Field>> out;
  for (auto it = j_.begin(); it != j_.end(); ++it) out.emplace_back(it.key(), Field(it.value(), path_ + "." + it.key()));
  return out;
}

std::int64_t Field::integer(std::int64_t lo, std::int64_t hi) const {
  if (!j_.is_number_integer()) throw Malformed{path_ + " is not an integer"};
  if (j_.is_number_unsigned() && j_.get<std::uint64_t>() > std::uint64_t(hi))
    throw Malformed{path_ + " = " + std::to_string(j_.get<std::uint64_t>()) + " is out of range"};
  const std::int64_t v = j_.get<std::int64_t>();
  if (v < lo || v > hi) throw Malformed{path_ + " = " + std::to_string(v) + " is out of range"};
  return v;
}

std::uint64_t Field::size() const {
  if (!j_.is_number_unsigned() && !(j_.is_number_integer() && j_.get<std::int64_t>() >= 0))
    throw Malformed{path_ + " is not a size"};
  return j_.get<std::uint64_t>();
}

double Field::number() const {
  if (j_.is_number()) return j_.get<double>();
  if (j_.is_string()) {
    const auto& s = j_.get_ref<const std::string&>();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
  }
  throw Malformed{path_ + " is not a number"};
}

bool Field::boolean() const {
  if (!j_.is_boolean()) throw Malformed{path_ + " is not true or false"};
  return j_.get<bool>();
}

std::string Field::text() const {
  if (!j_.is_string()) throw Malformed{path_ + " is not a string"};
  return j_.get<std::string>();
}

std::vector<std::int64_t> Field::integers() const {
  std::vector<std::int64_t> out;
  for (const Field& f : items()) out.push_back(f.integer());
  return out;
}

std::vector<BufferId> Field::ids() const {
  std::vector<BufferId> out;
  for (const Field& f : items()) out.push_back(f.u32());
  return out;
}

std::vector<std::pair<std::uint32_t, std::uint32_t>> Field::pairs() const {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
  for (const Field& f : items()) {
    auto two = f.items();
    if (two.size() != 2) throw Malformed{f.path() + " is not a pair [a, b]"};
    out.emplace_back(two[0].u32(), two[1].u32());
  }
  return out;
}

// ---- pooled programs ----

PooledPrograms pool_weights(const std::vector<const Program*>& programs) {
  // Each weight is compared with the pooled weights of its size (a byte compare, no second hash).
  PooledPrograms out;
  std::multimap<std::size_t, std::size_t> pool_by_size;
  for (const Program* p : programs) {
    json weights = json::array();
    for (const auto& [id, bytes] : p->weights) {
      std::optional<std::size_t> found;
      for (auto [it, end] = pool_by_size.equal_range(bytes.size()); it != end && !found; ++it)
        if (*out.pool[it->second] == bytes) found = it->second;
      if (!found) {
        found = out.pool.size();
        out.pool.push_back(&bytes);
        pool_by_size.emplace(bytes.size(), *found);
      }
      weights.push_back({id, *found});
    }
    Program stripped = *p;  // a copy, not field by field: a field added to Program is never lost
    stripped.weights.clear();
    out.programs.push_back(stripped.serialize());
    out.weights.push_back(std::move(weights));
  }
  return out;
}

void PooledPrograms::add_weight_sections(std::vector<std::pair<std::string, std::string_view>>& sections) const {
  for (std::size_t k = 0; k < pool.size(); ++k) sections.emplace_back("weight." + std::to_string(k), *pool[k]);
}

void require_all_used(const Container& file, const std::set<std::string>& used, const char* orphan) {
  for (const auto& [name, data] : file.sections)
    if (!used.count(name)) throw Malformed{"section '" + name + "' " + orphan};
}

Program read_pooled_program(const Container& file, const std::string& name, const Field& weights,
                            std::set<std::string>& used) {
  auto program = Program::deserialize(file.section(name));
  if (!program) throw Malformed{"section '" + name + "' holds " + program.error().message};
  used.insert(name);
  for (const auto& [id, k] : weights.pairs()) {
    const std::string weight = "weight." + std::to_string(k);
    auto data = file.sections.find(weight);
    if (data == file.sections.end())
      throw Malformed{weights.path() + " names section '" + weight + "', which the file lacks"};
    used.insert(weight);
    if (!program->weights.emplace(id, std::string(data->second)).second)
      throw Malformed{weights.path() + " names buffer " + std::to_string(id) + " twice"};
  }
  return std::move(*program);
}

}  // namespace stitchcuda::program::detail
