// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// reshard: the plan chosen for each kind of transition (and its byte counts), and the property
// that resharding never changes the array: over random meshes (1 to 3 axes), shapes (uneven ones
// under shard_rule::uneven) and pairs of specs, every device's block of reshard(x) holds exactly
// the elements of the global array that its layout says, and to_host(reshard(x)) == to_host(x).
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives_support.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

using mesh1 = mesh<axis<"a">>;
using mesh2 = mesh<axis<"a">, axis<"b">>;
using mesh3 = mesh<axis<"a">, axis<"b">, axis<"c">>;

template <class... S>
struct spec_list {
  static constexpr std::size_t size = sizeof...(S);
};

using specs1 = spec_list<P<>, P<"a">, P<none, "a">>;
using specs2 = spec_list<P<>, P<"a">, P<"b">, P<none, "a">, P<"a", "b">, P<"b", "a">, P<axes("a", "b")>,
                         P<none, axes("b", "a")>>;
using specs3 = spec_list<P<>, P<"a">, P<"a", "b">, P<"b", "c">, P<axes("a", "b")>, P<none, axes("c", "a")>,
                         P<"c", axes("b", "a")>, P<axes("a", "b", "c")>>;

/// Every local block of `t` holds exactly the elements of `host` its layout gives it.
template <class X, class T>
bool blocks_match(const X& t, const std::vector<T>& host, std::string& why) {
  for (std::size_t dev = 0; dev < t.num_devices(); ++dev) {
    const auto b = t.block_of(dev);
    const auto& v = t.local(dev);
    if (tensor::detail::extents_of(v) != b.extent) {
      why = "device " + std::to_string(dev) + " has a block of the wrong shape";
      return false;
    }
    bool ok = true;
    tensor::detail::for_each_in_block(b, [&](std::size_t i, const auto& g) {
      if (v.data()[i] != host[tensor::detail::flat_index(t.global_shape(), g)]) ok = false;
    });
    if (!ok) {
      why = "device " + std::to_string(dev) + " holds a wrong element";
      return false;
    }
  }
  return true;
}

struct case_result {
  bool ok = true;
  std::string what;
};

/// One random case: mesh `m`, specs `From` -> `To`, a random shape fitting `rule`.
template <class Mesh, class From, class To>
case_result run_case(const Mesh& m, shard_rule rule, std::mt19937& rng) {
  using from_s = named_sharding<Mesh, From>;
  using to_s = named_sharding<Mesh, To>;
  const auto fd = collectives::detail::to_dyn_spec<from_s>(2), td = collectives::detail::to_dyn_spec<to_s>(2);
  std::array<std::size_t, 2> shape{};
  for (std::size_t d = 0; d < 2; ++d) {
    if (rule == shard_rule::even) {
      const std::size_t a = collectives::detail::dyn_shards(m, fd[d]), b = collectives::detail::dyn_shards(m, td[d]);
      std::size_t l = a;
      while (l % b) l += a;  // lcm
      shape[d] = l * std::uniform_int_distribution<std::size_t>(1, 2)(rng);
    } else {
      shape[d] = std::uniform_int_distribution<std::size_t>(1, 7)(rng);
    }
  }
  std::vector<float> host(shape[0] * shape[1]);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) + 0.5f;
  auto x = from_host(from_s{m, rule}, shape, host);
  const auto plan = plan_reshard<To>(x);
  auto y = reshard<To>(x);
  case_result r;
  std::string why;
  std::ostringstream os;
  os << m << " " << From{} << " -> " << To{} << " shape " << core::detail::describe_shape(shape)
     << (rule == shard_rule::uneven ? " uneven" : " even") << "\n" << plan;
  if (!blocks_match(y, host, why)) {
    r.ok = false;
    r.what = os.str() + "\n" + why;
  } else if (y.to_host() != host) {
    r.ok = false;
    r.what = os.str() + "\nto_host differs";
  }
  return r;
}

template <class Mesh, class List>
struct runner;
template <class Mesh, class... S>
struct runner<Mesh, spec_list<S...>> {
  using fn_t = case_result (*)(const Mesh&, shard_rule, std::mt19937&);
  static constexpr std::size_t n = sizeof...(S);
#if defined(MESHLIB_UNDER_TSAN) || defined(MESHLIB_TEST_FEWER_PAIRS)
  // Under ThreadSanitizer, and in the Kokkos 4 leg of scripts/run_tests.sh, each spec only once as
  // source and once as target (S_i -> S_i+1): the sanitizer looks for races in reshard's
  // communication, and the Kokkos 4 leg for what changes with the Kokkos version, which every pair
  // drives alike; the full cross product (137 instantiations of reshard) took a copy one to three
  // minutes to compile. The normal build runs every pair.
  template <std::size_t... I>
  static constexpr std::array<fn_t, n> make_cycle(std::index_sequence<I...>) {
    using all = std::tuple<S...>;
    return {&run_case<Mesh, std::tuple_element_t<I, all>, std::tuple_element_t<(I + 1) % n, all>>...};
  }
  static constexpr std::array<fn_t, n> cycle = make_cycle(std::make_index_sequence<n>{});
  static fn_t pick(std::size_t i, std::size_t) { return cycle[i]; }
#else
  template <class From>
  static constexpr std::array<fn_t, n> row{&run_case<Mesh, From, S>...};
  static constexpr std::array<std::array<fn_t, n>, n> table{row<S>...};
  static fn_t pick(std::size_t i, std::size_t j) { return table[i][j]; }
#endif
};

template <class Mesh, class List>
void property(std::size_t cases, std::uint32_t seed, std::size_t max_devices) {
  std::mt19937 rng(seed);
  constexpr std::size_t n = List::size;
  for (std::size_t k = 0; k < cases; ++k) {
    typename Mesh::coord_type sizes{};
    std::size_t total = 0;
    do {
      total = 1;
      for (auto& s : sizes) total *= (s = std::uniform_int_distribution<std::size_t>(1, 3)(rng));
    } while (total > max_devices);
    const Mesh m(sizes);
    const std::size_t i = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
    const std::size_t j = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
    const shard_rule rule = rng() % 3 == 0 ? shard_rule::uneven : shard_rule::even;
    const case_result r = runner<Mesh, List>::pick(i, j)(m, rule, rng);
    INFO(r.what);
    REQUIRE(r.ok);
  }
}

}  // namespace

TEST_CASE("reshard picks the cheap plan for each kind of transition", "[collectives][reshard][plan]") {
  mesh2 m{2, 4};
  std::vector<float> host(8 * 8, 1.0f);
  auto rows = from_host(named_sharding<mesh2, P<"a">>{m}, std::array<std::size_t, 2>{8, 8}, host);
  SECTION("shard -> replicate: one all_gather; each device sends its block to every peer") {
    const auto p = plan_reshard<P<>>(rows);
    CHECK(p.kinds() == std::vector<reshard_kind>{reshard_kind::all_gather});
    CHECK(p.max_bytes_sent() == 4 * 8 * sizeof(float) * 1);  // (4, 8) block, 1 peer on 'a'
    CHECK(p.to_string().find("all_gather over 'a' along dim 0") != std::string::npos);
  }
  SECTION("replicate -> shard: a local slice, no communication") {
    auto rep = from_host(named_sharding<mesh2, P<>>{m}, std::array<std::size_t, 2>{8, 8}, host);
    const auto p = plan_reshard<P<"b", "a">>(rep);
    CHECK(p.kinds() == std::vector<reshard_kind>{reshard_kind::local_slice});
    CHECK(p.communication_free());
    CHECK(p.max_bytes_sent() == 0);
  }
  SECTION("sharded on 'a' in dim 0 -> in dim 1: one all_to_all") {
    const auto p = plan_reshard<P<none, "a">>(rows);
    CHECK(p.kinds() == std::vector<reshard_kind>{reshard_kind::all_to_all});
    CHECK(p.max_bytes_sent() == 4 * 8 * sizeof(float) / 2);  // half the block leaves
  }
  SECTION("multi-axis: P<axes(a, b)> -> P<a, b>: all_to_all over 'b' only") {
    auto fs = from_host(named_sharding<mesh2, P<axes("a", "b")>>{m}, std::array<std::size_t, 2>{8, 8}, host);
    const auto p = plan_reshard<P<"a", "b">>(fs);
    CHECK(p.kinds() == std::vector<reshard_kind>{reshard_kind::all_to_all});
    CHECK(p.steps()[0].axis == 1);
  }
  SECTION("axes swap dimensions: gathers then a slice, never more than the array") {
    auto ab = from_host(named_sharding<mesh2, P<"a", "b">>{m}, std::array<std::size_t, 2>{8, 8}, host);
    const auto p = plan_reshard<P<"b", "a">>(ab);
    CHECK(p.steps().size() >= 2);
    CHECK(p.steps().back().kind == reshard_kind::local_slice);
  }
  SECTION("the example of docs/resharding.md: (8, 96) floats on 2 devices") {
    mesh1 m1{2};
    auto x = from_host(named_sharding<mesh1, P<"a", none>>{m1}, std::array<std::size_t, 2>{8, 96},
                       std::vector<float>(8 * 96, 0.0f));
    const auto p = plan_reshard<P<none, "a">>(x);
    CHECK(p.max_bytes_sent() == 768);
    CHECK(p.to_string().find("all_to_all over 'a' (split dim 1, concat dim 0) -> P<none, \"a\">") != std::string::npos);
  }
  SECTION("same spec: nothing to do") { CHECK(plan_reshard<P<"a">>(rows).empty()); }
  SECTION("uneven sizes: the general exchange") {
    auto u = from_host(named_sharding<mesh2, P<"a">>{m, shard_rule::uneven}, std::array<std::size_t, 2>{7, 5},
                       std::vector<float>(35, 2.0f));
    const auto p = plan_reshard<P<none, "b">>(u);
    CHECK(p.kinds() == std::vector<reshard_kind>{reshard_kind::exchange});
    CHECK(p.total_bytes_sent() > 0);
  }
}

TEST_CASE("reshard preserves the array: fixed cases with int64 and double", "[collectives][reshard]") {
  mesh2 m{2, 3};
  std::vector<std::int64_t> host(6 * 12);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::int64_t>(i * i) - 100;
  auto x = from_host(named_sharding<mesh2, P<"a", "b">>{m}, std::array<std::size_t, 2>{6, 12}, host);
  std::string why;
  auto y = reshard<P<"b", "a">>(x);
  CHECK(blocks_match(y, host, why));
  auto z = reshard<P<none, axes("b", "a")>>(y);
  CHECK(blocks_match(z, host, why));
  CHECK(reshard<P<>>(z).to_host() == host);
  std::vector<double> hd(5 * 4);
  for (std::size_t i = 0; i < hd.size(); ++i) hd[i] = 0.25 * static_cast<double>(i);
  auto u = from_host(named_sharding<mesh2, P<"b", "a">>{m, shard_rule::uneven}, std::array<std::size_t, 2>{5, 4}, hd);
  auto w = reshard<P<axes("a", "b")>>(u);
  CHECK(blocks_match(w, hd, why));
  // Into the even rule: reshard(x, sharding) with another rule.
  auto v = from_host(named_sharding<mesh2, P<"a">>{m, shard_rule::uneven}, std::array<std::size_t, 2>{6, 3},
                     std::vector<double>(hd.begin(), hd.begin() + 18));
  auto e = reshard(v, named_sharding<mesh2, P<"b">>{m});
  CHECK(e.sharding().rule() == shard_rule::even);
  CHECK(e.to_host() == std::vector<double>(hd.begin(), hd.begin() + 18));
}

TEST_CASE("reshard refuses a runner that runs devices the tensor does not hold here", "[collectives][reshard][errors]") {
  // This process's blocks of devices 2 and 3 of 4 (as under mpirun with 2 processes), resharded on
  // the default runner, which in a single process runs all four devices on threads.
  const mesh1 m{4};
  const std::vector<std::size_t> mine{2, 3};
  sharded_tensor<float, 2, named_sharding<mesh1, P<"a">>> x(named_sharding<mesh1, P<"a">>{m},
                                                             std::array<std::size_t, 2>{8, 2}, mine);
  CHECK(meshlib_test::message_of<sharding_error>([&] { (void)reshard<P<>>(x); }) ==
        "meshlib: reshard: the runner runs device 0 in this process, but the tensor holds no block of it here (it "
        "holds devices {2, 3}); pass the runner that runs the tensor's devices");
}

TEST_CASE("reshard property: random meshes, shapes and spec pairs round-trip exactly", "[collectives][reshard][property]") {
#if defined(MESHLIB_UNDER_TSAN)
  const std::size_t scale = 1;
#else
  const std::size_t scale = 4;
#endif
  SECTION("1 axis") { property<mesh1, specs1>(15 * scale, 11, 6); }
  SECTION("2 axes") { property<mesh2, specs2>(40 * scale, 22, 9); }
  SECTION("3 axes") { property<mesh3, specs3>(40 * scale, 33, 12); }
}

}  // namespace MESHLIB_TEST_UNIT
