// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The examples of docs/tensors.md, compiled and checked. Keep the two in step: each TEST_CASE here
// is one numbered example there.
#include <array>
#include <thread>
#include <vector>

#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

TEST_CASE("docs/tensors.md example 1: the global view", "[tensor][docs]") {
  using namespace meshlib;
  using mesh_t = mesh<axis<"data">, axis<"model">>;
  mesh_t m{2, 2};
  named_sharding<mesh_t, P<"data", "model">> s{m};

  std::vector<float> host(4 * 6);
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
  auto x = from_host(s, std::array<std::size_t, 2>{4, 6}, host);  // scatter

  // device 3 is (data 1, model 1): rows 2..3, columns 3..5
  CHECK(x.block_of(3).offset == std::array<std::size_t, 2>{2, 3});
  CHECK(x.local(3)(0, 0) == 15.0f);  // a Kokkos::View, row-major
  CHECK(x.to_host() == host);        // gather

  auto y = make_array_from_callback<int>(std::array<std::size_t, 2>{4, 6}, s,
                                         [](const std::array<std::size_t, 2>& g) { return static_cast<int>(g[0] * 10 + g[1]); });
  CHECK(y.to_host()[7] == 11);
  auto z = full(s, std::array<std::size_t, 2>{4, 6}, 1.5);
  CHECK(z.to_host()[23] == 1.5);
}

TEST_CASE("docs/tensors.md example 2: kernels in the global view", "[tensor][docs]") {
  using namespace meshlib;
  using mesh_t = mesh<axis<"data">, axis<"model">>;
  mesh_t m{2, 2};
  auto x = full(named_sharding<mesh_t, P<"data", "model">>{m}, std::array<std::size_t, 2>{4, 6}, 1.0f);
  auto w = full(named_sharding<mesh_t, P<"model">>{m}, std::array<std::size_t, 2>{6, 3}, 2.0f);

  auto y = x * 2.0f + 1.0f;  // same sharding as x
  auto r = sum<1>(y);        // P<"data">: the 'model' parts summed for you
  auto c = matmul(x, w);     // P<"data", "model"> . P<"model"> = P<"data">, contraction summed
  static_assert(std::is_same_v<decltype(r)::spec_type, P<"data">>);
  static_assert(std::is_same_v<decltype(c)::spec_type, P<"data">>);
  CHECK(r.to_host() == std::vector<float>(4, 18.0f));
  CHECK(c.to_host() == std::vector<float>(12, 12.0f));
}

TEST_CASE("docs/tensors.md example 3: the local view, one thread per device", "[tensor][docs]") {
  using namespace meshlib;
  using mesh_t = mesh<axis<"data">, axis<"model">>;
  mesh_t m{2, 2};
  auto x = full(named_sharding<mesh_t, P<"data", "model">>{m}, std::array<std::size_t, 2>{4, 6}, 1.0f);
  auto w = full(named_sharding<mesh_t, P<"model">>{m}, std::array<std::size_t, 2>{6, 3}, 2.0f);

  std::vector<std::vector<float>> partial_products(m.size());
  std::vector<std::thread> devices;
  for (std::size_t dev = 0; dev < m.size(); ++dev)
    devices.emplace_back([&, dev] {
      auto lx = x.local_value(dev);  // vary {'data', 'model'}
      auto lw = w.local_value(dev);  // vary {'model'}
      auto p = matmul(lx, lw);       // vary {'data'}, partial {'model'}: psum over 'model' completes it
      static_assert(decltype(p)::partial == mesh_t::mask_of<"model">());
      static_assert(decltype(p)::vary == mesh_t::mask_of<"data">());
      partial_products[dev].assign(p.data(), p.data() + p.size());
    });
  for (auto& t : devices) t.join();
  // the psum, by hand: devices 0 and 1 form the 'model' group of data row 0
  for (std::size_t i = 0; i < partial_products[0].size(); ++i) CHECK(partial_products[0][i] + partial_products[1][i] == 12.0f);
}

TEST_CASE("docs/tensors.md, writing a kernel: the public kernel face on device threads", "[tensor][docs]") {
  constexpr std::size_t n = 1000, devices = 4;
  std::vector<std::vector<float>> got(devices);
  std::vector<float> last(devices), first(devices);
  std::vector<std::thread> threads;
  for (std::size_t dev = 0; dev < devices; ++dev)
    threads.emplace_back([&, dev] {
      // Each device thread allocates and drops only its own blocks (the reference-count rule).
      meshlib::block_view<float, 1> in = meshlib::allocate<float, 1>({n}, "docs::in");
      const meshlib::block_view<float, 1> out = meshlib::allocate<float, 1>({n}, "docs::out");
      const meshlib::unmanaged_block_view<float, 1> view(out.data(), n);
      std::vector<float> host(n), stage;
      for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i + dev);
      CHECK(meshlib::read_back<meshlib::default_memory_space>(in.data() + 7) == 0.0f);  // zero-filled
      meshlib::copy_from_host<meshlib::default_memory_space>(in.data(), host.data(), n);
      float* y = out.data();
      const float* x = in.data();
      meshlib::launch<meshlib::default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { y[i] = 2 * x[i]; });
      got[dev].resize(n);
      meshlib::copy_to_host<meshlib::default_memory_space>(got[dev].data(), view.data(), n);
      last[dev] = meshlib::host_readable<meshlib::default_memory_space>(y, n, stage)[n - 1];
      meshlib::edit_on_host<meshlib::default_memory_space>(y, 1, stage, [](float* q) { q[0] = -1.0f; });
      first[dev] = meshlib::read_back<meshlib::default_memory_space>(y);
    });
  for (auto& t : threads) t.join();
  static_assert(meshlib::host_accessible_v<Kokkos::HostSpace>);
  for (std::size_t dev = 0; dev < devices; ++dev) {
    INFO("device " << dev);
    for (std::size_t i = 0; i < n; i += 111) CHECK(got[dev][i] == 2.0f * static_cast<float>(i + dev));
    CHECK(last[dev] == 2.0f * static_cast<float>(n - 1 + dev));
    CHECK(first[dev] == -1.0f);
  }
}

}  // namespace MESHLIB_TEST_UNIT
