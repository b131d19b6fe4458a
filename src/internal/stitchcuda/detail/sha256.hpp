// SHA-256 (src/core/sha256.cpp), for content-addressed cache keys, entry checksums and artifact sections.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace stitchcuda::detail {

/// Incremental SHA-256 (FIPS 180-4).
class Sha256 {
 public:
  Sha256();
  /// Adds bytes.
  Sha256& update(std::string_view data);
  /// Adds a length-prefixed field, so that ("ab","c") and ("a","bc") hash differently.
  Sha256& field(std::string_view data);
  /// The 32-byte digest; the object must not be updated afterwards.
  std::array<std::uint8_t, 32> digest();
  /// The digest as 64 lowercase hex characters.
  std::string hex();

 private:
  void block(const std::uint8_t* p);
  std::array<std::uint32_t, 8> h_;
  std::array<std::uint8_t, 64> buf_{};
  std::size_t buf_len_ = 0;
  std::uint64_t total_ = 0;
};

/// Hex SHA-256 of one string.
std::string sha256_hex(std::string_view data);

}  // namespace stitchcuda::detail
