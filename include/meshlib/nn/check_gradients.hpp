// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `check_gradients`: a hand-written backward pass checked against central finite
/// differences of the loss (`torch.autograd.gradcheck`, `jax.test_util.check_grads`), for a user's
/// own layer, loss or model, on one device or on a sharded mesh.
///
/// The loss is a function the checker runs on every device inside `spmd`: `loss(device, backward)`
/// returns the whole scalar loss (the same number on every device: psum the devices' shares), and
/// when `backward` is true it also runs the backward pass, which adds the gradients into the
/// parameters' gradient blocks (the checker zeroes them first). Every element `g` of every
/// parameter is then moved by `+eps` and `-eps` on every device that holds it, and
/// `(loss(+) - loss(-)) / (2 eps)` is compared with the gradient that *each* device holds for `g`
/// (block by block, so one wrong replica or one wrong shard is found), as `torch.allclose` does:
/// `|analytic - numeric| <= atol + rtol * |numeric|`.
///
/// A gradient that the backward leaves as a pending sum over an axis (each device of the data axis
/// holds its rows' share until the data-parallel synchronisation adds them) is compared after that
/// sum: name such axes in `reduce_axes` (JAX's old `grad(..., reduce_axes=)` meant the same).
///
/// Costs two loss evaluations per parameter element: meant for small layers and small shapes, in
/// double (float works with looser defaults; central differences in float lose about half its digits).
/// @code
/// // `layer`: a struct of one's own with forward, backward(dy, need_dx) and collect, in double;
/// // `x`: a sharded_tensor whose rows are split over "data"
/// auto r = meshlib::nn::check_gradients(m, layer, [&](std::size_t dev, bool backward) {
///   auto y = layer.forward(x.local_value(dev));
///   double part = 0;                                    // this device's rows' share of sum(y^2) / 2
///   for (double v : meshlib::to_host(y)) part += v * v / 2;
///   if (backward) layer.backward(y, false);             // the cotangent of sum(y^2) / 2 is y
///   meshlib::local_tensor<double, 0, mesh_t, mesh_t::mask_of<"data">()> share(std::array<std::size_t, 0>{}, m, dev);
///   share() = part;
///   return meshlib::psum<"data">(share)();              // the whole loss, on every device
/// }, {.reduce_axes = {"data"}});                         // weight gradients: shares over "data"
/// // throws nn::gradient_check_error naming the parameter, the element and both values when one is wrong
/// @endcode

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief A gradient that does not match central differences (`check_gradients` with
/// `raise_exception`): `what()` names the parameter, the element, the device, both values and the
/// tolerance.
class gradient_check_error : public error {
 public:
  using error::error;
};

/// @brief How `check_gradients` differentiates and compares; the defaults depend on the parameters'
/// element type `T` (`torch.autograd.gradcheck`'s for double; looser for float, whose central
/// differences keep about half its digits).
template <class T = double>
struct gradient_check_options {
  /// The central-difference step, added to and subtracted from one element at a time (> 0).
  double eps = std::is_same_v<T, float> ? 1e-3 : 1e-6;
  /// Absolute tolerance (>= 0): an element passes when `|analytic - numeric| <= atol + rtol * |numeric|`.
  double atol = std::is_same_v<T, float> ? 1e-3 : 1e-5;
  /// Relative tolerance (>= 0), see `atol`.
  double rtol = std::is_same_v<T, float> ? 1e-2 : 1e-3;
  /// Mesh axes over which the backward leaves each device a share of a gradient (a pending sum:
  /// the data axis, whose sum the data-parallel synchronisation of `train_step` does). Gradients are
  /// summed over these axes (where a parameter is not sharded over them) before the comparison.
  std::vector<std::string> reduce_axes = {};
  /// Throw `gradient_check_error` for the worst element out of tolerance (true, as torch's
  /// `raise_exception`); false: only report it in the result.
  bool raise_exception = true;
};

/// @brief What `check_gradients` found. The worst element is the one furthest outside its
/// tolerance (`|a - n| / (atol + rtol |n|)` largest), or, when all pass, closest to it.
struct gradient_check_result {
  /// Every element of every parameter within tolerance.
  bool passed = true;
  /// Largest `|analytic - numeric|` over every element and device.
  double max_abs_error = 0;
  /// Largest `|analytic - numeric| / max(|analytic|, |numeric|)` (0 where both are 0).
  double max_rel_error = 0;
  /// Elements out of tolerance (counted once per device that holds a wrong gradient).
  std::size_t failures = 0;
  /// Global elements checked, over every parameter.
  std::size_t elements = 0;
  /// The worst element's parameter name.
  std::string worst_parameter;
  /// The worst element's index in the global array, per dimension.
  std::vector<std::size_t> worst_index;
  /// The device whose gradient block held the worst element.
  std::size_t worst_device = 0;
  /// The worst element's gradient from the backward pass (summed over `reduce_axes`).
  double worst_analytic = 0;
  /// The worst element's central difference.
  double worst_numeric = 0;
};

namespace detail {

/// The element type of the parameters `model.collect` appends: double where it takes
/// `param_ref<double>`, else float.
template <class Model>
using collected_type_t =
    std::conditional_t<requires(Model& m, std::vector<param_ref<double>>& v) { m.collect(v); }, double, float>;

/// The options checked, and `reduce_axes` as a mask of `mesh`'s axes.
template <class T, mesh_type Mesh>
axis_mask checked_reduce_axes(const Mesh& mesh, const gradient_check_options<T>& o) {
  const std::string defaults = std::string(" (the defaults for ") + (std::is_same_v<T, float> ? "float" : "double") +
                               ": eps " + number_text(gradient_check_options<T>{}.eps) + ", atol " +
                               number_text(gradient_check_options<T>{}.atol) + ", rtol " +
                               number_text(gradient_check_options<T>{}.rtol) + ")";
  if (!(o.eps > 0) || !std::isfinite(o.eps))
    throw std::invalid_argument("meshlib::nn: check_gradients: eps is " + number_text(o.eps) +
                                "; the central-difference step must be positive and finite" + defaults);
  // A lambda called per tolerance, not a loop over a braced list of pairs: nvcc's front end (13.0)
  // does not parse `for (auto [n, v] : {std::pair<...>{...}, {...}})`.
  const auto check_tolerance = [&](const char* name, double v) {
    if (!(v >= 0) || !std::isfinite(v))
      throw std::invalid_argument("meshlib::nn: check_gradients: " + std::string(name) + " is " + number_text(v) +
                                  "; tolerances must be non-negative and finite" + defaults);
  };
  check_tolerance("atol", static_cast<double>(o.atol));
  check_tolerance("rtol", static_cast<double>(o.rtol));
  axis_mask mask = 0;
  for (const std::string& name : o.reduce_axes) {
    const std::size_t at = Mesh::find_axis(name);
    if (at == Mesh::ndim) {
      std::ostringstream os;
      os << mesh;
      throw std::invalid_argument("meshlib::nn: check_gradients: reduce_axes names '" + name + "', which " + os.str() +
                                  " does not have; name axes of the mesh (the data axis, whose gradient shares "
                                  "the data-parallel synchronisation adds)");
    }
    mask |= axis_mask{1} << at;
  }
  return mask;
}

/// The loss on every device, checked to be one number (what the finite difference differentiates).
template <mesh_type Mesh, class Loss>
double loss_on_every_device(const Mesh& mesh, Loss& loss, bool backward) {
  const auto values = meshlib::spmd(mesh, [&](std::size_t dev) {
    return std::optional<double>(static_cast<double>(loss(dev, backward)));
  });
  std::optional<std::size_t> first;
  for (std::size_t dev = 0; dev < values.size(); ++dev) {
    if (!values[dev]) continue;  // another process's device
    if (!first) {
      first = dev;
    } else if (!(*values[dev] == *values[*first]) && !(std::isnan(*values[dev]) && std::isnan(*values[*first]))) {
      throw std::invalid_argument("meshlib::nn: check_gradients: the loss is " + number_text(*values[*first]) +
                                  " on device " + std::to_string(*first) + " but " + number_text(*values[dev]) +
                                  " on device " + std::to_string(dev) +
                                  "; the loss function must return the whole loss on every device (psum the "
                                  "devices' shares over every axis they differ on)");
    }
  }
  return first ? *values[*first] : 0.0;
}

/// `[i, j]`: a global index as the messages print it.
inline std::string index_text(const std::vector<std::size_t>& index) {
  std::string s = "[";
  for (std::size_t d = 0; d < index.size(); ++d) s += (d ? ", " : "") + std::to_string(index[d]);
  return s + "]";
}

/// The global multi-index of row-major flat index `flat` in `shape`.
inline std::vector<std::size_t> unflatten(std::size_t flat, const std::vector<std::size_t>& shape) {
  std::vector<std::size_t> index(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return index;
}

}  // namespace detail

/// @brief Checks the gradients that `loss`'s backward pass leaves in `params` against central
/// differences of `loss` (see the file comment).
/// @param mesh the mesh `loss` runs on (inside `spmd`, one call per device).
/// @param params the parameters to check (`layer.collect(params)`; an input whose gradient is to
/// be checked can be an `nn::parameter` too, its cotangent added into its `grad` by the loss).
/// @param loss `loss(device, backward) -> double` (or `T`): the whole loss, the same on every
/// device; when `backward`, also adds d loss / d parameter into the gradient blocks.
/// @param options step, tolerances, reduced axes, whether to throw (see `gradient_check_options`).
/// @returns the largest errors and the worst element (see `gradient_check_result`).
/// @throws gradient_check_error when an element is out of tolerance and `options.raise_exception`.
/// @throws std::invalid_argument for bad options, no parameters, a parameter without a gradient,
/// a loss that is not the same number on every device or not finite at `params`.
template <class T, mesh_type Mesh, class Loss>
  requires std::floating_point<T> && std::invocable<Loss&, std::size_t, bool>
gradient_check_result check_gradients(const Mesh& mesh, const std::vector<param_ref<T>>& params, Loss&& loss,
                                      const gradient_check_options<T>& options = {}) {
  const axis_mask reduce = detail::checked_reduce_axes(mesh, options);
  if (params.empty())
    throw std::invalid_argument("meshlib::nn: check_gradients: no parameters to check; pass the parameters the "
                                "loss depends on (layer.collect(params))");
  for (const auto& p : params)
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0 && (p.grad.size() <= dev || p.grad[dev] == nullptr))
        throw std::invalid_argument("meshlib::nn: check_gradients: '" + p.name +
                                    "' has no gradient (a buffer, not a trained parameter); leave it out of the "
                                    "parameters to check");

  // The analytic gradients: zeroed, one backward, read back per device (host copies: the blocks
  // may be device memory). The loss evaluations below leave them alone.
  using space = default_memory_space;
  const auto block_of = [](const detail::device_blocks<T>& b, std::size_t dev, std::size_t n) {
    std::vector<T> host(n);
    meshlib::copy_to_host<space>(host.data(), b[dev], n);
    return host;
  };
  for (const auto& p : params)
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0) {
        const std::vector<T> zero(p.count[dev], T{0});
        meshlib::copy_from_host<space>(p.grad[dev], zero.data(), zero.size());
      }
  const double at = detail::loss_on_every_device(mesh, loss, true);
  if (!std::isfinite(at))
    throw std::invalid_argument("meshlib::nn: check_gradients: the loss is " + detail::number_text(at) +
                                " at the given parameters; check gradients where the loss is finite");

  gradient_check_result result;
  double worst_ratio = -1;
  for (const auto& p : params) {
    // Per device, the gradient after the sum over the reduced axes that do not split `p` (devices
    // of such a group hold the same block).
    const axis_mask summed = reduce & ~p.sharded_axes;
    std::vector<std::vector<T>> grads(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev)
      if (p.count[dev] > 0) grads[dev] = block_of(p.grad, dev, p.count[dev]);
    std::vector<std::vector<double>> analytic(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev) {
      if (p.count[dev] == 0) continue;
      analytic[dev].assign(p.count[dev], 0.0);
      for (std::size_t peer : mesh.group(dev, summed)) {
        if (grads[peer].size() != p.count[dev])
          throw std::invalid_argument("meshlib::nn: check_gradients: '" + p.name + "' is summed over reduce_axes, "
                                      "but device " + std::to_string(peer) + " of device " + std::to_string(dev) +
                                      "'s group is in another process; psum the gradient in the loss function and "
                                      "leave its axes out of reduce_axes");
        for (std::size_t i = 0; i < p.count[dev]; ++i) analytic[dev][i] += static_cast<double>(grads[peer][i]);
      }
    }
    // Where each global element lies: (device, index in its block) for every local device holding it.
    std::size_t total = 1;
    for (std::size_t e : p.shape) total *= e;
    std::vector<std::vector<std::pair<std::size_t, std::size_t>>> holders(total);
    std::vector<std::vector<T>> values(mesh.size());
    for (std::size_t dev = 0; dev < mesh.size(); ++dev) {
      if (p.count[dev] == 0) continue;
      values[dev] = block_of(p.value, dev, p.count[dev]);
      for (std::size_t i = 0; i < p.count[dev]; ++i) holders[detail::global_index(p, dev, i)].emplace_back(dev, i);
    }
    const auto set_everywhere = [&](std::size_t g, T v) {
      for (auto [dev, i] : holders[g]) meshlib::copy_from_host<space>(p.value[dev] + i, &v, 1);
    };
    for (std::size_t g = 0; g < total; ++g) {
      ++result.elements;
      if (holders[g].empty()) {
        // Held by another process only: its evaluations are still made here, since every process
        // must make the same sequence of collective calls (the loss's psum) or they would hang.
        static_cast<void>(detail::loss_on_every_device(mesh, loss, false));
        static_cast<void>(detail::loss_on_every_device(mesh, loss, false));
        continue;
      }
      const auto [dev0, i0] = holders[g].front();
      const T original = values[dev0][i0];
      // The step actually taken: x + eps and x - eps rounded to T (in float, not 2 eps).
      const T up = static_cast<T>(static_cast<double>(original) + options.eps);
      const T down = static_cast<T>(static_cast<double>(original) - options.eps);
      if (!(up > down))
        throw std::invalid_argument("meshlib::nn: check_gradients: eps " + detail::number_text(options.eps) +
                                    " does not move '" + p.name + "' at " +
                                    detail::index_text(detail::unflatten(g, p.shape)) + " (" +
                                    detail::number_text(original) + " in " +
                                    (std::is_same_v<T, float> ? "float" : "double") + "); take a larger eps");
      set_everywhere(g, up);
      const double loss_up = detail::loss_on_every_device(mesh, loss, false);
      set_everywhere(g, down);
      const double loss_down = detail::loss_on_every_device(mesh, loss, false);
      // Each copy back to its own value, exactly: no drift from adding and subtracting steps.
      for (auto [dev, i] : holders[g]) meshlib::copy_from_host<space>(p.value[dev] + i, &values[dev][i], 1);
      const double numeric = (loss_up - loss_down) / (static_cast<double>(up) - static_cast<double>(down));
      for (auto [dev, i] : holders[g]) {
        const double a = analytic[dev][i];
        const double err = std::abs(a - numeric), tol = options.atol + options.rtol * std::abs(numeric);
        const bool ok = err <= tol;  // false for NaN
        const double scale = std::max(std::abs(a), std::abs(numeric));
        // How far outside (or inside) its tolerance; a NaN or an error over a zero tolerance is infinitely far.
        double ratio = tol > 0 ? err / tol : 0.0;
        if (!ok && !(tol > 0 && std::isfinite(err))) ratio = std::numeric_limits<double>::infinity();
        if (!ok) {
          result.passed = false;
          ++result.failures;
        }
        // NaN, once met, stays: a NaN gradient must not read as a small error.
        if (std::isnan(err) || err > result.max_abs_error) result.max_abs_error = err;
        const double rel = scale > 0 ? err / scale : 0.0;
        if (std::isnan(rel) || rel > result.max_rel_error) result.max_rel_error = rel;
        if (ratio > worst_ratio) {
          worst_ratio = ratio;
          result.worst_parameter = p.name;
          result.worst_index = detail::unflatten(g, p.shape);
          result.worst_device = dev;
          result.worst_analytic = a;
          result.worst_numeric = numeric;
        }
      }
    }
  }
  if (!result.passed && options.raise_exception) {
    const auto worst = std::find_if(params.begin(), params.end(), [&](const auto& p) { return p.name == result.worst_parameter; });
    // A replicated parameter whose axis is not summed: the likely cause on a mesh is a data axis
    // missing from reduce_axes, not the backward.
    std::string hint;
    for (std::size_t i = 0; i < Mesh::ndim; ++i) {
      const axis_mask bit = axis_mask{1} << i;
      if (mesh.axis_size(i) > 1 && !(worst->sharded_axes & bit) && !(reduce & bit))
        hint += std::string(hint.empty() ? "" : ", ") + "'" + std::string(Mesh::axis_names[i]) + "'";
    }
    if (!hint.empty())
      hint = " (or, if each device of " + hint + " holds a share of the gradient, name it in reduce_axes)";
    using detail::number_text;
    throw gradient_check_error(
        "meshlib::nn: check_gradients: the gradient of '" + result.worst_parameter + "' at " +
        detail::index_text(result.worst_index) + " on device " + std::to_string(result.worst_device) + " is " +
        number_text(result.worst_analytic, 6) + " by the backward pass but " + number_text(result.worst_numeric, 6) +
        " by central differences (eps " + number_text(options.eps) + "): |difference| " +
        number_text(std::abs(result.worst_analytic - result.worst_numeric), 6) + " > atol " +
        number_text(options.atol) + " + rtol " + number_text(options.rtol) + " * |numeric|; " +
        std::to_string(result.failures) + " of " + std::to_string(result.elements) +
        " elements are out of tolerance; check the backward pass that writes '" + result.worst_parameter + "'" + hint);
  }
  return result;
}

/// @brief `check_gradients` of every parameter of `model` (a layer, `sequential`, or any type with
/// `collect(std::vector<param_ref<T>>&)`).
/// @returns / @throws as the overload taking the parameters.
template <mesh_type Mesh, class Model, class Loss, class T = detail::collected_type_t<Model>>
  requires requires(Model& m, std::vector<param_ref<T>>& v) { m.collect(v); } &&
           std::invocable<Loss&, std::size_t, bool>
gradient_check_result check_gradients(const Mesh& mesh, Model& model, Loss&& loss,
                                      const gradient_check_options<T>& options = {}) {
  std::vector<param_ref<T>> params;
  model.collect(params);
  return check_gradients(mesh, params, loss, options);
}

}  // namespace meshlib::nn
