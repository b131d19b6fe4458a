// The container every program-layer file shares (a single program, a family, a prefill + decode pair):
// a 52-byte header (magic, version, manifest length, manifest SHA-256), a JSON manifest whose `sections`
// list tiles the payload with each section's size and SHA-256, then the sections; written atomically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <stitchcuda/error.hpp>
#include <stitchcuda/program.hpp>

namespace stitchcuda::program::detail {

/// One kind of file: its first 8 bytes, its version, its manifest's "format", and the words its errors use.
struct ContainerKind {
  char magic[8];
  std::uint32_t version;
  const char* format;       ///< manifest.format: "stitchcuda.program"
  const char* noun;         ///< "artifact", "family file": "no artifact at '...'", "re-export the artifact ..."
  const char* invalid;      ///< the errors' prefix: "not a valid .stitch artifact"
  const char* wrong_magic;  ///< why the magic is wrong and what to do: "not a .stitch file"
};

inline constexpr std::size_t kContainerHeaderBytes = 8 + 4 + 8 + 32;
/// A manifest is metadata; anything large (weights, CUBINs, programs) is a section.
inline constexpr std::uint64_t kMaxManifestBytes = 64ull << 20;

/// Whether `bytes` (8 suffice) start a file of `kind`.
bool has_magic(const ContainerKind& kind, std::string_view bytes) noexcept;

/// The file: header, then `manifest` (an object; "format", "version", "library" and "sections" are set
/// here), then the sections in order.
std::string write_container(const ContainerKind& kind, nlohmann::json manifest,
                            const std::vector<std::pair<std::string, std::string_view>>& sections);

/// A read container: the manifest (format and version checked) and every section (checksummed, tiling
/// the payload exactly, names unique), viewing the bytes given to read_container.
struct Container {
  nlohmann::json manifest;
  std::map<std::string, std::string_view> sections;
  /// The section called `name`; Malformed "missing section 'name'" when there is none.
  std::string_view section(const std::string& name) const;
};

/// Reads the header, manifest and section table; an InvalidArgument "<kind.invalid>: <what>" otherwise.
Result<Container> read_container(const ContainerKind& kind, std::string_view bytes);
/// kind.invalid + ": " + what, as an InvalidArgument: what a reader returns for a Malformed.
tl::unexpected<Error> corrupt(const ContainerKind& kind, const std::string& what);

struct Malformed;
/// read_container, then `read` (the Container to a T, throwing Malformed), then T's validate(): every
/// problem a corrupt(kind, ...); `what` names the value: "the stored <what> does not validate: ...".
template <class T, class Read>
Result<T> read_checked(const ContainerKind& kind, std::string_view bytes, const char* what, Read read);

/// A file's bytes, read after its header is checked against the file's size (so a damaged length never
/// allocates the size it claims): NotFound "no <noun> at '...'", IoError, or the header's InvalidArgument.
Result<std::string> read_container_file(const ContainerKind& kind, const std::string& path);
/// read_container_file, then `read` (a deserialize) on its bytes; the reader's error prefixed with the path:
/// "'<path>' is not a valid ...".
template <class Read>
auto load_container_file(const ContainerKind& kind, const std::string& path, Read read) -> decltype(read(std::string_view{})) {
  auto data = read_container_file(kind, path);
  if (!data) return tl::unexpected(data.error());
  auto value = read(std::string_view(*data));
  if (!value) {
    Error e = value.error();
    e.message = "'" + path + "' is " + e.message;
    return tl::unexpected(std::move(e));
  }
  return value;
}
/// Writes `bytes` to `path` through a temporary file in its folder, renamed over it: a reader sees the old
/// file or the new one, never a part.
Result<void> write_file_atomically(const ContainerKind& kind, const std::string& path, const std::string& bytes);
/// `value`'s validate(), then its serialize() written atomically: what every save() does.
template <class T>
Result<void> save_checked(const ContainerKind& kind, const std::string& path, const T& value) {
  if (auto ok = value.validate(); !ok) return tl::unexpected(ok.error());
  return write_file_atomically(kind, path, value.serialize());
}

// ---- reading untrusted JSON ----

/// A problem in a file, caught by the reader and returned as corrupt(kind, what).
struct Malformed {
  std::string what;
};

/// A cursor over untrusted JSON that names the path of whatever is wrong ("program.steps[1].grid[0]").
class Field {
 public:
  Field(const nlohmann::json& j, std::string path) : j_(j), path_(std::move(path)) {}

  Field operator[](const char* key) const;
  bool has(const char* key) const { return j_.is_object() && j_.contains(key); }
  std::vector<Field> items() const;
  std::vector<std::pair<std::string, Field>> members() const;
  std::int64_t integer(std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const;
  std::uint32_t u32() const { return std::uint32_t(integer(0, std::numeric_limits<std::uint32_t>::max())); }
  std::uint64_t size() const;
  /// A number, or "nan", "inf", "-inf" (JSON has none of them).
  double number() const;
  bool boolean() const;
  std::string text() const;
  std::vector<std::int64_t> integers() const;
  std::vector<BufferId> ids() const;
  /// A list of [a, b] pairs of unsigned 32-bit integers.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> pairs() const;
  bool is_null() const { return j_.is_null(); }
  const std::string& path() const { return path_; }
  /// An enum value by its to_string name.
  template <class E, std::size_t N>
  E choice(const E (&options)[N]) const {
    std::string s = text();
    for (E e : options)
      if (s == to_string(e)) return e;
    throw Malformed{path_ + " = \"" + s + "\" is not a known value"};
  }

 private:
  const nlohmann::json& j_;
  std::string path_;
};

template <class T, class Read>
Result<T> read_checked(const ContainerKind& kind, std::string_view bytes, const char* what, Read read) {
  auto file = read_container(kind, bytes);
  if (!file) return tl::unexpected(file.error());
  std::optional<T> value;
  try {
    value.emplace(read(*file));
  } catch (const Malformed& m) {
    return corrupt(kind, m.what);
  } catch (const std::exception& e) {  // a safety net: the readers' checks leave nlohmann nothing to throw
    return corrupt(kind, std::string("unexpected parse failure: ") + e.what());
  }
  if (auto ok = value->validate(); !ok)
    return corrupt(kind, std::string("the stored ") + what + " does not validate: " + ok.error().message);
  return std::move(*value);
}

// ---- programs stored side by side, each distinct weight once ----

/// Programs of one model (a family's members, a prefill and its decode) hold the same bytes for the same
/// parameter: each program as `.stitch` bytes without its weights, and every distinct weight once.
struct PooledPrograms {
  std::vector<std::string> programs;  ///< each program's bytes, weights left out
  std::vector<nlohmann::json> weights;  ///< per program: [[buffer id, pool index], ...]
  std::vector<const std::string*> pool;  ///< the distinct weights (pointing into the programs given)
  /// Adds "weight.<k>" sections for the pool to `sections`.
  void add_weight_sections(std::vector<std::pair<std::string, std::string_view>>& sections) const;
};
PooledPrograms pool_weights(const std::vector<const Program*>& programs);

/// Malformed "section 'x' <orphan>" for the first section of `file` not in `used`: nothing in a file goes
/// unchecked.
void require_all_used(const Container& file, const std::set<std::string>& used, const char* orphan);
/// The program in section `name` with the pooled weights `weights` ([[buffer id, pool index], ...]) lists;
/// records the sections it used in `used`. Malformed on any problem.
Program read_pooled_program(const Container& file, const std::string& name, const Field& weights,
                            std::set<std::string>& used);

}  // namespace stitchcuda::program::detail
