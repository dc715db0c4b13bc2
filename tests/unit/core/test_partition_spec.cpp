// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#include <sstream>
#include <string>
#include <type_traits>

#include "meshlib/core.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {
template <class T>
std::string str(const T& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}
using mesh_2d = mesh<axis<"data">, axis<"model">>;
}  // namespace

TEST_CASE("partition specs are types: entries, trailing replication and printing", "[core][spec]") {
  using spec = P<"data", none, axes("model", "fsdp")>;
  STATIC_REQUIRE(spec::size == 3);
  STATIC_REQUIRE(spec::dim(0).axis(0) == "data");
  STATIC_REQUIRE(spec::dim(1).replicated());
  STATIC_REQUIRE(spec::dim(2).size() == 2);
  STATIC_REQUIRE(spec::dim(2).axis(0) == "model");
  STATIC_REQUIRE(spec::dim(2).axis(1) == "fsdp");
  STATIC_REQUIRE(spec::dim(7).replicated());
  STATIC_REQUIRE(spec::uses("fsdp"));
  STATIC_REQUIRE(!spec::uses("pipe"));
  STATIC_REQUIRE(spec::dim_of("fsdp") == 2);
  STATIC_REQUIRE(std::is_same_v<P<"data">, partition_spec<"data">>);
  STATIC_REQUIRE(!std::is_same_v<P<"data">, P<"model">>);
  STATIC_REQUIRE(!std::is_same_v<P<axes("a", "b")>, P<axes("b", "a")>>);
  CHECK(str(spec{}) == "P<\"data\", none, axes(\"model\", \"fsdp\")>");
  CHECK(str(P<>{}) == "P<>");
  CHECK(P<none, "x">::to_string() == "P<none, \"x\">");
}

TEST_CASE("named_sharding derives the axes a value varies over", "[core][sharding]") {
  using s = named_sharding<mesh_2d, P<none, "model">>;
  STATIC_REQUIRE(s::sharded_axes == mesh_2d::mask_of<"model">());
  STATIC_REQUIRE(s::replicated_axes == mesh_2d::mask_of<"data">());
  using both = named_sharding<mesh_2d, P<axes("model", "data")>>;
  STATIC_REQUIRE(both::sharded_axes == mesh_2d::all_axes);
  STATIC_REQUIRE(both::dim_axes(0)[0] == 1);
  STATIC_REQUIRE(both::dim_axes(0)[1] == 0);
  CHECK(describe_axes<mesh_2d>(mesh_2d::all_axes) == "{'data', 'model'}");
  CHECK(describe_axes<mesh_2d>(0) == "{}");

  const both sh{mesh_2d{2, 3}};
  CHECK(sh.num_shards(0) == 6);
  // 'model' is major in this spec: device (data=1, model=2) holds shard 2*2+1.
  CHECK(sh.shard_index(mesh_2d{2, 3}.device_at({1, 2}), 0) == 5);
  CHECK(str(sh) == "named_sharding(mesh{'data': 2, 'model': 3}, P<axes(\"model\", \"data\")>)");
}

}  // namespace MESHLIB_TEST_UNIT
