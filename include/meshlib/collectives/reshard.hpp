// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reshard<ToSpec>(x)`: the same global array under another sharding of the same mesh, as
/// `jax.device_put(x, NamedSharding(mesh, spec))` / DTensor's `redistribute`. The plan (see
/// reshard_plan.hpp) is chosen first and can be inspected with `plan_reshard<ToSpec>(x)`; then every
/// device runs it on its own block, each step a collective over its axis group.
/// @code
/// auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data", none>>{m}, shape, host);
/// std::cout << meshlib::plan_reshard<meshlib::P<none, "data">>(x);   // all_to_all over 'data' ...
/// auto y = meshlib::reshard<meshlib::P<none, "data">>(x, runner);    // to_host(y) == to_host(x)
/// // reshard<...>(x) without a runner: on the default runner
/// @endcode
/// This header holds the plan and the per-device steps; `reshard` itself runs devices, so it is in
/// the exec layer with the runners (meshlib/exec/global_reshard.hpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/reshard_plan.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

namespace collectives::detail {

/// Runs `plan` on one device: `src` is its block under `from` (rule `from_rule`), the result its
/// block under the plan's target (rule `to_rule`), written to `dst` (already of the target shape).
/// Every buffer lives in memory `Space` and every copy is a kernel (block_ops.hpp); the last step
/// writes straight into `dst`, so no step is followed by a copy.
template <class T, class Space, class Mesh, std::size_t Rank>
void run_reshard_plan(const reshard_plan& plan, const Mesh& m, std::size_t device, const dyn_spec& from,
                      shard_rule from_rule, shard_rule to_rule, const std::array<std::size_t, Rank>& shape, const T* src,
                      T* dst) {
  device_context& ctx = current_device("reshard");
  using shape_t = std::array<std::size_t, Rank>;
  using buffer_t = block_view<T, 1, Space>;
  auto staging = [](std::size_t n, bool zero = false) {
    return allocate<T, 1, Space>(std::array<std::size_t, 1>{n}, "meshlib::reshard", zero);
  };
  dyn_spec cur = from;
  shape_t cur_shape = dyn_block_of(m, cur, shape, device, from_rule).extent;
  const T* in = src;  // the current block: x's own, then the last step's output
  buffer_t held;      // keeps `in` alive once it is a staging buffer
  const auto& steps = plan.steps();
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    const bool last = i + 1 == steps.size();
    const std::size_t in_size = box_size(cur_shape);
    buffer_t next;
    // Where this step writes its block of `out_size` elements: `dst` for the last step.
    auto output = [&](std::size_t out_size, bool zero = false) -> T* {
      if (last) return dst;
      next = staging(out_size, zero);
      return next.data();
    };
    switch (st.kind) {
      case reshard_kind::all_gather: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        buffer_t recv = staging(in_size * n);
        comm.all_gather(in, recv.data(), in_size, datatype_of<T>);
        unpack_chunks<Space>(recv.data(), cur_shape, st.split_dim, n, output(in_size * n));
        cur_shape[st.split_dim] *= n;
        break;
      }
      case reshard_kind::all_to_all: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        buffer_t send = staging(in_size), recv = staging(in_size);
        pack_chunks<Space>(in, cur_shape, st.split_dim, n, send.data());
        comm.all_to_all(send.data(), recv.data(), in_size / n, datatype_of<T>);
        shape_t chunk = cur_shape;
        chunk[st.split_dim] /= n;
        unpack_chunks<Space>(recv.data(), chunk, st.concat_dim, n, output(in_size));
        cur_shape = chunk;
        cur_shape[st.concat_dim] *= n;
        break;
      }
      case reshard_kind::local_slice: {
        const auto have = dyn_block_of(m, cur, shape, device, shard_rule::even);
        const auto want = dyn_block_of(m, st.after, shape, device, shard_rule::even);
        shape_t off{};
        for (std::size_t d = 0; d < Rank; ++d) off[d] = want.offset[d] - have.offset[d];
        copy_box<Space>(in, cur_shape, off, output(want.size()), want.extent, shape_t{}, want.extent);
        cur_shape = want.extent;
        break;
      }
      case reshard_kind::exchange: {
        auto& comm = ctx.comm(Mesh::all_axes);
        const std::size_t n = m.size();
        const auto reps = block_representatives(m, from);
        const auto mine = dyn_block_of(m, from, shape, device, from_rule);
        const auto want = dyn_block_of(m, st.after, shape, device, to_rule);
        // The plan of the exchange (host metadata only): what this device sends to each
        // destination, every piece it is the chosen source of, and what it receives from each
        // source, in the order that source packs it.
        std::vector<std::int64_t> send_counts(n, 0), send_displs(n, 0), recv_counts(n, 0), recv_displs(n, 0);
        std::vector<block<Rank>> sent, pieces;
        std::size_t send_total = 0;
        for (std::size_t to = 0; to < n; ++to) {
          send_displs[to] = static_cast<std::int64_t>(send_total);
          const auto their = dyn_block_of(m, st.after, shape, to, to_rule);
          for (auto r : reps) {
            const auto piece = intersect(their, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, to) != device) continue;
            sent.push_back(piece);
            send_total += piece.size();
          }
          send_counts[to] = static_cast<std::int64_t>(send_total) - send_displs[to];
        }
        std::size_t recv_total = 0;
        for (std::size_t s = 0; s < n; ++s) {
          recv_displs[s] = static_cast<std::int64_t>(recv_total);
          for (auto r : reps) {
            const auto piece = intersect(want, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, device) != s) continue;
            pieces.push_back(piece);
            recv_total += piece.size();
          }
          recv_counts[s] = static_cast<std::int64_t>(recv_total) - recv_displs[s];
        }
        buffer_t send = staging(send_total), recv = staging(recv_total);
        std::size_t at = 0;
        for (const auto& piece : sent) {
          shape_t off{};
          for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - mine.offset[d];
          copy_box<Space>(in, cur_shape, off, send.data() + at, piece.extent, shape_t{}, piece.extent);
          at += piece.size();
        }
        comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, send_total,
                          recv_total, datatype_of<T>);
        T* out = output(want.size(), true);
        at = 0;
        for (const auto& piece : pieces) {
          shape_t off{};
          for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - want.offset[d];
          copy_box<Space>(recv.data() + at, piece.extent, shape_t{}, out, want.extent, off, piece.extent);
          at += piece.size();
        }
        cur_shape = want.extent;
        break;
      }
    }
    held = next;
    in = held.data();
    cur = st.after;
  }
}

}  // namespace collectives::detail

namespace experimental {
/// Runs a reshard plan on one device's block: the steps `reshard` and global-view resharding share.
using collectives::detail::run_reshard_plan;
}  // namespace experimental

/// @brief The plan `reshard(x, to)` runs, without running it.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] reshard_plan plan_reshard(const X& x, const To& to) {
  using from_t = typename X::sharding_type;
  static_assert(std::is_same_v<typename from_t::mesh_type, typename To::mesh_type>,
                "meshlib: reshard moves an array between shardings of the same mesh type");
  static_assert(To::template check_rank<X::rank>());
  if (!(x.mesh() == to.mesh()))
    throw sharding_error("meshlib: reshard from mesh " + x.mesh().to_string() + " to mesh " + to.mesh().to_string() +
                         ": both shardings must use the same mesh");
  return collectives::detail::make_reshard_plan(x.mesh(), collectives::detail::to_dyn_spec<from_t>(X::rank), x.sharding().rule(),
                                   collectives::detail::to_dyn_spec<To>(X::rank), to.rule(), x.global_shape(),
                                   sizeof(typename X::value_type));
}

/// @brief The plan `reshard<ToSpec>(x)` runs, without running it.
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] reshard_plan plan_reshard(const X& x) {
  return plan_reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()));
}

}  // namespace meshlib
