// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A layer whose backward does not transpose its forward: its cotangent varies over "model" while its
// input does not. sequential::backward must refuse it at compile time.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;

struct bad_layer {
  template <class X>
  X forward(const X& x) { return x; }
  template <class DY>
  auto backward(const DY& dy, bool) { return meshlib::pvary<"model">(dy); }  // wrong: forward moved nothing
  void collect(std::vector<meshlib::nn::param_ref<float>>&) const {}
};

using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::sequential<bad_layer, meshlib::nn::dense<float, mesh_t>>& net, const x_t& x) {
  auto y = net.forward(x);
  net.backward<x_t>(y);
}

int main() {}
