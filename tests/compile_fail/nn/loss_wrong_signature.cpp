// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A user-written loss without the gradient argument (it returns the value only): not a
// meshlib::nn::loss_function. One error from train_step naming the concept and the call it needs,
// not errors from inside the step.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstddef>
#include <span>
#include <vector>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

struct value_only_loss {
  using target_type = float;
  template <class Z>
  double operator()(const Z&, std::span<const float>, std::size_t) const {
    return 0;
  }
};

int main() {
  const mesh_t m{2, 1};
  nn::train_state state(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 8, 4, nn::rng_key{1})),
                        nn::sgd(nn::constant(0.1f)), {});
  std::vector<float> x(64), t(32);
  nn::train_step(state, std::span<const float>(x), t, 8, 0, 8, value_only_loss{});
}
