// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A 5x5 kernel on 2x3 images without padding, with the sizes known at compile time: one error
// naming the rule and the fix (the constructor would throw the same at run time).
#include <meshlib/nn.hpp>

constexpr auto out = meshlib::nn::conv2d_output_shape<meshlib::nn::image_shape{2, 3, 1}, 4, 5>();

int main() { return static_cast<int>(out.size()); }
