// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh): every layer of `nn` instantiated for device
// memory, forward and backward, so every kernel the layers launch compiles for the GPU with nvcc.
// The mesh has one axis that is neither a data nor a model axis, so no layer calls a collective
// here (a host collective on device memory is refused: host_collective_on_device.cpp). The layers
// that need one of those axes (batch_norm, embedding, attention, tied_head and the blocks made of
// them) come with the typed collectives on device memory (issue 24). Compiled for sm_90, not linked
// or run (no GPU in CI).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

static_assert(!meshlib::tensor::detail::host_accessible_v<meshlib::default_memory_space>,
              "the CUDA compile check must compile for device memory: Kokkos was not configured with CUDA");

namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
using rows_t = meshlib::local_tensor<float, 2, mesh_t>;  // in CudaSpace: the default memory space here

// forward, then backward of the forward's result: every kernel of the layer.
template <class Layer, class X>
void forward_backward(Layer& layer, const X& x) {
  auto y = layer.forward(x);
  (void)layer.backward(y);
}

void every_layer(const mesh_t& m, const rows_t& x) {
  const nn::rng_key key{1};
  nn::dense<float, mesh_t> fc(m, "fc", 8, 8, key);
  forward_backward(fc, x);
  nn::relu<float> relu(m);
  forward_backward(relu, x);
  nn::gelu<float> gelu(m);
  forward_backward(gelu, x);
  nn::dropout<float> drop(m, "drop", 0.1f);
  forward_backward(drop, x);
  nn::layer_norm<float, mesh_t> ln(m, "ln", 8);
  forward_backward(ln, x);
  nn::rms_norm<float, mesh_t> rms(m, "rms", 8);
  forward_backward(rms, x);
  const nn::image_shape img{4, 4, 2};
  nn::max_pool2d<float, mesh_t> mp(m, "mp", img, 2, 2);
  forward_backward(mp, x);
  nn::avg_pool2d<float, mesh_t> ap(m, "ap", img, 2, 2);
  forward_backward(ap, x);
  nn::global_avg_pool<float, mesh_t> gap(m, "gap", img);
  forward_backward(gap, x);
  for (auto algo : {nn::conv2d_algorithm::direct, nn::conv2d_algorithm::im2col}) {
    nn::conv2d<float, mesh_t> conv(m, "conv", img, 4, 3, key, {.padding = 1, .algorithm = algo});
    forward_backward(conv, x);
  }
  nn::conv2d<float, mesh_t> pointwise(m, "pw", img, 4, 1, key, {.stride = 2, .algorithm = nn::conv2d_algorithm::pointwise});
  forward_backward(pointwise, x);
  nn::positional_embedding<float, mesh_t> pos(m, "pos", 4, 8, 4, key);
  forward_backward(pos, x);
  auto res = nn::make_residual<float>(m, fc);
  forward_backward(res, x);
  // sequential's fused backward of a dense layer and its activation (basic_dense::backward_through).
  nn::sequential net(nn::dense<float, mesh_t>(m, "f1", 8, 8, key), nn::relu<float>(m),
                     nn::dense<float, mesh_t>(m, "f2", 8, 8, key), nn::gelu<float>(m));
  const auto out = net.forward(x);
  (void)net.backward<rows_t>(out, true);
}

int main() { return 0; }

// The kernels of the layers that need a data or model axis (their collectives come with issue 24),
// instantiated on their own for device memory.
using space = meshlib::default_memory_space;
template void nn::detail::channel_sums<space, float>(float*, const float*, const float*, std::size_t, std::size_t, float);
template void nn::detail::batch_statistics<space, float>(float*, float*, float*, float*, const float*, const float*,
                                                         std::size_t, float, float, float, float);
template void nn::detail::running_statistics<space, float>(float*, float*, const float*, const float*, std::size_t, float);
template void nn::detail::batch_normalize<space, float>(float*, float*, const float*, const float*, const float*,
                                                        const float*, const float*, std::size_t, std::size_t);
template void nn::detail::batch_grad_sums<space, float>(float*, const float*, const float*, std::size_t, std::size_t);
template void nn::detail::batch_param_grads<space, float>(float*, float*, const float*, std::size_t, float, float);
template void nn::detail::batch_norm_dx<space, float>(float*, const float*, const float*, const float*, const float*,
                                                      const float*, std::size_t, std::size_t, float);
template void nn::detail::batch_norm_dx_affine<space, float>(float*, const float*, const float*, const float*,
                                                             std::size_t, std::size_t);
template void nn::detail::split_heads<space, float>(float*, const float*, std::size_t, std::size_t, std::size_t);
template void nn::detail::unsplit_heads<space, float>(float*, const float*, std::size_t, std::size_t, std::size_t);
template void nn::detail::merge_heads<space, float>(float*, const float*, std::size_t, std::size_t, std::size_t);
template void nn::detail::unmerge_heads<space, float>(float*, const float*, std::size_t, std::size_t, std::size_t);
template void nn::detail::causal_softmax<space, float>(float*, std::size_t, std::size_t);
template void nn::detail::causal_softmax_backward<space, float>(const float*, float*, std::size_t, std::size_t, float);
template void nn::detail::lookup_rows<space, float>(float*, const float*, const std::int32_t*, std::size_t, std::size_t,
                                                    std::size_t, std::size_t);
template void nn::detail::scatter_add_rows<space, float>(float*, const float*, const std::int32_t*, std::size_t,
                                                         std::size_t, std::size_t, std::size_t);

// ---- What tests/cuda/nn_headers.cpp held (one nvcc translation unit fewer: the umbrella headers
// are parsed once for both).
// FSDP's one kernel of its own (nn/parallel/fsdp.hpp), instantiated for the device's memory space: its
// device lambda must compile with nvcc.
template void meshlib::nn::detail::add_values<meshlib::default_memory_space, float>(float*, const float*, std::size_t);

// The kernels whose result the host reads (issue 23): each writes into memory of the device's space
// and copies back, or copies the caller's host data across, so each compiles for device memory.
using cuda_mesh = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using cuda_rows = meshlib::local_tensor<float, 2, cuda_mesh>;  // in default_memory_space: CudaSpace here
using cuda_ids = meshlib::local_tensor<std::int32_t, 1, cuda_mesh>;
template double meshlib::nn::detail::sum_of_squares<meshlib::default_memory_space>(const std::size_t*, std::size_t, std::size_t,
                                                                                  double*);
template meshlib::nn::loss_part meshlib::nn::softmax_cross_entropy<float>::compute<cuda_rows>(
    const cuda_rows&, std::span<const std::int32_t>, std::size_t, float*, float*);
template meshlib::nn::loss_part meshlib::nn::mean_squared_error<float>::operator()<cuda_rows>(
    const cuda_rows&, std::span<const float>, std::size_t, cuda_rows&) const;
template void meshlib::nn::embedding<float, cuda_mesh>::check_ids(const std::int32_t*, std::size_t, std::size_t);

// Checkpoints and `nn::params` read and write blocks on the host through these two.
void staged_block_io(float* block, std::size_t n) {
  std::vector<float> stage;
  meshlib::tensor::detail::edit_on_host<meshlib::default_memory_space>(block, n, stage, [](float* host) { host[0] = 1.0f; });
  (void)meshlib::tensor::detail::host_readable<meshlib::default_memory_space>(block, n, stage);
}

// The optimizers' updates, loss scaling and the rounding into 16-bit compute types: the element-wise
// kernels of the training step (scalar lanes on the GPU; AVX lanes on the host).
void optimizer_updates(float* u, float* p, float* const* slots, std::size_t n) {
  namespace nn = meshlib::nn;
  const nn::optimizer opt = nn::chain(nn::clip_by_global_norm(1.0f), nn::scale_by_adam(), nn::scale_by_lion(),
                                      nn::trace{0.9f}, nn::add_decayed_weights(1e-4f), nn::scale_by_learning_rate(1e-3f));
  const std::size_t shape[1] = {n};
  opt.update(nn::update_run{u, p, std::span<float* const>(slots, opt.slots()), n, 0, 0, 0, 2.0, {"w", shape, true}});
  nn::detail::apply_updates(p, u, n);
}
// The multi-tensor update of a device's runs (one kernel over a run table) of the built-in optimizers.
void optimizer_updates_all(const meshlib::nn::update_run* runs, float* const* params, std::size_t n,
                           meshlib::nn::detail::run_table_buffers& tables, std::vector<std::size_t>& words) {
  namespace nn = meshlib::nn;
  for (const nn::optimizer& opt : {nn::adam(1e-3f), nn::adamw(1e-3f), nn::sgd(1e-2f)})
    opt.update_and_apply_all(nn::detail::update_batch{{runs, n}, {params, n}, &tables, &words, 0});
}
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
