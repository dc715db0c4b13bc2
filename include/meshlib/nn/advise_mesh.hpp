// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `advise_mesh`: which mesh shape, threads per device and gradient-sync overlap train a model
/// fastest on this many devices, measured.
///
/// Choosing the mesh shape matters more than most knobs ((4, 2) against (8, 1) can be 1.8x), and
/// the right one depends on the model, the batch and the machine, so the advisor measures instead
/// of modelling: it enumerates every factorisation of the device count over the mesh type's axes
/// (`mesh_shapes`), builds the model on each (a shape the model refuses, heads or vocabulary or
/// width not divisible by an axis, is kept as a row "not possible: <the library's message>"),
/// runs a few `train_step`s after a warm-up, and ranks the shapes by step time. Each shape is tried
/// with every threads-per-device count of `advise_options::threads_per_device` (by default 1 and,
/// where larger, the cores this process may run on divided by the devices: a device's products on
/// that many BLAS threads) and, where it has a "data" axis larger than 1 (and no "pipeline" axis
/// larger than 1, for a `sequential` model), with the gradient
/// synchronisation overlapped with the backward pass and not (`data_parallel::overlap`;
/// `advise_options::overlap`): one row per combination (a shape the library refuses: one row).
/// Each row also has samples per second, the share of the step spent in the gradient synchronisation
/// (`step_metrics::sync_seconds`; the psums inside tensor-parallel layers count as compute), and
/// the bytes per device: parameters, gradients and optimizer state (`train_state::memory`, the
/// largest over the devices) plus the step's peak of activation buffers
/// (`step_metrics::peak_activation_bytes`).
///
/// Axes: every axis of `Mesh` takes part, each shape trained with the policies its axes call for:
/// `advise_options::data_policy` over "data", `fsdp_policy` (`fully_shard<"fsdp">`) where the
/// "fsdp" axis is larger than 1, `pipeline_policy` (`pipeline<"pipeline">`, by default one
/// micro-batch per stage) where the "pipeline" axis is larger than 1, with the measured bubble in
/// its own column; the batch is split over "data" and "fsdp", and the layers' tensor parallelism
/// runs over the axis they name ("model" by default). A shape the pipeline
/// refuses (micro-batches that do not divide a device's rows, more stages than layers) is listed as
/// not possible with its reason.
/// @code
/// auto a = nn::advise_mesh<mesh_t>(8, [&](const mesh_t& m) { return make_gpt(m); }, batch);
/// std::cout << a.markdown();          // the ranked table
/// const mesh_t best = nn::make_mesh<mesh_t>(a.best);
/// @endcode

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/exec/available_cores.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parallel/data_parallel.hpp"
#include "meshlib/nn/parallel/fsdp.hpp"
#include "meshlib/nn/parallel/pipeline.hpp"
#include "meshlib/nn/parallel/policy.hpp"
#include "meshlib/nn/schedule.hpp"
#include "meshlib/nn/train/train_state.hpp"
#include "meshlib/tensor/matmul_into.hpp"

namespace meshlib::nn {

/// @brief The size of every axis of a mesh type, in mesh order (one candidate of the advisor).
struct mesh_shape {
  std::vector<std::string> axes;   ///< the mesh's axis names, in order
  std::vector<std::size_t> sizes;  ///< their sizes
  /// The size of axis `name` (1 when the mesh has no such axis).
  [[nodiscard]] std::size_t size(std::string_view name) const {
    for (std::size_t i = 0; i < axes.size(); ++i)
      if (axes[i] == name) return sizes[i];
    return 1;
  }
  /// The number of devices.
  [[nodiscard]] std::size_t devices() const {
    std::size_t n = 1;
    for (auto s : sizes) n *= s;
    return n;
  }
  /// `"(2, 4)"`: the sizes in mesh order.
  [[nodiscard]] std::string to_string() const {
    std::string s = "(";
    for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
    return s + ")";
  }
  /// `"2x4"`: the flagships' `--mesh` spelling.
  [[nodiscard]] std::string flag() const {
    std::string s;
    for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? "x" : "") + std::to_string(sizes[i]);
    return s;
  }
  /// Equal when the axes and their sizes are.
  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

/// @brief One shape's measurement (or why it cannot run).
struct advice_row {
  mesh_shape shape;  ///< the mesh shape measured
  std::size_t threads_per_device = 1;  ///< the BLAS threads of each device's products (`set_blas_threads_per_device`)
  bool overlap = false;                ///< `data_parallel::overlap` of the row
  /// Empty when the shape ran; else `"not possible: <reason>"` (the library's own message).
  std::string refused;
  double step_seconds = 0;        ///< median wall time of a timed step
  double samples_per_second = 0;  ///< rows (or windows) of the global batch per second
  double sync_share = 0;          ///< share of the timed steps in the gradient synchronisation
  double bubble = 0;              ///< the pipeline's measured idle share of the last step (0 without one)
  std::size_t state_bytes = 0;    ///< parameters + gradients + optimizer state (+ FSDP buffers), the largest device
  std::size_t activation_bytes = 0;  ///< the step's peak of activation buffers (first device)
  /// Whether the shape ran.
  [[nodiscard]] bool possible() const noexcept { return refused.empty(); }
  /// The estimate of a device's memory: state plus activations.
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return state_bytes + activation_bytes; }
};

/// @brief The advisor's answer: every shape, ranked (fastest first, equal step times in enumeration
/// order; shapes not possible last, in enumeration order), and the best one.
struct advice {
  std::vector<advice_row> rows;  ///< every shape, ranked
  mesh_shape best;               ///< the fastest shape that ran
  std::size_t best_threads_per_device = 1;  ///< its threads per device
  bool best_overlap = false;                ///< and whether its gradient sync overlapped the backward
  std::size_t devices = 0;       ///< the device count the shapes factorise
  std::size_t batch = 0;  ///< samples (rows or windows) of the global batch

  /// The ranked table in Markdown; a shape that is not possible has a short cell ("not possible,
  /// see below (1)") and its reason in a numbered list under the table (a reason is a sentence or
  /// two, too long for a cell).
  [[nodiscard]] std::string markdown() const {
    std::string axes;
    if (!rows.empty())
      for (std::size_t i = 0; i < rows.front().shape.axes.size(); ++i) axes += (i ? ", " : "") + rows.front().shape.axes[i];
    std::string s = "| rank | mesh (" + axes + ") | threads/device | overlap | step time | samples/s | sync share | bubble | memory per device |\n"
                    "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n";
    char buf[256];
    std::size_t rank = 0;
    std::string notes;
    std::size_t note = 0;
    for (const auto& r : rows) {
      if (r.possible()) {
        std::snprintf(buf, sizeof buf, "| %zu | %s | %zu | %s | %.2f ms | %.1f | %.0f%% | %.0f%% | %.2f MiB (%.2f state + %.2f activations) |\n",
                      ++rank, r.shape.to_string().c_str(), r.threads_per_device, r.overlap ? "on" : "off",
                      1e3 * r.step_seconds, r.samples_per_second,
                      100.0 * r.sync_share, 100.0 * r.bubble, static_cast<double>(r.memory_bytes()) / 1048576.0,
                      static_cast<double>(r.state_bytes) / 1048576.0, static_cast<double>(r.activation_bytes) / 1048576.0);
        s += buf;
      } else {
        const std::string n = std::to_string(++note);
        constexpr std::string_view prefix = "not possible: ";
        const std::string_view why = std::string_view(r.refused).starts_with(prefix)
                                         ? std::string_view(r.refused).substr(prefix.size())
                                         : std::string_view(r.refused);
        s += "| - | " + r.shape.to_string() + " | " + std::to_string(r.threads_per_device) + " | " +
             (r.overlap ? "on" : "off") + " | not possible, see below (" + n + ") | | | | |\n";
        notes += n + ". " + r.shape.to_string() + " is not possible: " + std::string(why) + "\n";
      }
    }
    if (!notes.empty()) s += "\nNot possible:\n\n" + notes;
    return s;
  }
};

/// @brief How `advise_mesh` measures (and, through `step_time`, what times it ranks by).
struct advise_options {
  std::size_t warmup_steps = 2;  ///< untimed steps first (allocation, caches)
  std::size_t timed_steps = 5;   ///< timed steps; the median is the step time
  optimizer opt = adam(constant(1e-3f));  ///< the optimizer of the timed steps
  train_options train = {};      ///< accumulation and loss scaling of every shape
  /// The data parallelism over "data" (its `overlap` set per row, see `overlap`).
  data_parallel<"data"> data_policy = {};
  fully_shard<"fsdp"> fsdp_policy = {};           ///< applied on a shape whose "fsdp" axis is larger than 1
  nn::pipeline<"pipeline"> pipeline_policy = {};  ///< applied on a shape whose "pipeline" axis is larger than 1
  std::vector<mesh_shape> only;  ///< measure only these shapes (empty: every factorisation)
  /// The threads per device to try on every shape; empty (the default): 1 and, where larger,
  /// `available_cores()` / the shape's devices.
  std::vector<std::size_t> threads_per_device;
  /// The `data_parallel::overlap` settings to try on a shape whose "data" axis is larger than 1
  /// and whose "pipeline" axis is not, for a `sequential` model (other shapes and models, and
  /// ZeRO-1, take `data_policy.overlap`); empty (the default): off and on.
  std::vector<bool> overlap;
  /// @brief The time the advisor records for one timed step; empty (the default): the step's measured
  /// wall time.
  ///
  /// Called after each timed step with the candidate (its `shape`, `threads_per_device` and `overlap`
  /// set; the measurements not yet), the step's index among the timed steps (0 to
  /// `timed_steps - 1`) and its measured wall time in seconds; returns the seconds to record. The
  /// ranking, `advice_row::step_seconds` and `samples_per_second` use what it returns; `sync_share`
  /// stays the measured synchronisation over the measured step times. A seam for callers who time
  /// otherwise (a device's own clock, a cost model) and for tests: the ranking is then a function
  /// of the times given, not of the machine's load.
  /// @code
  /// o.step_time = [](const nn::advice_row& c, std::size_t, double) { return c.shape.size("model") == 4 ? 0.01 : 0.02; };
  /// @endcode
  std::function<double(const advice_row& candidate, std::size_t step, double measured_seconds)> step_time;
};

/// @brief Every factorisation of `devices` over the axes of `Mesh`, in lexicographic order of the
/// sizes from the last axis to the first ((8, 1), (4, 2), (2, 4), (1, 8) for (data, model)).
/// A mesh type with static axis sizes keeps them.
template <mesh_type Mesh>
std::vector<mesh_shape> mesh_shapes(std::size_t devices) {
  constexpr std::size_t n = Mesh::ndim;
  std::vector<mesh_shape> out;
  std::array<std::size_t, n> sizes{};
  std::function<void(std::size_t, std::size_t)> place = [&](std::size_t axis, std::size_t left) {
    if (axis == 0) {
      sizes[0] = left;
      if (Mesh::static_sizes[0] != dynamic_extent && Mesh::static_sizes[0] != left) return;
      mesh_shape s;
      for (std::size_t i = 0; i < n; ++i) {
        s.axes.emplace_back(Mesh::axis_names[i]);
        s.sizes.push_back(sizes[i]);
      }
      out.push_back(std::move(s));
      return;
    }
    for (std::size_t k = 1; k <= left; ++k)
      if (left % k == 0 && (Mesh::static_sizes[axis] == dynamic_extent || Mesh::static_sizes[axis] == k)) {
        sizes[axis] = k;
        place(axis - 1, left / k);
      }
  };
  if (devices > 0) place(n - 1, devices);
  return out;
}

/// @brief The mesh of type `Mesh` with the sizes of `s`.
/// @throws mesh_error when `s` is not a shape of this mesh type (other axes, a static size differs).
template <mesh_type Mesh>
Mesh make_mesh(const mesh_shape& s) {
  typename Mesh::coord_type sizes{};
  if (s.sizes.size() != Mesh::ndim)
    throw mesh_error("meshlib::nn: make_mesh: the shape " + s.to_string() + " has " + std::to_string(s.sizes.size()) +
                     " axes, the mesh type " + std::to_string(Mesh::ndim));
  for (std::size_t i = 0; i < Mesh::ndim; ++i) sizes[i] = s.sizes[i];
  return Mesh(sizes);
}

namespace detail {
/// The train state of `make_model`'s `net` on a shape `shape` of `mesh`, with the policies its axes
/// call for (see `advise_mesh`), added one `Stage` at a time (data, fsdp, pipeline): the policies'
/// set is a compile-time list, the shape's sizes are known at run time.
/// @throws sharding_error for an fsdp or pipeline axis larger than 1 and a model that is not a
/// `sequential` (the policies' units are its layers), as the train state's constructor otherwise.
template <int Stage, class Mesh, class Model, class... Ps>
train_state<Mesh, Model> advised_state(const Mesh& mesh, Model& net, const advise_options& o, const mesh_shape& shape,
                                       bool overlap, const Ps&... ps) {
  // Whether the shape's `axis` calls for `policy` (larger than 1), which needs a sequential model.
  const auto wanted = [&](std::string_view axis, std::string_view policy) {
    if (shape.size(axis) <= 1) return false;
    if constexpr (!sequential_model<Model>)
      throw sharding_error("meshlib::nn: advise_mesh: the shape's '" + std::string(axis) + "' axis is larger than 1 "
                           "and " + std::string(policy) + " needs a sequential model (its layers); wrap the layers "
                           "in nn::sequential or keep the axis at size 1 (advise_options::only)");
    return true;
  };
  if constexpr (Stage == 0) {
    if constexpr (Mesh::template has_axis<"data">) {
      data_parallel<"data"> dp = o.data_policy;
      dp.overlap = overlap;
      return advised_state<1>(mesh, net, o, shape, overlap, dp);
    } else {
      return advised_state<1>(mesh, net, o, shape, overlap);
    }
  } else if constexpr (Stage == 1) {
    if constexpr (Mesh::template has_axis<"fsdp">)
      if (wanted("fsdp", "fully_shard"))
        if constexpr (sequential_model<Model>) return advised_state<2>(mesh, net, o, shape, overlap, ps..., o.fsdp_policy);
    return advised_state<2>(mesh, net, o, shape, overlap, ps...);
  } else if constexpr (Stage == 2) {
    if constexpr (Mesh::template has_axis<"pipeline">)
      if (wanted("pipeline", "pipeline"))
        if constexpr (sequential_model<Model>)
          return advised_state<3>(mesh, net, o, shape, overlap, ps..., o.pipeline_policy);
    return advised_state<3>(mesh, net, o, shape, overlap, ps...);
  } else if constexpr (sizeof...(Ps) == 0) {
    return train_state<Mesh, Model>(mesh, std::move(net), o.opt, o.train);
  } else {
    return train_state<Mesh, Model>(mesh, std::move(net), o.opt, o.train, ps...);
  }
}

/// Samples of a global batch: rows of a `batch`, windows of a `token_batch`.
inline std::size_t samples_of(const batch& b) { return b.global_rows; }
inline std::size_t samples_of(const token_batch& b) { return b.rows; }

/// A library message without its `meshlib::nn: ` / `meshlib: ` prefix (the table says who refused).
inline std::string without_prefix(std::string_view m) {
  for (std::string_view p : {std::string_view("meshlib::nn: "), std::string_view("meshlib: ")})
    if (m.substr(0, p.size()) == p) return std::string(m.substr(p.size()));
  return std::string(m);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}
}  // namespace detail

/// @brief Measures `train_step` of `make_model(mesh)` on `batch` (a global `batch` or a
/// `token_batch`) for every shape of `devices` devices over `Mesh`'s axes (or `o.only`) and
/// ranks them (see the file comment). Runs on this process's thread devices.
/// @throws sharding_error when `devices` is 0 or no shape is possible (the message lists every
/// shape's reason); what the model or a step throws otherwise (a library `meshlib::error` is a
/// refusal of that shape, anything else a bug that propagates).
template <mesh_type Mesh, class Factory, class Batch>
advice advise_mesh(std::size_t devices, Factory&& make_model, const Batch& batch, const advise_options& o = {}) {
  using model_type = std::remove_cvref_t<std::invoke_result_t<Factory&, const Mesh&>>;
  if (devices == 0) throw sharding_error("meshlib::nn: advise_mesh: 0 devices; give the number of devices to split over");
  advice a;
  a.devices = devices;
  a.batch = detail::samples_of(batch);
  const std::vector<mesh_shape> shapes = o.only.empty() ? mesh_shapes<Mesh>(devices) : o.only;
  std::vector<advice_row> candidates;
  for (const auto& shape : shapes) {
    std::vector<std::size_t> threads = o.threads_per_device;
    if (threads.empty()) {
      threads.push_back(1);
      if (const std::size_t t = available_cores() / std::max<std::size_t>(shape.devices(), 1); t > 1) threads.push_back(t);
    }
    // Overlap only changes a step with a data axis to synchronise over, and not under ZeRO-1 (whose
    // sync is its reduce-scatter after the backward), nor a pipelined step or a model that is not a
    // `sequential` (no layer hooks start the buckets: the train state refuses overlap there).
    const bool overlap_matters = shape.size("data") > 1 && o.data_policy.zero == 0 &&
                                 shape.size("pipeline") <= 1 && detail::sequential_model<model_type>;
    std::vector<bool> overlap = overlap_matters ? o.overlap : std::vector<bool>{o.data_policy.overlap};
    if (overlap.empty()) overlap = {false, true};
    for (std::size_t t : threads)
      for (bool ov : overlap) {
        if (t == 0)
          throw std::invalid_argument("meshlib::nn: advise_mesh: advise_options::threads_per_device holds 0; give "
                                      "counts of 1 or more");
        advice_row c;
        c.shape = shape;
        c.threads_per_device = t;
        c.overlap = ov;
        candidates.push_back(std::move(c));
      }
  }
  // The caller's BLAS threads come back however the loop ends.
  struct restore_blas_threads {
    int threads = blas_threads_per_device();
    ~restore_blas_threads() { set_blas_threads_per_device(threads); }
  } restore;
  std::vector<mesh_shape> refused;  // a shape refused once is listed once (its reason does not depend on
                                    // the threads or the overlap)
  for (auto& row : candidates) {
    const mesh_shape& shape = row.shape;
    if (std::find(refused.begin(), refused.end(), shape) != refused.end()) continue;
    set_blas_threads_per_device(static_cast<int>(row.threads_per_device));
    try {
      const Mesh mesh = make_mesh<Mesh>(shape);
      auto net = make_model(mesh);
      auto state = detail::advised_state<0>(mesh, net, o, shape, row.overlap);
      for (std::size_t i = 0; i < o.warmup_steps; ++i) (void)train_step(state, batch);
      std::vector<double> times;
      double total = 0, sync = 0;  // measured: the synchronisation's share of the measured steps
      step_metrics last;
      for (std::size_t i = 0; i < std::max<std::size_t>(o.timed_steps, 1); ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        last = train_step(state, batch);
        const double measured = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        times.push_back(o.step_time ? o.step_time(row, i, measured) : measured);
        total += measured;
        sync += last.sync_seconds;
      }
      row.step_seconds = detail::median(times);
      row.samples_per_second = static_cast<double>(a.batch) / row.step_seconds;
      row.sync_share = total > 0 ? sync / total : 0;
      for (std::size_t dev : state.local_devices()) row.state_bytes = std::max(row.state_bytes, state.memory(dev).total());
      row.activation_bytes = last.peak_activation_bytes;
      row.bubble = measured_bubble(state);
    } catch (const meshlib::error& e) {
      row.refused = "not possible: " + detail::without_prefix(e.what());
    }
    if (!row.possible()) refused.push_back(shape);
    a.rows.push_back(std::move(row));
  }
  std::stable_sort(a.rows.begin(), a.rows.end(), [](const advice_row& x, const advice_row& y) {
    if (x.possible() != y.possible()) return x.possible();
    return x.possible() && x.step_seconds < y.step_seconds;
  });
  if (a.rows.empty() || !a.rows.front().possible()) {
    std::string why;
    for (const auto& r : a.rows) why += "; " + r.shape.to_string() + ": " + r.refused;
    throw sharding_error("meshlib::nn: advise_mesh: no mesh shape of " + std::to_string(devices) +
                         " devices can train this model on this batch" + why);
  }
  a.best = a.rows.front().shape;
  a.best_threads_per_device = a.rows.front().threads_per_device;
  a.best_overlap = a.rows.front().overlap;
  return a;
}

}  // namespace meshlib::nn
