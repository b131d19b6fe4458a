// stitchcuda::program::ProgramFamily — one verified Program per member size of a dynamic range (batch
// buckets 1, 2, 4, ..., or exact sizes built as they occur), the member choice for a call's sizes, and the
// family artifact. Pure data like program.hpp; FamilyExecutor (family_executor.hpp) runs a family.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <stitchcuda/error.hpp>
#include <stitchcuda/program.hpp>

namespace stitchcuda::program {

/// A dimension whose size varies between calls, within [min, max], and where the tensors carry it.
struct DynamicDim {
  std::string name;       ///< "batch", "seq": unique in its family, named by errors
  std::int64_t min = 1;   ///< smallest size served (>= 1)
  std::int64_t max = 1;   ///< largest size served (<= 2^31 - 1)
  /// A member of a larger size may serve a call: its inputs are zero-padded along this dim's axes and its
  /// outputs narrowed back. Right only where the positions along the dim do not mix (a batch of samples).
  bool pad = false;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> inputs;   ///< (input index, axis) carrying it
  std::vector<std::pair<std::uint32_t, std::uint32_t>> outputs;  ///< (output index, axis) carrying it
};

/// One program of a family and the sizes it was built for, one per dim in the family's order.
struct FamilyMember {
  std::vector<std::int64_t> sizes;
  Program program;
};

/// Programs that agree on everything but their dims' sizes; together they serve every size in range.
/// Inputs and outputs are counted in buffer-id order, as Executor::run takes them.
struct ProgramFamily {
  std::vector<DynamicDim> dims;
  std::vector<FamilyMember> members;

  /// The family file: its own magic and version; members stored as `.stitch` bytes without their
  /// weights, and every distinct weight once (members built from one model share all of them).
  std::string serialize() const;
  /// Reads family bytes: header, checksums, every field, each member's program, then validate().
  static Result<ProgramFamily> deserialize(std::string_view bytes);
  /// Writes the family file atomically (validates first).
  Result<void> save(const std::string& path) const;
  /// Reads and checks a family file written by save.
  static Result<ProgramFamily> load(const std::string& path);

  /// The dims (names, ranges, axes) and every member (its program, sizes, extents and dtypes, against the
  /// first member), members unique, and, when every dim pads, a member at the maximum to serve the whole
  /// range. Each problem is an InvalidArgument naming the field ("dims[1].max", "members[2].sizes[0]").
  Result<void> validate() const;
  /// Whether `member` may join this family (its program, sizes and layout; not a second member of the
  /// same sizes): what validate() checks of one member, for members added one at a time. Errors name it
  /// by the index it would take ("members[4].sizes[0]").
  Result<void> check_member(const FamilyMember& member) const;

  /// The sizes of a call whose inputs have these shapes (see call_sizes).
  Result<std::vector<std::int64_t>> sizes_of(const std::vector<std::vector<std::int64_t>>& input_shapes) const;
  /// The member that serves `sizes` (see select_member).
  Result<std::size_t> select(const std::vector<std::int64_t>& sizes) const;
  /// The members' sizes, in member order.
  std::vector<std::vector<std::int64_t>> member_sizes() const;
};

/// Family file format version written by this library.
inline constexpr std::uint32_t kFamilyArtifactVersion = 1;

/// Whether `bytes` (a file's first bytes: 8 suffice) start a family file rather than a `.stitch` program.
bool is_family_artifact(std::string_view bytes) noexcept;

/// The input and output specs of `program` in buffer-id order (the order run() takes them).
std::vector<const Buffer*> io_buffers(const Program& program, BufferRole role);

/// Each dim's size in a call: read from every (input, axis) the dim names, which must agree and lie in
/// [min, max]; every other extent must be `reference`'s (the first member's inputs). Errors name the dim,
/// the size and the range: "dim 'batch' is 300, outside 1..256: ...".
Result<std::vector<std::int64_t>> call_sizes(const std::vector<DynamicDim>& dims, const std::vector<TensorSpec>& reference,
                                             const std::vector<std::vector<std::int64_t>>& input_shapes);

/// The member (index into `member_sizes`) that serves `sizes`: the one with exactly those sizes; else,
/// when every dim where they differ pads, the one with all sizes >= the call's of the smallest padded
/// volume (the product of its sizes; the first such on a tie). An error names the sizes none serves.
Result<std::size_t> select_member(const std::vector<DynamicDim>& dims,
                                  const std::vector<std::vector<std::int64_t>>& member_sizes,
                                  const std::vector<std::int64_t>& sizes);

}  // namespace stitchcuda::program
