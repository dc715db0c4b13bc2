// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Property test of the layout law over every legal partition spec of ranks 1-4 on meshes of 1-3
// axes: for random axis sizes (1-4) and random shapes (with 0- and 1-sized dimensions), every element
// of the global array is held by exactly the devices an independent formula names, blocks of replicas
// agree, and local shapes assemble back into the global shape.
#include <array>
#include <cstddef>
#include <random>
#include <utility>
#include <vector>

#include "meshlib/core.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

namespace {

constexpr std::size_t max_axes = 3;

// One legal spec: for each dimension, the (ordered) mesh axes that split it.
template <std::size_t Rank>
struct spec_entry {
  std::array<std::array<std::size_t, max_axes>, Rank> ax{};
  std::array<std::size_t, Rank> count{};
};

// Every spec, exactly once: axes are placed one after the other, each either unused or inserted at
// any position of any dimension's list.
template <std::size_t Rank, std::size_t NumAxes>
constexpr std::size_t enumerate(spec_entry<Rank>* out) {
  std::size_t n = 0;
  auto rec = [&](auto&& self, spec_entry<Rank> e, std::size_t axis) -> void {
    if (axis == NumAxes) {
      if (out) out[n] = e;
      ++n;
      return;
    }
    self(self, e, axis + 1);
    for (std::size_t d = 0; d < Rank; ++d)
      for (std::size_t pos = 0; pos <= e.count[d]; ++pos) {
        spec_entry<Rank> f = e;
        for (std::size_t k = f.count[d]; k > pos; --k) f.ax[d][k] = f.ax[d][k - 1];
        f.ax[d][pos] = axis;
        ++f.count[d];
        self(self, f, axis + 1);
      }
  };
  rec(rec, spec_entry<Rank>{}, 0);
  return n;
}

template <std::size_t Rank, std::size_t NumAxes>
constexpr std::size_t num_specs = enumerate<Rank, NumAxes>(nullptr);

template <std::size_t Rank, std::size_t NumAxes>
constexpr auto all_specs = [] {
  std::array<spec_entry<Rank>, num_specs<Rank, NumAxes>> a{};
  enumerate<Rank, NumAxes>(a.data());
  return a;
}();

constexpr void push_axis(dim_spec& d, std::size_t axis) {
  if (axis == 0) d.push("a");
  if (axis == 1) d.push("b");
  if (axis == 2) d.push("c");
}

template <std::size_t Rank, std::size_t NumAxes, std::size_t I, std::size_t D>
constexpr dim_spec dim_of_spec = [] {
  dim_spec d;
  const auto& e = all_specs<Rank, NumAxes>[I];
  for (std::size_t k = 0; k < e.count[D]; ++k) push_axis(d, e.ax[D][k]);
  return d;
}();

template <std::size_t Rank, std::size_t NumAxes, std::size_t I, std::size_t... D>
auto spec_type_impl(std::index_sequence<D...>) -> partition_spec<dim_of_spec<Rank, NumAxes, I, D>...>;

template <std::size_t Rank, std::size_t NumAxes, std::size_t I>
using spec_t = decltype(spec_type_impl<Rank, NumAxes, I>(std::make_index_sequence<Rank>{}));

template <std::size_t NumAxes>
struct mesh_of;
template <>
struct mesh_of<1> {
  using type = mesh<axis<"a">>;
};
template <>
struct mesh_of<2> {
  using type = mesh<axis<"a">, axis<"b">>;
};
template <>
struct mesh_of<3> {
  using type = mesh<axis<"a">, axis<"b">, axis<"c">>;
};

struct counters {
  std::size_t layouts = 0;
  std::size_t elements = 0;
};

// What meshlib computed for one layout; the checks below run on it outside the per-spec template,
// so each of the ~440 spec types instantiates only meshlib's code.
template <std::size_t Rank>
struct computed {
  std::vector<block<Rank>> blocks;
  std::vector<std::vector<std::size_t>> replicas;
  std::array<std::size_t, Rank> assembled{};
  std::string spec;
};

template <std::size_t Rank, std::size_t NumAxes>
void check_layout(const spec_entry<Rank>& entry, const std::array<std::size_t, NumAxes>& sizes,
                  const std::array<std::size_t, Rank>& shape, shard_rule rule, const computed<Rank>& got,
                  counters& count) {
  ++count.layouts;
  std::size_t devices = 1;
  for (auto s : sizes) devices *= s;
  REQUIRE(got.blocks.size() == devices);
  // Independent formula: device -> coordinates, dimension -> number of shards and shard index.
  auto coords = [&](std::size_t dev) {
    std::array<std::size_t, NumAxes> c{};
    for (std::size_t i = NumAxes; i-- > 0;) {
      c[i] = dev % sizes[i];
      dev /= sizes[i];
    }
    return c;
  };
  std::size_t total = 1;
  for (auto s : shape) total *= s;
  for (std::size_t lin = 0; lin < total; ++lin) {
    std::array<std::size_t, Rank> g{};
    for (std::size_t d = Rank, rest = lin; d-- > 0;) {
      g[d] = rest % shape[d];
      rest /= shape[d];
    }
    std::vector<std::size_t> expected, owners;
    for (std::size_t dev = 0; dev < devices; ++dev) {
      const auto c = coords(dev);
      bool holds = true;
      for (std::size_t d = 0; d < Rank; ++d) {
        std::size_t index = 0, shards = 1;
        for (std::size_t k = 0; k < entry.count[d]; ++k) {
          index = index * sizes[entry.ax[d][k]] + c[entry.ax[d][k]];
          shards *= sizes[entry.ax[d][k]];
        }
        const std::size_t chunk = rule == shard_rule::even ? shape[d] / shards : (shape[d] + shards - 1) / shards;
        if (g[d] / chunk != index) holds = false;
      }
      if (holds) expected.push_back(dev);
      if (got.blocks[dev].contains(g)) owners.push_back(dev);
    }
    INFO("spec " << got.spec << " rule " << (rule == shard_rule::even ? "even" : "uneven") << " element " << lin);
    REQUIRE(!expected.empty());
    REQUIRE(owners == expected);
    REQUIRE(got.replicas[expected.front()] == expected);
    ++count.elements;
  }
  // Replicas hold identical blocks, and local shapes assemble into the global shape.
  for (std::size_t dev = 0; dev < devices; ++dev)
    for (auto r : got.replicas[dev]) REQUIRE(got.blocks[r] == got.blocks[dev]);
  REQUIRE(got.assembled == shape);
}

template <std::size_t Rank, std::size_t NumAxes, std::size_t I>
void check_spec(std::mt19937& rng, counters& count) {
  using mesh_t = typename mesh_of<NumAxes>::type;
  using sharding_t = named_sharding<mesh_t, spec_t<Rank, NumAxes, I>>;
  const auto& entry = all_specs<Rank, NumAxes>[I];
  std::uniform_int_distribution<std::size_t> axis_size(1, 4), small(0, 3), tiny(0, 2);

  for (int trial = 0; trial < 2; ++trial) {
    std::array<std::size_t, NumAxes> sizes{};
    for (auto& s : sizes) s = axis_size(rng);
    const mesh_t m{sizes};
    for (shard_rule rule : {shard_rule::even, shard_rule::uneven}) {
      std::array<std::size_t, Rank> shape{};
      for (std::size_t d = 0; d < Rank; ++d) {
        std::size_t shards = 1;
        for (std::size_t k = 0; k < entry.count[d]; ++k) shards *= sizes[entry.ax[d][k]];
        // Even: a multiple of the shard count (0, 1, 2 or 3 blocks' worth); uneven: anything small.
        shape[d] = rule == shard_rule::even ? shards * (Rank == 4 ? tiny(rng) : small(rng))
                                            : (Rank == 4 ? small(rng) : small(rng) + tiny(rng) * shards);
      }
      const sharding_t sharding{m, rule};
      const shard_layout<sharding_t, Rank> layout{sharding, shape};
      computed<Rank> got;
      std::vector<std::array<std::size_t, Rank>> locals;
      for (std::size_t dev = 0; dev < m.size(); ++dev) {
        got.blocks.push_back(layout.block_of(dev));
        got.replicas.push_back(layout.replicas(dev));
        locals.push_back(layout.local_shape(dev));
      }
      got.assembled = global_shape_from_locals<sharding_t, Rank>(sharding, locals);
      got.spec = sharding_t::spec_type::to_string();
      check_layout<Rank, NumAxes>(entry, sizes, shape, rule, got, count);
    }
  }
}

template <std::size_t Rank, std::size_t NumAxes, std::size_t... I>
void check_all(std::mt19937& rng, counters& count, std::index_sequence<I...>) {
  (check_spec<Rank, NumAxes, I>(rng, count), ...);
}

template <std::size_t Rank, std::size_t NumAxes>
void check_all(std::mt19937& rng, counters& count) {
  check_all<Rank, NumAxes>(rng, count, std::make_index_sequence<num_specs<Rank, NumAxes>>{});
}

}  // namespace

TEST_CASE("the enumeration covers every legal spec once", "[core][layout][property]") {
  // Counted by hand: k of the mesh's axes used, placed in order into Rank lists.
  STATIC_REQUIRE(num_specs<1, 1> == 2);
  STATIC_REQUIRE(num_specs<2, 2> == 1 + 2 * 2 + 2 * 3);
  STATIC_REQUIRE(num_specs<4, 3> == 1 + 3 * 4 + 3 * 4 * 5 + 4 * 5 * 6);
}

TEST_CASE("layout law over all legal specs, ranks 1-4, meshes of 1-3 axes", "[core][layout][property]") {
  std::mt19937 rng(20261130);
  counters count;
  check_all<1, 1>(rng, count);
  check_all<2, 1>(rng, count);
  check_all<3, 1>(rng, count);
  check_all<4, 1>(rng, count);
  check_all<1, 2>(rng, count);
  check_all<2, 2>(rng, count);
  check_all<3, 2>(rng, count);
  check_all<4, 2>(rng, count);
  check_all<1, 3>(rng, count);
  check_all<2, 3>(rng, count);
  check_all<3, 3>(rng, count);
  check_all<4, 3>(rng, count);
  CHECK(count.layouts == 4 * (2 + 3 + 4 + 5 + 5 + 11 + 19 + 29 + 16 + 49 + 106 + 193));
  CHECK(count.elements > 10000);
}

}  // namespace MESHLIB_TEST_UNIT
