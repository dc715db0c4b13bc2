// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Element types a communicator moves and reduces: `float`, `double`, 32- and 64-bit signed
/// integers and `bfloat16`; the run-time tag `datatype` that describes them in descriptors, error
/// messages and backend mappings (`ncclDataType_t`, `MPI_Datatype`).

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string_view>
#include <type_traits>

namespace meshlib {

/// @brief A 16-bit brain floating-point number: the upper half of an IEEE `float` (8-bit exponent,
/// 7-bit mantissa). Arithmetic goes through `float`; conversion from `float` rounds to nearest
/// even, as NCCL's and PyTorch's `bfloat16` do, and keeps NaNs NaN.
struct bfloat16 {
  /// The raw bits: the upper 16 bits of the IEEE float32 value.
  std::uint16_t bits = 0;

  constexpr bfloat16() noexcept = default;
  /// Rounds `f` to the nearest bfloat16 (ties to even).
  constexpr bfloat16(float f) noexcept : bits(from_float(f)) {}  // NOLINT: implicit, as a float type
  /// Widens exactly to float.
  constexpr operator float() const noexcept {  // NOLINT: implicit, as a float type
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  /// A bfloat16 with exactly these bits.
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 r;
    r.bits = b;
    return r;
  }
  /// Bitwise equality (so that determinism tests can compare results bit for bit, NaNs included).
  [[nodiscard]] friend constexpr bool same_bits(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }
  /// Prints the value as its float.
  friend std::ostream& operator<<(std::ostream& os, bfloat16 b) { return os << static_cast<float>(b); }

 private:
  static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + rounding) >> 16);
  }
};
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// @brief Run-time tag of an element type.
enum class datatype : std::uint8_t { float32, float64, int32, int64, bfloat16 };

/// @brief "float32", "float64", "int32", "int64" or "bfloat16".
[[nodiscard]] constexpr std::string_view to_string(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return "float32";
    case datatype::float64: return "float64";
    case datatype::int32: return "int32";
    case datatype::int64: return "int64";
    case datatype::bfloat16: return "bfloat16";
  }
  return "unknown";
}
/// @brief Prints the datatype's name (`to_string`).
inline std::ostream& operator<<(std::ostream& os, datatype t) { return os << to_string(t); }

/// @brief Size in bytes of one element of type `t`.
[[nodiscard]] constexpr std::size_t size_of(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return 4;
    case datatype::float64: return 8;
    case datatype::int32: return 4;
    case datatype::int64: return 8;
    case datatype::bfloat16: return 2;
  }
  return 0;
}

namespace comm::detail {
template <class T>
consteval int datatype_index() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return static_cast<int>(datatype::float32);
  else if constexpr (std::is_same_v<U, double>) return static_cast<int>(datatype::float64);
  else if constexpr (std::is_same_v<U, bfloat16>) return static_cast<int>(datatype::bfloat16);
  // Any signed integer of 32 or 64 bits: int, long, long long and the <cstdint> aliases alike.
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 4) return static_cast<int>(datatype::int32);
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 8) return static_cast<int>(datatype::int64);
  else return -1;
}
}  // namespace comm::detail

/// @brief An element type that every communicator can send and reduce.
template <class T>
concept comm_element = (comm::detail::datatype_index<T>() >= 0);

/// @brief The run-time tag of element type `T`.
template <comm_element T>
inline constexpr datatype datatype_of = static_cast<datatype>(comm::detail::datatype_index<T>());

/// @brief Every element type, for loops in tests and benchmarks.
inline constexpr datatype all_datatypes[] = {datatype::float32, datatype::float64, datatype::int32, datatype::int64,
                                             datatype::bfloat16};

}  // namespace meshlib
