// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Data-parallel gradient synchronisation: every local gradient block (a pending sum over the
/// data axis: `x^T dy` contracts the data-sharded batch) is packed into one flat buffer per device
/// and completed with one collective per *bucket* of at most `bucket_elements` elements (PyTorch
/// DDP's gradient buckets: many small gradients, few collectives). Either an all-reduce (`psum`,
/// every replica gets the whole sum) or, for ZeRO-1, a reduce-scatter (`psum_scatter`, each data
/// replica gets the sum of its 1/n slice of the flat buffer, and only updates that slice).
///
/// The wire type `Wire` is a compile-time parameter: gradients are converted to `Wire` when packed
/// and reduced in `Wire`; `grad_sync<float, bfloat16>` halves the traffic, and a reduction cannot
/// run in a narrower type than the one named in the program. Buckets run one after the other
/// today; the layout (contiguous buckets of a flat buffer, filled in parameter order) leaves room
/// for overlapping a bucket's collective with the backward of earlier layers once the communicator
/// is asynchronous.
/// @code
/// meshlib::nn::grad_sync<float> sync(mesh.size(), 1 << 20);   // 4 MiB buckets of floats
/// // inside spmd, after backward: sync.all_reduce<"data">(params, dev);
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/nn/detail/buffers.hpp"
#include "meshlib/nn/parameter.hpp"

namespace meshlib::nn {

/// @brief Bucketed gradient synchronisation (see the file comment).
/// @tparam T    the gradients' element type.
/// @tparam Wire the element type on the wire and of the reduction (`float` or `bfloat16` for `float`).
template <class T = float, comm_element Wire = T>
class grad_sync {
  static_assert(comm_element<Wire>, "meshlib::nn: grad_sync: the wire type must be a communicator element type");

 public:
  using wire_type = Wire;
  grad_sync() = default;
  /// `devices`: the mesh size; `bucket_elements`: most elements per collective (0: one bucket).
  grad_sync(std::size_t devices, std::size_t bucket_elements)
      : bucket_(bucket_elements), wire_(devices), flat_(devices), shard_(devices), flat_wire_(devices), collectives_(devices, 0) {}

  /// Elements of the flat buffer on device `dev` (sum of its local gradient blocks).
  [[nodiscard]] static std::size_t flat_size(const std::vector<param_ref<T>>& params, std::size_t dev) {
    std::size_t n = 0;
    for (const auto& p : params) n += p.count[dev];
    return n;
  }

  /// Packs every gradient into the flat buffer and all-reduces it over the axes `axes`, bucket by
  /// bucket; returns the flat summed gradient (parameter order). With `axes == 0` nothing moves.
  T* all_reduce(const std::vector<param_ref<T>>& params, std::size_t dev, axis_mask axes) {
    const std::size_t n = flat_size(params, dev);
    Wire* w = pack(params, dev, n, 0);
    if (axes != 0) {
      auto& comm = meshlib::detail::current_device("grad_sync").comm(axes);
      const std::size_t step = bucket_ == 0 ? n : bucket_;
      for (std::size_t off = 0; off < n; off += step) {
        comm.all_reduce(w + off, std::min(step, n - off), datatype_of<Wire>, reduce_op::sum);
        ++collectives_[dev];
      }
    }
    return unpack_wire(dev, w, n);
  }

  /// ZeRO-1: packs the gradients, pads the flat buffer to a multiple of the group size, and
  /// reduce-scatters it over `axes`: returns this device's slice `[begin, begin + size)` of the
  /// summed flat gradient, `size = ceil(n / group)`.
  T* reduce_scatter(const std::vector<param_ref<T>>& params, std::size_t dev, axis_mask axes, std::size_t group,
                    std::size_t rank, std::size_t& begin, std::size_t& size) {
    const std::size_t n = flat_size(params, dev);
    size = (n + group - 1) / group;
    begin = rank * size;
    Wire* w = pack(params, dev, n, size * group - n);
    Wire* out = shard_.get(dev, size);
    if (group == 1) {
      std::copy_n(w, size, out);
    } else {
      // Bucketed: bucket b is a slice of every rank's part, so each collective is a reduce-scatter
      // of equal pieces.
      auto& comm = meshlib::detail::current_device("grad_sync").comm(axes);
      const std::size_t step = bucket_ == 0 ? size : std::max<std::size_t>(1, bucket_ / group);
      Wire* send = flat_wire_.get(dev, step * group);
      for (std::size_t off = 0; off < size; off += step) {
        const std::size_t len = std::min(step, size - off);
        for (std::size_t r = 0; r < group; ++r) std::copy_n(w + r * size + off, len, send + r * len);
        comm.reduce_scatter(send, out + off, len, datatype_of<Wire>, reduce_op::sum);
        ++collectives_[dev];
      }
    }
    return unpack_wire(dev, out, size);
  }

  /// Collectives this device has issued (a test checks the bucketing).
  [[nodiscard]] std::size_t collectives(std::size_t dev) const { return collectives_.at(dev); }

 private:
  Wire* pack(const std::vector<param_ref<T>>& params, std::size_t dev, std::size_t n, std::size_t pad) {
    Wire* w = wire_.get(dev, n + pad);
    std::size_t off = 0;
    for (const auto& p : params) {
      const T* g = p.grad[dev];
      for (std::size_t i = 0; i < p.count[dev]; ++i) w[off + i] = static_cast<Wire>(g[i]);
      off += p.count[dev];
    }
    std::fill_n(w + n, pad, Wire{});
    return w;
  }
  T* unpack_wire(std::size_t dev, Wire* w, std::size_t n) {
    if constexpr (std::is_same_v<Wire, T>) {
      return w;
    } else {
      T* f = flat_.get(dev, n);
      for (std::size_t i = 0; i < n; ++i) f[i] = static_cast<T>(w[i]);
      return f;
    }
  }

  std::size_t bucket_ = 0;
  detail::device_buffers<Wire> wire_;
  detail::device_buffers<T> flat_;
  detail::device_buffers<Wire> shard_;
  detail::device_buffers<Wire> flat_wire_;
  std::vector<std::size_t> collectives_;
};

}  // namespace meshlib::nn
