// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Must NOT compile, for each MESHLIB_CASE (scripts/cuda_compile_check.sh checks the messages):
// three public entries whose kernels run on the GPU, each handed a block in host memory. Each is
// refused at compile time with one error naming the call and the argument (diagnostic::op<'x'>,
// op<'b'>, op<'l', 'o', ...>) and the fix (device_put), instead of a GPU kernel reading a host
// address (the first H200 run's cudaErrorIllegalAddress).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <vector>

namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
using device_rows = meshlib::local_tensor<float, 2, mesh_t>;  // CudaSpace: the default memory space here
using host_rows = meshlib::local_tensor<float, 2, mesh_t, 0, 0, meshlib::replicated_dims<2>, Kokkos::HostSpace>;

#if MESHLIB_CASE == 1
void layer_with_a_host_input(const mesh_t& m) {
  nn::dense<float, mesh_t> fc(m, "fc", 8, 8, nn::rng_key{1});
  const host_rows x({4, 8}, m, 0);
  (void)fc.forward(x);  // argument 'x'
}

#elif MESHLIB_CASE == 2
void zip_of_a_device_and_a_host_block(const mesh_t& m) {
  const device_rows a({4, 8}, m, 0);
  const host_rows b({4, 8}, m, 0);
  (void)meshlib::zip([](float u, float v) { return u + v; }, a, b);  // argument 'b'
}

#else
void loss_of_host_logits(const mesh_t& m) {
  nn::softmax_cross_entropy<float> loss(m);
  const host_rows logits({4, 8}, m, 0);
  const std::vector<std::int32_t> labels(4, 0);
  (void)loss.forward(logits, labels, 4);  // argument 'logits'
}
#endif
