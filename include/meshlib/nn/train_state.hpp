// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `train_state` (model parameters, optimizer state, step, random key: flax's `TrainState`)
/// and `train_step(state, batch)`, which a user calls in a loop as optax users do: forward and
/// backward over `accumulation` micro-batches, one bucketed data-parallel synchronisation, global-norm
/// clipping over every shard, and the optimizer update (replicated, or ZeRO-1 sharded over the data
/// axis), all on every device of the mesh at once.
///
/// The batch is the global batch (or this process's share of it, as `data_loader` gives it): device
/// `i` of the data axis takes rows `[i B/n, (i+1) B/n)`, replicated over the model axis.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), meshlib::nn::adam(meshlib::nn::constant(1e-3f)));
/// for (auto b = loader.next(); b; b = loader.next()) {
///   auto m = meshlib::nn::train_step(state, *b);   // m.loss: the mean loss over the global batch
/// }
/// @endcode

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/collectives/backend.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/exec/spmd.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/nn/grad_sync.hpp"
#include "meshlib/nn/loss.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"

namespace meshlib::nn {

/// @brief How `train_step` runs (see the file comment).
struct train_options {
  std::size_t accumulation = 1;            ///< micro-batches per step; one synchronisation per step
  bool zero = false;                       ///< ZeRO-1: optimizer state and update sharded over the data axis
  std::size_t bucket_elements = 1u << 20;  ///< most gradient elements per collective (0: one bucket)
};

namespace detail {
/// `P<Data>`: rows sharded over the data axis.
template <fixed_string Data>
struct rows_spec {
  using type = P<dim_spec(Data.chars)>;
};
}  // namespace detail

/// @brief What one `train_step` (or `evaluate`) reports; equal on every device.
struct step_metrics {
  double loss = 0;             ///< mean loss over the global batch
  std::size_t correct = 0;     ///< rows whose prediction was right
  std::size_t rows = 0;        ///< rows of the global batch
  double grad_norm = 0;        ///< global gradient norm before clipping (train_step)
  double sync_seconds = 0;     ///< time the first local device spent in the gradient synchronisation
};

/// @brief Parameters (inside `model`), optimizer state, step and key (see the file comment).
/// @tparam Data the data-parallel axis; @tparam Wire the gradient reduction's element type.
template <mesh_type Mesh, class Model, fixed_string Data = "data", comm_element Wire = float>
class train_state {
 public:
  using T = float;
  using mesh_type = Mesh;
  static constexpr axis_mask data_axes = Mesh::template mask_of<Data>();
  /// The type of a device's block of the input batch: rows sharded over `Data`.
  using input_type = entry_local_t<T, 2, named_sharding<Mesh, typename detail::rows_spec<Data>::type>>;

  Mesh mesh;
  Model model;
  optimizer opt;
  train_options options;
  std::size_t step = 0;
  rng_key key;
  std::vector<param_ref<T>> params;

  train_state(const Mesh& m, Model net, optimizer o, train_options opts = {}, rng_key k = {},
              std::span<const std::size_t> local_devices = {})
      : mesh(m),
        model(std::move(net)),
        opt(o),
        options(opts),
        key(k),
        sync_(m.size(), opts.bucket_elements),
        loss_(m.size()),
        state_(m.size()),
        gather_(m.size()) {
    model.collect(params);
    if (options.accumulation == 0) throw sharding_error("meshlib::nn: train_options: accumulation must be at least 1");
    std::vector<std::size_t> all;
    if (local_devices.empty())
      for (std::size_t d = 0; d < m.size(); ++d) all.push_back(d);
    else
      all.assign(local_devices.begin(), local_devices.end());
    local_ = all;
    const std::size_t dp = m.axes_size(data_axes);
    for (std::size_t dev : local_) {
      const std::size_t n = grad_sync<T, Wire>::flat_size(params, dev);
      const std::size_t len = options.zero ? (n + dp - 1) / dp : n;
      state_[dev].assign(opt.slots() * len, 0.0f);
    }
  }

  /// This process's devices.
  [[nodiscard]] const std::vector<std::size_t>& local_devices() const noexcept { return local_; }
  /// Elements of optimizer state held by device `dev` (the ZeRO saving shows here).
  [[nodiscard]] std::size_t optimizer_state_size(std::size_t dev) const { return state_.at(dev).size(); }
  [[nodiscard]] std::vector<float>& optimizer_state(std::size_t dev) { return state_.at(dev); }
  [[nodiscard]] const grad_sync<T, Wire>& sync() const noexcept { return sync_; }
  [[nodiscard]] softmax_cross_entropy<T>& loss() noexcept { return loss_; }

  /// Calls `f(param_index, offset_in_block, len, slot0, slot_stride)` for each run of optimizer
  /// state device `dev` holds: elements `[offset, offset + len)` of the parameter's local block;
  /// slot `s` of element `k` of the run is `slot0[s * slot_stride + k]`. Replicated: whole blocks;
  /// ZeRO-1: the pieces of this device's slice of the flat vector.
  template <class F>
  void for_each_state_run(std::size_t dev, F&& f) {
    const std::size_t n = grad_sync<T, Wire>::flat_size(params, dev);
    float* st = state_.at(dev).data();
    if (!options.zero) {
      std::size_t off = 0;
      for (std::size_t i = 0; i < params.size(); ++i) {
        f(i, std::size_t{0}, params[i].count[dev], st + off, n);
        off += params[i].count[dev];
      }
      return;
    }
    const std::size_t dp = mesh.axes_size(data_axes), size = (n + dp - 1) / dp, begin = mesh.group_rank(dev, data_axes) * size;
    std::size_t off = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) f(i, lo - off, hi - lo, st + (lo - begin), size);
      off += p.count[dev];
    }
  }
  /// Whether device `dev` is the one that writes parameter `p`'s optimizer state to a checkpoint
  /// (one device of each group holding the same state).
  [[nodiscard]] bool owns_state(std::size_t dev, const param_ref<T>& p) const {
    const axis_mask replicas = mesh.all_axes & ~p.sharded_axes & ~(options.zero ? data_axes : axis_mask{0});
    return mesh.group_rank(dev, replicas) == 0;
  }

  /// One device's share of a step after its backward passes: synchronise, clip, update.
  /// Returns the global gradient norm.
  double apply_gradients(std::size_t dev, double& sync_seconds) {
    const std::size_t dp = mesh.axes_size(data_axes);
    const auto t0 = std::chrono::steady_clock::now();
    auto& all = meshlib::detail::current_device("train_step").comm(mesh.all_axes);
    if (!options.zero) {
      T* g = sync_.all_reduce(params, dev, data_axes);
      sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // Global norm: a block replicated over some axes is counted on one device of that group.
      double sq[1] = {0};
      std::size_t off = 0;
      for (const auto& p : params) {
        if (mesh.group_rank(dev, mesh.all_axes & ~p.sharded_axes) == 0)
          for (std::size_t i = 0; i < p.count[dev]; ++i) sq[0] += static_cast<double>(g[off + i]) * g[off + i];
        off += p.count[dev];
      }
      all.all_reduce(sq, 1, datatype::float64, reduce_op::sum);
      const double norm = std::sqrt(sq[0]);
      const float scale = clip_scale(norm);
      const std::size_t n = off;
      float* m = state_[dev].data();
      float* v = opt.slots() > 1 ? m + n : m;
      off = 0;
      for (const auto& p : params) {
        opt.update(p.value[dev], g + off, m + off, v + off, p.count[dev], step, scale, p.decay);
        off += p.count[dev];
      }
      return norm;
    }
    const std::size_t rank = mesh.group_rank(dev, data_axes);
    std::size_t begin = 0, size = 0;
    T* g = sync_.reduce_scatter(params, dev, data_axes, dp, rank, begin, size);
    sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double sq[1] = {0};
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t, std::size_t s, std::size_t len) {
      if (mesh.group_rank(dev, mesh.all_axes & ~p.sharded_axes & ~data_axes) == 0)
        for (std::size_t i = 0; i < len; ++i) sq[0] += static_cast<double>(g[s + i]) * g[s + i];
    });
    all.all_reduce(sq, 1, datatype::float64, reduce_op::sum);
    const double norm = std::sqrt(sq[0]);
    const float scale = clip_scale(norm);
    float* m = state_[dev].data();
    float* v = opt.slots() > 1 ? m + size : m;
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t s, std::size_t len) {
      opt.update(p.value[dev] + in_param, g + s, m + s, v + s, len, step, scale, p.decay);
    });
    // all_gather the updated slices: every replica gets the whole updated flat parameter vector.
    T* send = gather_.get(dev, size * (dp + 1));
    T* recv = send + size;
    std::fill_n(send, size, T{});
    for_each_piece(dev, begin, size, [&](const param_ref<T>& p, std::size_t in_param, std::size_t s, std::size_t len) {
      std::copy_n(p.value[dev] + in_param, len, send + s);
    });
    const auto t1 = std::chrono::steady_clock::now();
    if (dp > 1) meshlib::detail::current_device("train_step").comm(data_axes).all_gather(send, recv, size, datatype_of<T>);
    else std::copy_n(send, size, recv);
    sync_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    std::size_t off = 0;
    for (const auto& p : params) {
      std::copy_n(recv + off, p.count[dev], p.value[dev]);
      off += p.count[dev];
    }
    return norm;
  }

 private:
  float clip_scale(double norm) const {
    return opt.clip_norm > 0 && norm > opt.clip_norm ? static_cast<float>(opt.clip_norm / norm) : 1.0f;
  }
  /// Calls `f(param, offset in param, offset in slice, length)` for the pieces of parameters that
  /// lie in the flat slice `[begin, begin + size)`.
  template <class F>
  void for_each_piece(std::size_t dev, std::size_t begin, std::size_t size, F&& f) const {
    std::size_t off = 0;
    for (const auto& p : params) {
      const std::size_t lo = std::max(off, begin), hi = std::min(off + p.count[dev], begin + size);
      if (lo < hi) f(p, lo - off, lo - begin, hi - lo);
      off += p.count[dev];
    }
  }

  grad_sync<T, Wire> sync_;
  softmax_cross_entropy<T> loss_;
  std::vector<std::vector<float>> state_;
  detail::device_buffers<T> gather_;
  std::vector<std::size_t> local_;
};

namespace detail {
template <class State>
void check_batch(const State& s, std::size_t global_rows, std::size_t groups, const char* what) {
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  if (global_rows == 0 || global_rows % (dp * groups) != 0)
    throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(global_rows) +
                         " rows does not split evenly over the " + std::to_string(dp) + " devices of the data axis" +
                         (groups > 1 ? " x " + std::to_string(groups) + " accumulation steps" : std::string()) +
                         "; choose a batch size that is a multiple of " + std::to_string(dp * groups));
}

/// Sums `(loss, correct)` over the data axis; every device gets the totals.
inline void sum_over(axis_mask axes, double (&v)[2]) {
  if (axes != 0) meshlib::detail::current_device("train_step").comm(axes).all_reduce(v, 2, datatype::float64, reduce_op::sum);
}
}  // namespace detail

/// @brief One training step on a global batch: `x` holds this process's `rows` rows (row-major,
/// `features` each) starting at row `global_offset` of a global batch of `global_rows` rows.
/// @throws sharding_error when the batch does not split over the data axis and the accumulation
/// steps, or when a device's rows are not in this process's share.
template <class State, class Backend = thread_backend>
step_metrics train_step(State& s, std::span<const float> x, std::span<const std::int32_t> y, std::size_t rows,
                        std::size_t global_offset, std::size_t global_rows, const Backend& backend = {}) {
  const std::size_t k = s.options.accumulation;
  detail::check_batch(s, global_rows, k, "train_step");
  const std::size_t features = rows == 0 ? 0 : x.size() / rows;
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  const std::size_t local_rows = global_rows / dp, micro = local_rows / k;
  using X = typename State::input_type;
  s.model.begin_step(s.key.fold_in(s.step), true);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        const std::size_t first = di * local_rows;
        if (first < global_offset || first + local_rows > global_offset + rows)
          throw sharding_error("meshlib::nn: train_step: device " + std::to_string(dev) + " needs rows [" +
                               std::to_string(first) + ", " + std::to_string(first + local_rows) +
                               ") of the global batch, but this process holds rows [" + std::to_string(global_offset) +
                               ", " + std::to_string(global_offset + rows) + ")");
        for (const auto& p : s.params) std::fill_n(p.grad[dev], p.count[dev], 0.0f);
        double sums[2] = {0, 0};
        for (std::size_t j = 0; j < k; ++j) {
          const std::size_t r0 = first + j * micro - global_offset;
          X xb(typename X::view_type(const_cast<float*>(x.data()) + r0 * features, micro, features), s.mesh, dev);
          auto logits = s.model.forward(xb);
          const loss_part part = s.loss().forward(logits, y.subspan(r0, micro), global_rows);
          s.model.template backward<X>(s.loss().backward(logits));
          sums[0] += part.loss;
          sums[1] += static_cast<double>(part.correct);
        }
        step_metrics& m = out[dev];
        m.grad_norm = s.apply_gradients(dev, m.sync_seconds);
        detail::sum_over(State::data_axes, sums);
        m.loss = sums[0];
        m.correct = static_cast<std::size_t>(sums[1] + 0.5);
        m.rows = global_rows;
      },
      backend);
  ++s.step;
  return out[s.local_devices().front()];
}

/// @brief `train_step` on a batch from `data_loader`.
template <class State, class Backend = thread_backend>
step_metrics train_step(State& s, const batch& b, const Backend& backend = {}) {
  return train_step(s, std::span<const float>(b.x), std::span<const std::int32_t>(b.y), b.rows, b.global_offset,
                    b.global_rows, backend);
}

/// @brief Loss and accuracy of the model on a whole data set (every process holds it), forward only,
/// in batches of `batch_rows` split over the data axis (a last, smaller batch is split unevenly).
template <class State, class Backend = thread_backend>
step_metrics evaluate(State& s, const dataset& ds, std::size_t batch_rows = 1000, const Backend& backend = {}) {
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  using X = typename State::input_type;
  s.model.begin_step(s.key, false);
  std::vector<step_metrics> out(s.mesh.size());
  meshlib::spmd(
      s.mesh,
      [&](std::size_t dev) {
        const std::size_t di = s.mesh.group_rank(dev, State::data_axes);
        double sums[2] = {0, 0};
        for (std::size_t start = 0; start < ds.count; start += batch_rows) {
          const std::size_t len = std::min(batch_rows, ds.count - start);
          const std::size_t lo = start + len * di / dp, hi = start + len * (di + 1) / dp;
          X xb(typename X::view_type(const_cast<float*>(ds.x.data()) + lo * ds.features, hi - lo, ds.features), s.mesh,
               dev);
          auto logits = s.model.forward(xb);
          const loss_part part = s.loss().forward(logits, std::span<const std::int32_t>(ds.y).subspan(lo, hi - lo), ds.count);
          sums[0] += part.loss;
          sums[1] += static_cast<double>(part.correct);
        }
        detail::sum_over(State::data_axes, sums);
        out[dev].loss = sums[0];
        out[dev].correct = static_cast<std::size_t>(sums[1] + 0.5);
        out[dev].rows = ds.count;
      },
      backend);
  return out[s.local_devices().front()];
}

}  // namespace meshlib::nn
