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
/// Buckets run one after the other today; they are filled in parameter order, which leaves room for
/// overlapping a bucket's collective with the backward of earlier layers once the communicator is
/// asynchronous.
/// @code
/// meshlib::nn::grad_sync<float> sync(mesh.size(), 1 << 20);   // 4 MiB buckets of floats
/// // inside spmd, after backward: const auto& g = sync.all_reduce<data_axes>(params, mesh, dev);
/// // g[i]: parameter i's summed gradient block
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/gathers.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/nn/detail/axis_mask_group.hpp"
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/nn/parameter.hpp"

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
      : bucket_(bucket_elements), wire_(devices), flat_(devices), shard_(devices), collectives_(devices, 0), summed_(devices) {}

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
    constexpr bool same = std::is_same_v<Wire, T>;
    const std::size_t n = flat_size(params, dev);
    const bool moves = Axes != 0 && mesh.axes_size(Axes) > 1;  // a group of one: nothing to add
    std::vector<T*>& out = summed_.at(dev);
    out.assign(params.size(), nullptr);
    const std::size_t cap = bucket_ == 0 ? std::max<std::size_t>(n, 1) : bucket_, big = (cap + 1) / 2;
    Wire* w = same && !moves ? nullptr : wire_.get(dev, n);
    T* f = same ? nullptr : flat_.get(dev, n);
    std::size_t open = 0, used = 0;  // the open bucket: [open, used) of the packed buffer
    auto flush = [&] {
      if (used == open) return;
      if (moves) reduce<Axes>(mesh, w + open, used - open, dev);
      if constexpr (!same)
        detail::convert_copy<space>(f + open, w + open, used - open);
      open = used;
    };
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::size_t c = params[i].count[dev];
      T* g = params[i].grad[dev];
      if constexpr (same)
        if (!moves || c >= big) {  // in place, in the gradient block itself
          out[i] = g;
          if (moves) reduce<Axes>(mesh, g, c, dev);
          continue;
        }
      if (used - open + c > cap || c >= big) flush();  // (a big one is a bucket of its own)
      detail::convert_copy<space>(w + used, g, c);
      if constexpr (same) out[i] = w + used;
      else out[i] = f + used;
      used += c;
      if (c >= big) flush();
    }
    flush();
    return out;
  }

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

 private:
  /// All-reduces `len` elements of `buf` in place over `Axes`, in pieces of at most the bucket
  /// size: each piece a donated `psum` of a bucket over `buf` (summed where it lies).
  template <axis_mask Axes, mesh_type Mesh>
  void reduce(const Mesh& mesh, Wire* buf, std::size_t len, std::size_t dev) {
    if constexpr (Axes != 0) {
      const std::size_t step = bucket_ == 0 ? std::max<std::size_t>(len, 1) : bucket_;
      for (std::size_t o = 0; o < len; o += step) {
        (void)detail::psum_over<Axes>(detail::wrap1<bucket_type<Axes, Mesh>>(buf + o, std::min(step, len - o), mesh, dev));
        ++collectives_[dev];
      }
    }
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
  std::vector<std::vector<T*>> summed_;  ///< per device: where each parameter's summed gradient lies
};

}  // namespace meshlib::nn
