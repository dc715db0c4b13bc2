// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A user-written gradient transform that says how much state it needs but has no update: not a
// meshlib::nn::gradient_transform. One error from chain naming the concept, the missing member and
// the type, not errors from inside the optimizer or the train state.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstddef>

namespace nn = meshlib::nn;

struct scale_by_sign {
  std::size_t slots() const { return 0; }
  // void update(const nn::update_run&) const: forgotten
};

int main() {
  const nn::optimizer opt = nn::chain(nn::scale_by_adam(), scale_by_sign{}, nn::scale_by_learning_rate(1e-3f));
  return static_cast<int>(opt.slots());
}
