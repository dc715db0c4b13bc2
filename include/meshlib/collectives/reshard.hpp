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
/// auto y = meshlib::reshard<meshlib::P<none, "data">>(x);            // to_host(y) == to_host(x)
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshlib/collectives/backend.hpp"
#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/reshard_plan.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

namespace detail {

/// Runs `plan` on one device: `src` is its block under `from` (rule `from_rule`), the result its
/// block under the plan's target (rule `to_rule`), written to `dst` (already of the target shape).
template <class T, class Mesh, std::size_t Rank>
void run_reshard_plan(const reshard_plan& plan, const Mesh& m, std::size_t device, const dyn_spec& from,
                      shard_rule from_rule, shard_rule to_rule, const std::array<std::size_t, Rank>& shape, const T* src,
                      T* dst) {
  device_context& ctx = current_device("reshard");
  using shape_t = std::array<std::size_t, Rank>;
  dyn_spec cur = from;
  shape_t cur_shape = dyn_block_of(m, cur, shape, device, from_rule).extent;
  std::vector<T> buf(src, src + box_size(cur_shape));
  std::vector<T> next;
  for (const auto& st : plan.steps()) {
    switch (st.kind) {
      case reshard_kind::all_gather: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        std::vector<T> recv(buf.size() * n);
        comm.all_gather(buf.data(), recv.data(), buf.size(), datatype_of<T>);
        next.assign(recv.size(), T{});
        unpack_chunks(recv.data(), cur_shape, st.split_dim, n, next.data());
        cur_shape[st.split_dim] *= n;
        break;
      }
      case reshard_kind::all_to_all: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        std::vector<T> send(buf.size()), recv(buf.size());
        pack_chunks(buf.data(), cur_shape, st.split_dim, n, send.data());
        comm.all_to_all(send.data(), recv.data(), buf.size() / n, datatype_of<T>);
        shape_t chunk = cur_shape;
        chunk[st.split_dim] /= n;
        next.assign(buf.size(), T{});
        unpack_chunks(recv.data(), chunk, st.concat_dim, n, next.data());
        cur_shape = chunk;
        cur_shape[st.concat_dim] *= n;
        break;
      }
      case reshard_kind::local_slice: {
        const auto have = dyn_block_of(m, cur, shape, device, shard_rule::even);
        const auto want = dyn_block_of(m, st.after, shape, device, shard_rule::even);
        shape_t off{};
        for (std::size_t d = 0; d < Rank; ++d) off[d] = want.offset[d] - have.offset[d];
        next.assign(want.size(), T{});
        copy_box(buf.data(), cur_shape, off, next.data(), want.extent, shape_t{}, want.extent);
        cur_shape = want.extent;
        break;
      }
      case reshard_kind::exchange: {
        auto& comm = ctx.comm(Mesh::all_axes);
        const std::size_t n = m.size();
        const auto reps = block_representatives(m, from);
        const auto mine = dyn_block_of(m, from, shape, device, from_rule);
        const auto want = dyn_block_of(m, st.after, shape, device, to_rule);
        std::vector<std::int64_t> send_counts(n, 0), send_displs(n, 0), recv_counts(n, 0), recv_displs(n, 0);
        std::vector<T> send;
        // What this device sends to each destination: every piece it is the chosen source of.
        for (std::size_t dst = 0; dst < n; ++dst) {
          send_displs[dst] = static_cast<std::int64_t>(send.size());
          const auto their = dyn_block_of(m, st.after, shape, dst, to_rule);
          for (auto r : reps) {
            const auto piece = intersect(their, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, dst) != device) continue;
            const std::size_t at = send.size();
            send.resize(at + piece.size());
            shape_t off{};
            for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - mine.offset[d];
            copy_box(buf.data(), cur_shape, off, send.data() + at, piece.extent, shape_t{}, piece.extent);
          }
          send_counts[dst] = static_cast<std::int64_t>(send.size()) - send_displs[dst];
        }
        // What it receives from each source, in the same order the source packs it.
        std::vector<block<Rank>> pieces;
        std::vector<std::size_t> piece_src;
        std::size_t total = 0;
        for (std::size_t s = 0; s < n; ++s) {
          recv_displs[s] = static_cast<std::int64_t>(total);
          for (auto r : reps) {
            const auto piece = intersect(want, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, device) != s) continue;
            pieces.push_back(piece);
            total += piece.size();
          }
          recv_counts[s] = static_cast<std::int64_t>(total) - recv_displs[s];
        }
        std::vector<T> recv(total);
        comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, send.size(),
                          recv.size(), datatype_of<T>);
        next.assign(want.size(), T{});
        std::size_t at = 0;
        for (const auto& piece : pieces) {
          shape_t off{};
          for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - want.offset[d];
          copy_box(recv.data() + at, piece.extent, shape_t{}, next.data(), want.extent, off, piece.extent);
          at += piece.size();
        }
        cur_shape = want.extent;
        break;
      }
    }
    buf.swap(next);
    cur = st.after;
  }
  std::copy(buf.begin(), buf.end(), dst);
}

}  // namespace detail

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
  return detail::make_reshard_plan(x.mesh(), detail::to_dyn_spec<from_t>(X::rank), x.sharding().rule(),
                                   detail::to_dyn_spec<To>(X::rank), to.rule(), x.global_shape(),
                                   sizeof(typename X::value_type));
}

/// @brief The plan `reshard<ToSpec>(x)` runs, without running it.
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] reshard_plan plan_reshard(const X& x) {
  return plan_reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()));
}

/// @brief `x` laid out by sharding `to` (same mesh; the rule may differ). Runs `plan_reshard(x, to)`
/// on every device of `backend` (default: one thread per device).
/// @throws sharding_error when the shape does not fit `to` (even rule and a size that does not divide).
template <sharded_tensor_type X, sharding_type To, class Backend = thread_backend>
[[nodiscard]] auto reshard(const X& x, const To& to, const Backend& backend = {}) {
  using T = typename X::value_type;
  constexpr std::size_t Rank = X::rank;
  using result_t = sharded_tensor<T, Rank, To, typename X::memory_space>;
  const reshard_plan plan = plan_reshard(x, to);
  result_t out(to, x.global_shape(), std::span<const std::size_t>(backend.local_devices(x.mesh().size())));
  if (plan.empty()) {
    // Same blocks: copy them (the result owns its memory, as after any reshard).
    for (auto dev : out.local_devices())
      std::copy_n(x.local(dev).data(), x.local(dev).size(), out.local(dev).data());
    return out;
  }
  const auto from = detail::to_dyn_spec<typename X::sharding_type>(Rank);
  detail::run_devices(x.mesh(), backend, [&](std::size_t dev) {
    detail::run_reshard_plan<T>(plan, x.mesh(), dev, from, x.sharding().rule(), to.rule(), x.global_shape(),
                                x.local(dev).data(), out.local(dev).data());
  });
  return out;
}

/// @brief `x` laid out by `ToSpec` on the same mesh, with the same shard rule.
template <partition_spec_type ToSpec, sharded_tensor_type X, class Backend = thread_backend>
[[nodiscard]] auto reshard(const X& x, const Backend& backend = {}) {
  return reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()), backend);
}

}  // namespace meshlib
