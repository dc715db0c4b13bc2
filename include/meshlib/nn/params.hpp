// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `params(state)`: the trained parameters read back, as flax's `state.params` and
/// `jax.device_get` give them: for each parameter of the model, in layer order, its name, global
/// shape and sharding, and its *global* values gathered from the devices' blocks into one
/// row-major host array. The values are the float master weights the optimizer updates (with a
/// 16-bit compute type the parameters' values are their rounding), what a checkpoint saves; so on
/// any mesh a parameter reads back the same array.
///
/// `state.params` (the `param_ref`s) are the per-device blocks themselves, for code that works
/// block by block; `params(state)` is the whole array, for reading, printing or exporting.
/// @code
/// for (const meshlib::nn::param_array& p : meshlib::nn::params(state))
///   std::printf("%s %s: first %g\n", p.name.c_str(), p.sharding.c_str(), p.values[0]);
/// const auto w = meshlib::nn::params(state)[0];   // e.g. "fc1.w", shape {784, 1024}
/// float w_ij = w.values[i * w.shape[1] + j];
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief One parameter read back to the host (see the file comment).
struct param_array {
  std::string name;                 ///< as the layer named it, e.g. "fc1.w"
  std::vector<std::size_t> shape;   ///< global shape
  std::string sharding;             ///< the printed named_sharding of its blocks
  std::vector<float> values;        ///< the global array, row-major (`product(shape)` values)
};

/// @brief Every parameter of `state`'s model, in layer order, gathered to the host (see the file
/// comment). Reads the blocks of this process's devices (copied to the host from device memory);
/// no communication.
/// @throws sharding_error when an element of a parameter is held only by devices of other
/// processes (a train state made with `local_devices` under several processes).
template <class State>
std::vector<param_array> params(const State& state) {
  std::vector<param_array> out;
  std::vector<float> stage;  // a block copied to the host (device memory only)
  out.reserve(state.params.size());
  for (std::size_t i = 0; i < state.params.size(); ++i) {
    const auto& p = state.params[i];
    param_array a{p.name, p.shape, p.sharding, {}};
    std::size_t total = 1;
    for (std::size_t e : p.shape) total *= e;
    a.values.assign(total, 0.0f);
    std::vector<bool> seen(total, false);
    std::size_t filled = 0;
    for (std::size_t dev : state.local_devices()) {
      const float* v = meshlib::host_readable<default_memory_space>(state.master(i, dev), p.count[dev], stage);
      detail::for_each_global_run(p, dev, 0, p.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
        std::copy_n(v + k, n, a.values.begin() + static_cast<std::ptrdiff_t>(g));
        filled += static_cast<std::size_t>(std::count(seen.begin() + static_cast<std::ptrdiff_t>(g),
                                                      seen.begin() + static_cast<std::ptrdiff_t>(g + n), false));
        std::fill_n(seen.begin() + static_cast<std::ptrdiff_t>(g), n, true);
      });
    }
    if (filled != total)
      throw sharding_error("meshlib::nn: params: " + std::to_string(total - filled) + " of the " +
                           std::to_string(total) + " elements of parameter '" + p.name +
                           "' are held only by devices of other processes (this process holds devices " +
                           meshlib::describe_devices(state.local_devices()) +
                           "); read them where every block is (a train state of every device), or save_checkpoint "
                           "and read its global files");
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace meshlib::nn
