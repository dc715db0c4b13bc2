#pragma once
/// @file
/// @brief The argument checks of the device communicators (NCCL, several devices on one GPU), in
/// one place: roots, peers, counts, buffer sizes and overlaps (the shared
/// `detail::out_of_place_problem`), ppermute pairs, all_to_all_v layouts, and that a buffer is
/// device memory of the participant's GPU. A CRTP base: `Derived` provides `rank()`, `size()`,
/// `device()`, `describe(op)`, `check_pointers()` and `check_usable(op)`.

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"

namespace meshlib::detail {

template <class Derived>
class device_checks {
 protected:
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  [[noreturn]] void bad_argument(std::string_view k, const std::string& what) const {
    throw comm_argument_error("meshlib: invalid argument to " + self().describe(k) + ": " + what);
  }
  void check_root(std::string_view k, int root) const {
    self().check_usable(k);
    if (root < 0 || root >= self().size())
      bad_argument(k, "root " + std::to_string(root) + " is out of range [0, " + std::to_string(self().size()) + ")");
  }
  void check_peer(std::string_view k, int peer, const char* what) const {
    if (peer < 0 || peer >= self().size())
      bad_argument(k, std::string(what) + " rank " + std::to_string(peer) + " is out of range [0, " +
                          std::to_string(self().size()) + ")");
  }
  [[nodiscard]] std::size_t checked_mul(std::string_view k, std::size_t count) const {
    const auto n = static_cast<std::size_t>(self().size());
    if (count != 0 && n > std::numeric_limits<std::size_t>::max() / count)
      bad_argument(k, "count " + std::to_string(count) + " times " + std::to_string(n) + " ranks overflows");
    return count * n;
  }
  [[nodiscard]] std::size_t blocks_of(std::string_view k, std::size_t total) const {
    self().check_usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    if (total % n != 0)
      bad_argument(k, "buffer of " + std::to_string(total) + " elements does not split into " + std::to_string(n) +
                          " equal blocks (one per rank)");
    return total / n;
  }
  template <class T>
  void check_out_of_place(std::string_view k, std::span<const T> send, std::span<T> recv, std::size_t needed) const {
    self().check_usable(k);
    const std::string problem = out_of_place_problem(send, recv, needed);
    if (!problem.empty()) bad_argument(k, problem);
    check_device(k, "send", send.data(), send.size_bytes());
    check_device(k, "receive", recv.data(), recv.size_bytes());
  }
  template <class T>
  void check_buffer(std::string_view k, std::span<T> buf) const {
    self().check_usable(k);
    check_device(k, "the", buf.data(), buf.size_bytes());
  }
  /// A buffer must be device memory (or managed memory) of this participant's GPU: a host pointer
  /// would otherwise crash a kernel.
  void check_device(std::string_view k, std::string_view name, const void* p, std::size_t bytes) const {
    if (!self().check_pointers() || bytes == 0) return;
    cudaPointerAttributes a{};
    const cudaError_t rc = cudaPointerGetAttributes(&a, p);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      bad_argument(k, std::string(name) + " buffer is not memory CUDA knows (" + cuda_error_text(rc) +
                          "); device communicators move device memory");
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      bad_argument(k, std::string(name) +
                          " buffer is host memory; NCCL moves device memory (cudaMalloc, or a Kokkos::CudaSpace view)");
    if (a.type == cudaMemoryTypeDevice && a.device != self().device())
      bad_argument(k, std::string(name) + " buffer is on GPU " + std::to_string(a.device) + ", not on this rank's GPU " +
                          std::to_string(self().device()));
  }
  /// reduce: root's buffers as an out-of-place call, the others' send only.
  template <class T>
  void check_reduce(std::string_view k, std::span<const T> send, std::span<T> recv, int root) const {
    check_root(k, root);
    if (self().rank() == root) check_out_of_place(k, send, recv, send.size());
    else check_device(k, "send", send.data(), send.size_bytes());
  }
  /// broadcast: root's send covers recv; the others' recv only.
  template <class T>
  void check_broadcast(std::string_view k, std::span<const T> send, std::span<T> recv, int root) const {
    check_root(k, root);
    if (self().rank() == root) {
      check_out_of_place(k, send, recv, recv.size());
      if (send.size() < recv.size())
        bad_argument(k, "root's send buffer holds " + std::to_string(send.size()) + " elements but recv.size() = " +
                            std::to_string(recv.size()) + " are broadcast");
    } else {
      check_device(k, "receive", recv.data(), recv.size_bytes());
    }
  }
  /// reduce_scatter: send holds size() blocks of recv.size(); returns the block size.
  template <class T>
  [[nodiscard]] std::size_t check_reduce_scatter(std::string_view k, std::span<const T> send, std::span<T> recv) const {
    self().check_usable(k);
    const std::size_t total = checked_mul(k, recv.size());
    if (send.size() < total)
      bad_argument(k, "send buffer holds " + std::to_string(send.size()) + " elements but size() * recv.size() = " +
                          std::to_string(total) + " are needed");
    check_out_of_place(k, send.first(total), recv, recv.size());
    return recv.size();
  }
  /// all_to_all_v: both layouts, no overlap, device buffers.
  template <class T>
  void check_all_to_all_v(std::string_view k, std::span<const T> send, std::span<const std::int64_t> send_counts,
                          std::span<const std::int64_t> send_displs, std::span<T> recv,
                          std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs) const {
    self().check_usable(k);
    check_layout(k, "send", send.size(), send_counts, send_displs);
    check_layout(k, "recv", recv.size(), recv_counts, recv_displs);
    if (buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
      bad_argument(k, "the send and receive buffers overlap; all_to_all_v has no in-place form");
    check_device(k, "send", send.data(), send.size_bytes());
    check_device(k, "receive", recv.data(), recv.size_bytes());
  }
  void check_color(std::string_view k, int color) const {
    self().check_usable(k);
    if (color < 0) bad_argument(k, "color " + std::to_string(color) + " is negative; colors are >= 0");
  }

  void check_pairs(std::string_view k, std::span<const permute_pair> pairs) const {
    self().check_usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    std::vector<char> src(n, 0);
    std::vector<char> dst(n, 0);
    for (const auto& p : pairs) {
      check_peer(k, p.source, "source");
      check_peer(k, p.dest, "destination");
      if (src[static_cast<std::size_t>(p.source)]++ != 0)
        bad_argument(k, "rank " + std::to_string(p.source) + " is the source of more than one pair");
      if (dst[static_cast<std::size_t>(p.dest)]++ != 0)
        bad_argument(k, "rank " + std::to_string(p.dest) + " is the destination of more than one pair");
    }
  }
  void check_layout(std::string_view k, const char* side, std::size_t buffer, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs) const {
    const auto n = static_cast<std::size_t>(self().size());
    if (counts.size() != n || displs.size() != n)
      bad_argument(k, std::string(side) + " counts and displacements need one entry per rank (" + std::to_string(n) +
                          "), got " + std::to_string(counts.size()) + " and " + std::to_string(displs.size()));
    for (std::size_t i = 0; i < n; ++i) {
      if (counts[i] < 0 || displs[i] < 0)
        bad_argument(k, std::string(side) + " count or displacement for rank " + std::to_string(i) + " is negative");
      if (static_cast<std::uint64_t>(counts[i]) + static_cast<std::uint64_t>(displs[i]) > buffer)
        bad_argument(k, std::string(side) + " block of rank " + std::to_string(i) + " ends at element " +
                            std::to_string(counts[i] + displs[i]) + ", past the buffer's " + std::to_string(buffer));
    }
  }
};

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_NCCL
