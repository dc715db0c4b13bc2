// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): the training layer's headers compile for
// device memory with nvcc. What does not work there yet is refused at compile time where it is
// instantiated (host-only losses, host collectives: see host_collective_on_device.cpp).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

int main() { return 0; }

// FSDP's one kernel of its own (nn/fsdp.hpp), instantiated for the device's memory space: its
// device lambda must compile with nvcc.
template void meshlib::nn::detail::add_values<meshlib::default_memory_space, float>(float*, const float*, std::size_t);

// conv2d's kernels (nn/detail/conv2d_kernels.hpp), instantiated for the device's memory space: the
// direct kernel's device form (its host vector lanes are compiled out under nvcc), im2col, col2im.
template void meshlib::nn::detail::direct_conv<meshlib::default_memory_space, float>(
    float*, const float*, const float*, const float*, meshlib::nn::detail::conv_geometry, std::size_t);
template void meshlib::nn::detail::im2col<meshlib::default_memory_space, float>(
    float*, const float*, meshlib::nn::detail::conv_geometry, std::size_t, std::size_t, float*, const float*);
template void meshlib::nn::detail::col2im<meshlib::default_memory_space, float>(
    float*, const float*, meshlib::nn::detail::conv_geometry, std::size_t);
template void meshlib::nn::detail::bias_rows<meshlib::default_memory_space, float>(float*, const float*, std::size_t,
                                                                                    std::size_t, std::size_t);
template void meshlib::nn::detail::direct_grad_w_rows<meshlib::default_memory_space, float>(
    float*, const float*, const float*, meshlib::nn::detail::conv_geometry, std::size_t);
template void meshlib::nn::detail::direct_grad_w_sum<meshlib::default_memory_space, float>(float*, const float*,
                                                                                            std::size_t, std::size_t, bool);
