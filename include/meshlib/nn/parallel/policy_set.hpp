// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::policy_set`: the parallel policies a `train_state` runs (nn/train/train_state.hpp),
/// each parallelism at most once over the state's axes, and every check of them: at compile time
/// (`check_policies`, nn/parallel/policy.hpp), of their values when collected (`collect`: ZeRO-1
/// beside `fully_shard` or with overlap), and against the mesh when the state is made (`check_axes`:
/// an axis gets its role from a policy, never from its name; an overlap no layer hook would start).
/// Values, not types, so these last ones are run-time `sharding_error`s, each naming the policy
/// and the fix.

#include <cstddef>
#include <optional>
#include <string>
#include <type_traits>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/nn/parallel/data_parallel.hpp"
#include "meshlib/nn/parallel/fsdp.hpp"
#include "meshlib/nn/parallel/pipeline.hpp"
#include "meshlib/nn/parallel/policy.hpp"

namespace meshlib::nn::detail {

/// @brief The policies of a `train_state` over the data axis `Data`, the second batch axis `Fsdp`
/// (`fully_shard`'s, or `data_parallel`'s second) and the pipeline axis `Pipe` (see the file comment).
template <fixed_string Data, fixed_string Fsdp, fixed_string Pipe>
struct policy_set {
  data_parallel<Data> data;               ///< `data_parallel<Data>{}` when none was given
  bool data_over_fsdp = false;            ///< a `data_parallel<Data, Fsdp>` was given
  std::optional<fully_shard<Fsdp>> fsdp;  ///< empty without FSDP
  std::optional<nn::pipeline<Pipe>> pipe; ///< empty without a pipeline

  /// The policies `ps` of a state on a `Mesh` running a `Model`, after their compile-time checks
  /// and the checks of their values.
  /// @throws sharding_error for ZeRO-1 beside `fully_shard` or with overlap, and for a ZeRO stage
  /// other than 0 or 1 (data_parallel_impl).
  template <class Mesh, class Model, class... Ps>
  static policy_set collect(const Ps&... ps) {
    check_policies<Mesh, Model, Data, Fsdp, Pipe, Ps...>();
    policy_set set;
    (set.keep(ps), ...);
    (refuse_clashes<Ps...>(ps), ...);
    return set;
  }

  /// Checks the policies against `mesh`, whose axes `FsdpAxes` and `PipelineAxes` are the state's
  /// second batch axis and pipeline axis (0: none, or the pipeline axis is a data axis):
  /// @throws sharding_error for either axis of more than one device that no policy names (an axis
  /// is pipelined, fully sharded or split by the batch by a policy, never by its name: silently
  /// replicating the model or splitting the batch over it would both surprise), and for
  /// `.overlap = true` where no layer hook would start the buckets.
  template <class Model, axis_mask FsdpAxes, axis_mask PipelineAxes, class Mesh>
  void check_axes(const Mesh& mesh) const {
    if constexpr (PipelineAxes != 0) {
      const std::size_t n = mesh.axes_size(PipelineAxes);
      if (!pipe && n > 1) {
        const std::string name(text_of(Pipe));
        throw sharding_error("meshlib::nn: train_state: the mesh's '" + name + "' axis has " + std::to_string(n) +
                             " devices but no pipeline policy was given; an axis is pipelined only by a policy, "
                             "not by its name: pass meshlib::nn::pipeline<\"" + name +
                             "\">{} (with .microbatches and .schedule) to the train_state, or make the axis size 1");
      }
    }
    if constexpr (FsdpAxes != 0 && text_of(Fsdp) != text_of(Data)) {
      const std::size_t n = mesh.axes_size(FsdpAxes);
      if (!fsdp && !data_over_fsdp && n > 1) {
        const std::string name(text_of(Fsdp)), data_axis(text_of(Data));
        throw sharding_error("meshlib::nn: train_state: the mesh's '" + name + "' axis has " + std::to_string(n) +
                             " devices but no policy names it; an axis splits the batch or shards the parameters "
                             "only by a policy, not by its name: pass meshlib::nn::fully_shard<\"" + name +
                             "\">{} (parameters, gradients and optimizer state sharded over it, the batch split over "
                             "it) or meshlib::nn::data_parallel<\"" + data_axis + "\", \"" + name +
                             "\">{} (the batch only) to the train_state, or make the axis size 1");
      }
    }
    refuse_ignored_overlap<Model, PipelineAxes>(mesh);
  }

 private:
  // Each policy into its slot. (A policy over another axis than the state's has already fired
  // `check_policies`' one static_assert: it is not kept, so that no second error follows. One
  // function over the policy's type: nvcc 13's front end deduces no `fixed_string A` from
  // `data_parallel<A>`.)
  template <class P>
  void keep(const P& p) {
    if constexpr (std::is_same_v<P, data_parallel<Data>>) {
      data = p;
    } else if constexpr (std::is_same_v<P, data_parallel<Data, Fsdp>>) {
      data = data_parallel<Data>{.zero = p.zero, .overlap = p.overlap, .bucket_elements = p.bucket_elements};
      data_over_fsdp = true;
    } else if constexpr (std::is_same_v<P, fully_shard<Fsdp>>) {
      fsdp = p;
    } else if constexpr (std::is_same_v<P, nn::pipeline<Pipe>>) {
      pipe = p;
    }
  }

  // Throws when `p` asks for what another of the policies `Ps` already does (or undoes): ZeRO-1
  // beside `fully_shard` (which shards the optimizer state itself), overlap with ZeRO-1 (whose
  // reduce-scatter runs after the backward).
  template <class... Ps, class P>
  static void refuse_clashes(const P& p) {
    if constexpr (P::kind == parallelism::data) {
      const std::string dp = "data_parallel<\"" + std::string(P::axis.view()) +
                             (has_second_axis<P>() ? "\", \"" + std::string(second_axis_text<P>()) : std::string()) +
                             "\">";
      if constexpr (policy_count_v<parallelism::fully_sharded, Ps...> != 0)
        if (p.zero == 1)
          throw sharding_error("meshlib::nn: train_state: " + dp + "{.zero = 1} and fully_shard<\"" +
                               std::string(text_of(Fsdp)) + "\"> both shard the optimizer state; fully_shard "
                               "already shards it (over '" + std::string(text_of(Fsdp)) + "', the " + dp +
                               " axis holding replicas of the shards: HSDP): drop .zero");
      if (p.zero == 1 && p.overlap)
        throw sharding_error("meshlib::nn: train_state: " + dp + "{.zero = 1, .overlap = true}: ZeRO-1 reduce-scatters "
                             "the gradients after the backward, so there is nothing to overlap; drop .overlap (or .zero)");
    }
  }

  // data_parallel's overlap starts each gradient bucket from the layer hooks a `sequential` calls
  // during its backward (nn/parallel/grad_overlap.hpp). Where no hook would start them, a model that
  // is not a `sequential` or a pipelined step (which synchronises after the schedule's last
  // backward, nn/parallel/pipeline_run.hpp), `.overlap = true` would do nothing: refused, with the
  // fix, rather than ignored.
  template <class Model, axis_mask PipelineAxes, class Mesh>
  void refuse_ignored_overlap(const Mesh& mesh) const {
    if (!data.overlap) return;
    const std::string dp = "data_parallel<\"" + std::string(text_of(Data)) +
                           (data_over_fsdp ? "\", \"" + std::string(text_of(Fsdp)) : std::string()) +
                           "\">{.overlap = true}";
    if constexpr (!sequential_model<Model>) {
      throw sharding_error("meshlib::nn: train_state: " + dp + " on a model that is not an nn::sequential: the "
                           "overlap starts each gradient bucket from the hooks sequential calls after each layer's "
                           "backward, and this model has none; wrap the layers in nn::sequential or drop .overlap");
    } else if constexpr (PipelineAxes != 0) {
      const std::size_t n = mesh.axes_size(PipelineAxes);
      if (pipe && n > 1)
        throw sharding_error("meshlib::nn: train_state: " + dp + " with pipeline<\"" + std::string(text_of(Pipe)) +
                             "\"> over " + std::to_string(n) + " stages: a pipelined step synchronises the gradients "
                             "after its schedule's last backward, not from the layer hooks, so there is nothing to "
                             "overlap; drop .overlap (or the pipeline)");
    }
  }
};

}  // namespace meshlib::nn::detail
