// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// local_tensor: the type-level facts (vary, partial, dims) and the handle over a block.
#include <array>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {
using namespace meshlib;
using mesh2 = mesh<axis<"data">, axis<"model">>;
using s_dm = named_sharding<mesh2, P<"data", "model">>;
using s_m = named_sharding<mesh2, P<none, "model">>;

using x_t = entry_local_t<float, 2, s_dm>;
static_assert(x_t::vary == 3u && x_t::partial == 0u);
static_assert(std::is_same_v<x_t::dims_type, dim_masks<1u, 2u>>);
using w_t = entry_local_t<double, 2, s_m>;
static_assert(w_t::vary == 2u && std::is_same_v<w_t::dims_type, dim_masks<0u, 2u>>);
static_assert(std::is_same_v<with_vary_t<x_t, 1u>, local_tensor<float, 2, mesh2, 1u, 0u, dim_masks<1u, 2u>>>);
static_assert(std::is_same_v<with_partial_t<with_vary_t<x_t, 1u>, 2u>,
                             local_tensor<float, 2, mesh2, 1u, 2u, dim_masks<1u, 2u>>>);
static_assert(std::is_same_v<with_value_t<x_t, int>::value_type, int>);
static_assert(std::is_same_v<remove_dim_t<dim_masks<1u, 2u, 4u>, 1>, dim_masks<1u, 4u>>);
static_assert(std::is_same_v<permute_dims_t<dim_masks<1u, 2u, 4u>, std::array<std::size_t, 3>{2, 0, 1}>, dim_masks<4u, 1u, 2u>>);
static_assert(std::is_same_v<replicated_dims<3>, dim_masks<0u, 0u, 0u>>);
static_assert(is_local_tensor_v<x_t> && !is_local_tensor_v<int>);
static_assert(std::is_same_v<sharded_tensor<float, 2, s_dm>::local_type, x_t>);
}  // namespace

TEST_CASE("local_value wraps the device's block without copying", "[tensor][local_tensor]") {
  mesh2 m{2, 2};
  s_dm s{m};
  std::vector<float> h(4 * 6);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<float>(i);
  auto x = from_host(s, std::array<std::size_t, 2>{4, 6}, h);
  auto l = x.local_value(3);  // data 1, model 1: rows 2..3, cols 3..5
  CHECK(l.device() == 3);
  CHECK(l.shape() == std::array<std::size_t, 2>{2, 3});
  CHECK(l.global_extent(0) == 4);
  CHECK(l.global_extent(1) == 6);
  CHECK(l(1, 2) == h[3 * 6 + 5]);
  l(0, 0) = -1.0f;
  CHECK(x.local(3)(0, 0) == -1.0f);
  CHECK(l.to_string() == "local_tensor<(2, 3) on device 3, vary {'data', 'model'}, partial {}>");
  local_tensor<int, 1, mesh2> z(std::array<std::size_t, 1>{5}, m, 2);
  for (std::size_t i = 0; i < 5; ++i) CHECK(z(i) == 0);
}

TEST_CASE("unmanaged views share data without touching the reference count", "[tensor][view]") {
  auto v = meshlib::tensor::detail::allocate<double, 2>({3, 4});
  const auto before = v.use_count();
  {
    auto u = meshlib::tensor::detail::unmanaged(v);
    auto u2 = u;
    CHECK(u2.data() == v.data());
    CHECK(u2.extent(1) == 4);
    CHECK(v.use_count() == before);
  }
  auto copy = v;
  CHECK(v.use_count() == before + 1);
}

}  // namespace MESHLIB_TEST_UNIT
