// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): nn::value_and_grad through every local
// differentiable operation (shape operations, max, stop_gradient, sqrt and rsqrt included), a
// layer as a primitive and a loss written as forward code (function_loss), on device memory, so every forward and backward kernel of nn/autodiff/
// compiles for the GPU with nvcc. The one mesh axis is not used, so
// no collective runs (a host collective on device memory is refused: host_collective_on_device.cpp).
// Compiled for sm_90, not linked or run.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cstddef>
#include <span>

static_assert(!meshlib::host_accessible_v<meshlib::default_memory_space>,
              "the CUDA compile check must compile for device memory: Kokkos was not configured with CUDA");

namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
using rows_t = meshlib::local_tensor<float, 2, mesh_t>;  // in CudaSpace: the default memory space here

float differentiate(const mesh_t& m, const rows_t& x, const rows_t& w) {
  auto [loss, grads] = nn::value_and_grad<0, 1>([](const auto& a, const auto& b) {
    auto h = nn::maximum(nn::tanh(nn::matmul(a, nn::transpose(b))), 0.0f);
    auto z = nn::log(nn::exp(h) + 1.0f) * h / (nn::square(h) + 2.0f) - h * 0.5f;
    return nn::mean<0>(nn::sum<1>(-z + (1.0f - z) / 3.0f));
  })(x, w);
  nn::dense<float, mesh_t> fc(m, "fc", 8, 8, nn::rng_key{1});
  auto dx = nn::grad([&](const auto& a) { return nn::sum<0>(nn::sum<1>(nn::apply_layer(fc, a))); })(x);
  // the shape operations (tensor/reshape.hpp, tensor/slice.hpp) and their transposes
  auto ds = nn::grad([](const auto& a) {
    auto cut = nn::slice<1>(a, 1, 3);
    auto joined = nn::concatenate<1>(cut, nn::pad<1>(cut, 1, 0));
    return nn::sum<0>(nn::reshape(joined, std::array<std::size_t, 1>{joined.size()}));
  })(x);
  // a numerically safe softmax and an RMS norm: max, stop_gradient, sqrt, rsqrt
  auto dn = nn::grad([](const auto& a) {
    auto z = a - nn::broadcast_in_dim<1>(nn::stop_gradient(nn::max<1>(a)), a);
    auto p = nn::exp(z - nn::broadcast_in_dim<1>(nn::log(nn::sum<1>(nn::exp(z))), z));
    auto r = a * nn::broadcast_in_dim<1>(nn::rsqrt(nn::mean<1>(nn::square(a)) + 1e-5f), a);
    return nn::sum<0>(nn::sum<1>(p * r) + nn::sqrt(nn::sum<1>(nn::square(r)) + 1.0f));
  })(x);
  // a loss written as forward code (function_loss): its targets copied to the device, its
  // gradient copied into the caller's block (with a local lambda type as the loss: nvcc's limit on
  // extended lambdas in functions templated on local types)
  const auto mse = nn::function_loss([](const auto& z, const auto& t, std::size_t n) {
    return nn::sum<0>(nn::sum<1>(nn::square(z - t))) * (1.0f / static_cast<float>(n));
  });
  rows_t dz(std::array<std::size_t, 2>{x.extent(0), x.extent(1)}, m, x.device());
  const std::array<float, 64> targets{};
  const double l = mse(x, std::span<const float>(targets.data(), x.size()), 8, dz);
  return meshlib::to_host(loss)[0] + meshlib::to_host(std::get<0>(grads))[0] + meshlib::to_host(dx)[0] +
         meshlib::to_host(ds)[0] + meshlib::to_host(dn)[0] + static_cast<float>(l);
}
