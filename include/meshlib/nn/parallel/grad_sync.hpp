// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Data-parallel gradient synchronisation: every local gradient block (a pending sum over the
/// data axis: `x^T dy` contracts the data-sharded batch) is completed with few collectives, grouped
/// into *buckets* of at most `bucket_elements` elements (PyTorch DDP's gradient buckets: many small
/// gradients, few collectives). Either an all-reduce (`psum`, every replica gets the whole sum) or,
/// for ZeRO-1, a reduce-scatter (`psum_scatter`, each data replica gets the sum of its 1/n slice of
/// the flat gradient vector, the concatenation of the blocks, and only updates that slice).
///
/// All-reduce buckets: a gradient of at least half a bucket (the big weights: nearly all the bytes)
/// is reduced on its own, in place in the parameter's gradient block, in pieces of at most
/// `bucket_elements`: no byte is staged. The smaller ones are packed, in parameter order, into shared
/// buckets of at most `bucket_elements` and reduced there. Over a group of one device nothing moves.
///
/// The wire type `Wire` is a compile-time parameter: gradients are converted to `Wire` when packed
/// and reduced in `Wire` (every bucket is then packed); `grad_sync<float, bfloat16>` halves the
/// traffic, and a reduction cannot run in a narrower type than the one named in the program.
/// Every collective is a public typed one, as in a user's `shard_map`: a bucket is a rank-1
/// `local_tensor` over its piece of the flat buffer (a view of nn's own buffer, a pending sum over
/// the data axes), summed in place by the donated `psum`, or reduce-scattered by
/// `psum_scatter_into` into the slice buffer; nothing is staged beyond what the buckets need.
/// Buckets are filled in parameter order. Synchronously (`all_reduce`) they run one after the other
/// after the backward; overlapped (`begin_all_reduce` / `start_ready` / `finish_all_reduce`,
/// `data_parallel{.overlap = true}`), each is started with `psum_start` as soon as the backward
/// has completed its gradients (the last layers' first), so its reduction runs on the device's
/// communication worker while the backward of the earlier layers computes. Same buckets, same
/// per-element rank-order sums: the same bits either way.
/// @code
/// meshlib::nn::grad_sync<float> sync(mesh.size(), 1 << 20);   // 4 MiB buckets of floats
/// // inside spmd, after backward: const auto& g = sync.all_reduce<data_axes>(params, mesh, dev);
/// // g[i]: parameter i's summed gradient block
/// @endcode

#include <algorithm>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief Bucketed gradient synchronisation (see the file comment).
/// @tparam T    the gradients' element type.
/// @tparam Wire the element type on the wire and of the reduction (`float` or `bfloat16` for `float`).
template <class T = float, comm_element Wire = T>
class grad_sync {
  static_assert(comm_element<Wire>, "meshlib::nn: grad_sync: the wire type must be a communicator element type");

 public:
  /// The element type gradients travel in (narrower than `T` to halve the traffic, e.g. bfloat16).
  using wire_type = Wire;
  grad_sync() = default;
  /// `devices`: the mesh size; `bucket_elements`: most elements per collective (0: no limit).
  grad_sync(std::size_t devices, std::size_t bucket_elements)
      : bucket_(bucket_elements),
        wire_(devices),
        flat_(devices),
        shard_(devices),
        collectives_(devices, 0),
        early_(devices, 0),
        summed_(devices),
        plans_(devices) {}

  /// Elements of the flat buffer on device `dev` (sum of its local gradient blocks).
  [[nodiscard]] static std::size_t flat_size(const std::vector<param_ref<T>>& params, std::size_t dev) {
    std::size_t n = 0;
    for (const auto& p : params) n += p.count[dev];
    return n;
  }

  /// A bucket as the collectives see it: a rank-1 block of `Wire` that is a pending sum over the
  /// axes `Axes` (and may differ over every other axis of the mesh).
  template <axis_mask Axes, mesh_type Mesh>
  using bucket_type = local_tensor<Wire, 1, Mesh, Mesh::all_axes & ~Axes, Axes>;

  /// All-reduces every gradient over the axes `Axes` of `mesh`, bucket by bucket (see the file
  /// comment), and returns, per parameter, where its summed gradient block lies: its own gradient
  /// block (reduced in place) or a piece of the packed buffer. The pointers stay valid until the
  /// next call on `dev`. Runs inside `spmd` / `shard_map` on device `dev`.
  template <axis_mask Axes, mesh_type Mesh>
  const std::vector<T*>& all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan<Axes>(params, mesh, dev);
    plan_state& st = plans_.at(dev);
    for (std::size_t b = 0; b < st.buckets.size(); ++b) run_bucket<Axes, false>(params, mesh, dev, b);
    return complete(dev);
  }

  /// @name Overlapped all-reduce (`data_parallel{.overlap = true}`)
  /// The same buckets and the same sums as `all_reduce`, started as backward completes them:
  /// `begin_all_reduce` before the backward, `start_ready(first)` each time the gradients of
  /// parameters `first, first + 1, ...` are complete (backward runs last layer first), and
  /// `finish_all_reduce`, which starts the rest, waits for all and returns what `all_reduce` returns.
  /// Every device makes the same calls with the same arguments, so all start the same buckets in the
  /// same order; each element is summed in rank order whichever bucket carries it: the same bits.
  /// @{

  /// Plans this step's buckets (nothing starts yet).
  template <axis_mask Axes, mesh_type Mesh>
  void begin_all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan<Axes>(params, mesh, dev);
  }
  /// Starts every bucket not yet started whose parameters all have index `first` or more.
  template <axis_mask Axes, mesh_type Mesh>
  void start_ready(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t first) {
    plan_state& st = plans_.at(dev);
    for (std::size_t b = st.buckets.size(); b-- > 0;)
      if (!st.started[b] && st.buckets[b].first >= first) {
        run_bucket<Axes, true>(params, mesh, dev, b);
        ++early_[dev];
      }
  }
  /// Starts the buckets not yet started, waits for every bucket, and returns each parameter's summed
  /// gradient block (what `all_reduce` returns).
  template <axis_mask Axes, mesh_type Mesh>
  const std::vector<T*>& finish_all_reduce(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    plan_state& st = plans_.at(dev);
    for (std::size_t b = st.buckets.size(); b-- > 0;)
      if (!st.started[b]) run_bucket<Axes, true>(params, mesh, dev, b);
    std::exception_ptr first_error;  // every request is waited for (its buffers are in use) before one throws
    for (auto& w : st.waits) {
      try {
        w();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    st.waits.clear();
    if (first_error) std::rethrow_exception(first_error);
    return complete(dev);
  }
  /// @}

  /// ZeRO-1: pads the flat gradient vector to a multiple of the group size and reduce-scatters it
  /// over the axes `Axes` of `mesh`: returns this device's slice `[begin, begin + size)` of the
  /// summed flat gradient, `size = ceil(n / group)`. Bucket `b` of each rank's part is one
  /// `psum_scatter_into` of equal pieces into the slice buffer; the gradients are packed straight
  /// into that order (one copy).
  template <axis_mask Axes, mesh_type Mesh>
  T* reduce_scatter(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t& begin,
                    std::size_t& size) {
    const std::size_t group = Axes == 0 ? 1 : mesh.axes_size(Axes), rank = Axes == 0 ? 0 : mesh.group_rank(dev, Axes);
    const std::size_t n = flat_size(params, dev);
    size = (n + group - 1) / group;
    begin = rank * size;
    const std::size_t step = bucket_ == 0 || group == 1 ? std::max<std::size_t>(size, 1)
                                                        : std::max<std::size_t>(1, bucket_ / group);
    Wire* send = wire_.get(dev, size * group);
    // Flat element j = r * size + o (rank r's part, offset o in it) goes to bucket o / step, where
    // the pieces of the ranks lie one after the other: segments in increasing flat order.
    flat_cursor cur{params, dev};
    for (std::size_t r = 0; r < group; ++r)
      for (std::size_t o = 0; o < size; o += step) {
        const std::size_t len = std::min(step, size - o);
        cur.copy(r * size + o, len, send + o * group + r * len);
      }
    Wire* out = send + rank * size;  // group == 1: the packed vector is the slice
    if constexpr (Axes != 0) {
      if (group > 1) {
        using B = bucket_type<Axes, Mesh>;
        out = shard_.get(dev, size);
        for (std::size_t o = 0; o < size; o += step) {
          const std::size_t len = std::min(step, size - o);
          (void)meshlib::psum_scatter_into<detail::group_of_t<Mesh, Axes>, 0>(
              detail::wrap1<B>(send + o * group, len * group, mesh, dev), detail::wrap1<B>(out + o, len, mesh, dev));
          ++collectives_[dev];
        }
      }
    }
    return unpack_wire(dev, out, size);
  }

  /// Collectives this device has issued (a test checks the bucketing).
  [[nodiscard]] std::size_t collectives(std::size_t dev) const { return collectives_.at(dev); }
  /// Buckets this device has started during backward (`start_ready`; a test checks the overlap).
  [[nodiscard]] std::size_t started_early(std::size_t dev) const { return early_.at(dev); }

 private:
  /// One collective's worth of the all-reduce: the gradient block of parameter `first` reduced in
  /// place (`packed` false), or the parameters `[first, last)` that the plan packed at `offset` of
  /// the wire buffer.
  struct bucket {
    std::size_t first = 0, last = 0;
    bool packed = false;
    std::size_t offset = 0, len = 0;
  };
  /// A device's plan of the all-reduce (the same on every device: it depends on the sizes only).
  struct plan_state {
    std::vector<bucket> buckets;          ///< in the order `all_reduce` issues them
    std::vector<bool> started;            ///< per bucket
    std::vector<std::size_t> wire_at;     ///< per parameter: its offset in the packed buffer, or npos
    std::vector<std::function<void()>> waits;  ///< the started requests' waits
    Wire* w = nullptr;                    ///< the packed buffer
    T* f = nullptr;                       ///< the packed sums converted back to T (Wire != T)
    bool moves = false;                   ///< whether the group has more than one device
  };
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  /// Plans the buckets of `params` on `dev` (see the file comment) and where each sum will lie.
  template <axis_mask Axes, mesh_type Mesh>
  void plan(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev) {
    constexpr bool same = std::is_same_v<Wire, T>;
    const std::size_t n = flat_size(params, dev);
    plan_state& st = plans_.at(dev);
    st.moves = Axes != 0 && mesh.axes_size(Axes) > 1;  // a group of one: nothing to add
    std::vector<T*>& out = summed_.at(dev);
    out.assign(params.size(), nullptr);
    st.buckets.clear();
    st.waits.clear();
    st.wire_at.assign(params.size(), npos);
    const std::size_t cap = bucket_ == 0 ? std::max<std::size_t>(n, 1) : bucket_, big = (cap + 1) / 2;
    st.w = same && !st.moves ? nullptr : wire_.get(dev, n);
    st.f = same ? nullptr : flat_.get(dev, n);
    std::size_t open = 0, used = 0;  // the open bucket: [open, used) of the packed buffer
    std::size_t first = npos, last = 0;  // its parameters
    auto flush = [&] {
      if (used == open) return;
      st.buckets.push_back({first, last, true, open, used - open});
      open = used;
      first = npos;
    };
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::size_t c = params[i].count[dev];
      if constexpr (same)
        if (!st.moves || c >= big) {  // in place, in the gradient block itself
          out[i] = params[i].grad[dev];
          if (st.moves) st.buckets.push_back({i, i + 1, false, 0, c});
          continue;
        }
      if (used - open + c > cap || c >= big) flush();  // (a big one is a bucket of its own)
      if (first == npos) first = i;
      last = i + 1;
      st.wire_at[i] = used;
      if constexpr (same) out[i] = st.w + used;
      else out[i] = st.f + used;
      used += c;
      if (c >= big) flush();
    }
    flush();
    st.started.assign(st.buckets.size(), false);
  }

  /// Packs bucket `b` and all-reduces it in pieces of at most the bucket size: each piece a donated
  /// `psum` (`Async`: `psum_start`) of a bucket over the buffer (summed where it lies).
  template <axis_mask Axes, bool Async, mesh_type Mesh>
  void run_bucket(const std::vector<param_ref<T>>& params, const Mesh& mesh, std::size_t dev, std::size_t b) {
    plan_state& st = plans_.at(dev);
    st.started[b] = true;
    const bucket& k = st.buckets[b];
    Wire* buf = nullptr;
    if (k.packed) {
      for (std::size_t i = k.first; i < k.last; ++i)
        if (st.wire_at[i] != npos) detail::convert_copy<space>(st.w + st.wire_at[i], params[i].grad[dev], params[i].count[dev]);
      buf = st.w + k.offset;
    } else {
      if constexpr (std::is_same_v<Wire, T>) buf = params[k.first].grad[dev];
    }
    if constexpr (Axes != 0) {
      if (!st.moves) return;
      using B = bucket_type<Axes, Mesh>;
      const std::size_t step = bucket_ == 0 ? std::max<std::size_t>(k.len, 1) : bucket_;
      for (std::size_t o = 0; o < k.len; o += step) {
        auto piece = detail::wrap1<B>(buf + o, std::min(step, k.len - o), mesh, dev);
        if constexpr (Async) {
          auto r = std::make_shared<decltype(detail::psum_start_over<Axes>(std::move(piece)))>(
              detail::psum_start_over<Axes>(std::move(piece)));
          st.waits.emplace_back([r] { (void)r->wait(); });
        } else {
          (void)detail::psum_over<Axes>(std::move(piece));
        }
        ++collectives_[dev];
      }
    }
  }

  /// The packed sums converted back to `T` (Wire != T); where each parameter's sum lies.
  const std::vector<T*>& complete(std::size_t dev) {
    plan_state& st = plans_.at(dev);
    if constexpr (!std::is_same_v<Wire, T>)
      for (const bucket& k : st.buckets) detail::convert_copy<space>(st.f + k.offset, st.w + k.offset, k.len);
    return summed_.at(dev);
  }

  /// Copies runs of the flat gradient vector (the blocks one after the other, zeros past the end),
  /// converted to `Wire`, for runs asked for in increasing order.
  struct flat_cursor {
    const std::vector<param_ref<T>>& params;
    std::size_t dev, i = 0, start = 0;  // parameter i's block starts at flat offset `start`
    void copy(std::size_t at, std::size_t len, Wire* to) {
      while (len > 0) {
        while (i < params.size() && start + params[i].count[dev] <= at) start += params[i++].count[dev];
        if (i == params.size()) {
          detail::fill_values<space>(to, len, Wire{});
          return;
        }
        const std::size_t k = std::min(len, start + params[i].count[dev] - at);
        const T* g = params[i].grad[dev] + (at - start);
        detail::convert_copy<space>(to, g, k);
        at += k;
        to += k;
        len -= k;
      }
    }
  };
  T* unpack_wire(std::size_t dev, Wire* w, std::size_t n) {
    if constexpr (std::is_same_v<Wire, T>) {
      return w;
    } else {
      T* f = flat_.get(dev, n);
      detail::convert_copy<space>(f, w, n);
      return f;
    }
  }

  /// The memory of the gradients and the packed buffers: the copies and conversions between them
  /// are Kokkos kernels on the running device's instance (nn/detail/kernels.hpp).
  using space = default_memory_space;
  std::size_t bucket_ = 0;
  detail::device_buffers<Wire> wire_;
  detail::device_buffers<T> flat_;
  detail::device_buffers<Wire> shard_;
  std::vector<std::size_t> collectives_;
  std::vector<std::size_t> early_;
  std::vector<std::vector<T*>> summed_;  ///< per device: where each parameter's summed gradient lies
  std::vector<plan_state> plans_;         ///< per device: the all-reduce's buckets
};

}  // namespace meshlib::nn
