// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): the training layer's headers compile for
// device memory with nvcc. What does not work there yet is refused at compile time where it is
// instantiated (host collectives: see host_collective_on_device.cpp).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

int main() { return 0; }

// FSDP's one kernel of its own (nn/fsdp.hpp), instantiated for the device's memory space: its
// device lambda must compile with nvcc.
template void meshlib::nn::detail::add_values<meshlib::default_memory_space, float>(float*, const float*, std::size_t);

// The kernels whose result the host reads (issue 23): each writes into memory of the device's space
// and copies back, or copies the caller's host data across, so each compiles for device memory.
using cuda_mesh = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using cuda_rows = meshlib::local_tensor<float, 2, cuda_mesh>;  // in default_memory_space: CudaSpace here
using cuda_ids = meshlib::local_tensor<std::int32_t, 1, cuda_mesh>;
template double meshlib::nn::detail::sum_of_squares<meshlib::default_memory_space>(const float*, std::size_t, double*);
template meshlib::nn::loss_part meshlib::nn::softmax_cross_entropy<float>::compute<cuda_rows>(
    const cuda_rows&, std::span<const std::int32_t>, std::size_t, float*, float*);
template meshlib::nn::loss_part meshlib::nn::mean_squared_error<float>::operator()<cuda_rows>(
    const cuda_rows&, std::span<const float>, std::size_t, cuda_rows&) const;
template void meshlib::nn::embedding<float, cuda_mesh>::check_ids(const std::int32_t*, std::size_t, std::size_t);

// Checkpoints and `nn::params` read and write blocks on the host through these two.
void staged_block_io(float* block, std::size_t n) {
  std::vector<float> stage;
  meshlib::detail::edit_on_host<meshlib::default_memory_space>(block, n, stage, [](float* host) { host[0] = 1.0f; });
  (void)meshlib::detail::host_readable<meshlib::default_memory_space>(block, n, stage);
}

// The optimizers' updates, loss scaling and the rounding into 16-bit compute types: the element-wise
// kernels of the training step (scalar lanes on the GPU; AVX lanes on the host).
template void meshlib::nn::optimizer::update<meshlib::default_memory_space>(float*, const float*, float*, float*,
                                                                           std::size_t, std::size_t, float, bool) const;
template void meshlib::nn::detail::scale_in_place<meshlib::default_memory_space>(float*, std::size_t, float) noexcept;
template void meshlib::nn::detail::round_to<meshlib::bfloat16, meshlib::default_memory_space>(float*, std::size_t) noexcept;
template void meshlib::nn::detail::round_copy<meshlib::bfloat16, meshlib::default_memory_space>(float*, const float*,
                                                                                             std::size_t) noexcept;
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
