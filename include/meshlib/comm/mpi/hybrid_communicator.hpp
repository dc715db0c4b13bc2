// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Hybrid meshes: P processes x T threads per process form one group of P*T devices.
/// Threads of one process talk through a `thread_communicator` (shared memory), processes through
/// an `mpi_communicator`. Satisfies `communicator`, so `axis_communicators`, the collectives and
/// `spmd` run on it unchanged.
///
/// @code
/// meshlib::mpi::guard run;                                   // MPI with MPI_THREAD_MULTIPLE
/// meshlib::run_hybrid(meshlib::mpi::world(), 2, [&](meshlib::hybrid_communicator& comm) {
///   // comm.rank() is the device p*2 + t; comm.size() is 2*P
///   meshlib::mesh<meshlib::axis<"process">, meshlib::axis<"thread">> m{P, 2};
///   meshlib::axis_communicators axes(comm, m);
///   float x = 1;
///   axes.over<"process">().all_reduce(std::span(&x, 1), meshlib::reduce_op::sum);  // crosses processes
/// });
/// @endcode
///
/// Devices. Device `p*T + t` is thread t of process p (the process-major order of
/// `distributed::devices()`), so in `mesh<axis<"process">, axis<"thread">>{P, T}` the last axis
/// stays inside a process.
///
/// Algorithms. A collective over a group that spans processes runs in three steps: the members in
/// one process exchange their inputs through the thread communicator, one thread per process (the
/// lowest member, "leader") exchanges the process's inputs with the other processes through MPI,
/// and the leader hands the result to its process's members through the thread communicator.
/// Reductions gather every member's input and reduce them in rank order with the thread backend's
/// own kernels, so every result is bitwise equal to the pure-thread run of the same program, for
/// floats too; the price is n times the traffic of a bandwidth-optimal all_reduce (docs/design.md).
/// Broadcast is a local broadcast in the root's process, an MPI broadcast between leaders and a
/// local broadcast elsewhere. A group inside one process never touches MPI. Point-to-point between
/// processes goes straight to MPI from the calling thread on the group's own duplicate communicator.
///
/// Requirements and faults: MPI must provide `MPI_THREAD_MULTIPLE` when T > 1 (leaders of
/// different groups call MPI concurrently), else `comm_error` at construction. A failure on a
/// leader's MPI call aborts the process's thread group, so its members get `comm_aborted` instead
/// of waiting; peers in other processes get `comm_timeout` (or `MPI_Abort`, see `<meshlib/mpi.hpp>`).

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

namespace detail {

/// One hybrid group as seen from one process: shared by that process's members of the group.
struct hybrid_group {
  int n = 0;                            ///< members
  int threads_per_process = 1;          ///< T of the world the group was split from
  std::vector<int> member_device;       ///< device of each group rank
  std::vector<int> member_proc_pos;     ///< position (in `counts`) of each member's process
  std::vector<int> member_local;        ///< rank of each member in its process's thread group
  std::vector<int> counts;              ///< members in each hosting process, processes ascending
  std::vector<int> gathered_to_rank;    ///< group rank of each position of the gathered order
  bool identity = true;                 ///< gathered order is group-rank order
  int my_proc_pos = 0;
  std::chrono::nanoseconds timeout{};
  mpi_communicator mpi;                 ///< over the hosting processes; used by the leader only
  MPI_Comm p2p = MPI_COMM_NULL;         ///< meshlib's duplicate for point-to-point between processes
  int tag_ub = 32767;

  std::mutex handoff_mutex;             ///< split results, from the leader to the other members
  std::map<std::uint64_t, std::pair<std::map<int, std::shared_ptr<hybrid_group>>, int>> handoff;

  hybrid_group() = default;
  hybrid_group(const hybrid_group&) = delete;
  hybrid_group& operator=(const hybrid_group&) = delete;
  ~hybrid_group() {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin && p2p != MPI_COMM_NULL) MPI_Comm_free(&p2p);
  }

  /// Fills the derived fields from the member devices (in group-rank order).
  void layout(int my_process) {
    n = static_cast<int>(member_device.size());
    std::vector<int> procs;
    for (int d : member_device) procs.push_back(d / threads_per_process);
    std::vector<int> sorted = procs;
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    counts.assign(sorted.size(), 0);
    member_proc_pos.resize(static_cast<std::size_t>(n));
    member_local.resize(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      const int pos = static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), procs[static_cast<std::size_t>(r)]) - sorted.begin());
      member_proc_pos[static_cast<std::size_t>(r)] = pos;
      member_local[static_cast<std::size_t>(r)] = counts[static_cast<std::size_t>(pos)]++;
    }
    my_proc_pos = static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), my_process) - sorted.begin());
    // Gathered order: processes ascending, members of one process in group-rank order.
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return member_proc_pos[static_cast<std::size_t>(a)] < member_proc_pos[static_cast<std::size_t>(b)];
    });
    gathered_to_rank = order;
    identity = true;
    for (int i = 0; i < n; ++i) identity = identity && order[static_cast<std::size_t>(i)] == i;
  }
  [[nodiscard]] bool spans_processes() const noexcept { return counts.size() > 1; }
  [[nodiscard]] bool uniform() const noexcept {
    return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts.front(); });
  }
};

}  // namespace detail

/// @brief One device's handle on a hybrid group (P processes x T threads). Move-only, as the
/// thread communicator it contains.
class hybrid_communicator {
 public:
  using is_communicator = void;
  using request_type = ready_request;
  using context_type = host_context;

  hybrid_communicator() = default;
  hybrid_communicator(hybrid_communicator&&) noexcept = default;
  hybrid_communicator& operator=(hybrid_communicator&&) noexcept = default;
  ~hybrid_communicator() { drain_sends(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return group_ ? group_->n : 0; }
  /// This device's handle on the members of its group in its own process.
  [[nodiscard]] thread_communicator& local() noexcept { return local_; }
  /// Whether the group spans more than one process.
  [[nodiscard]] bool spans_processes() const noexcept { return group_ && group_->spans_processes(); }

  // ---- reducing collectives (every input gathered, reduced in rank order) ---------------------

  template <comm_element T>
  request_type all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                          context_type = {}) {
    check_out_of_place("all_reduce", send, recv, send.size());
    reduce_to(std::span<const T>(send), recv.data(), op, send.size(), 0);
    return {};
  }
  template <comm_element T>
  request_type all_reduce(std::span<T> buf, reduce_op op, context_type = {}) {
    reduce_to(std::span<const T>(buf), buf.data(), op, buf.size(), 0);
    return {};
  }
  template <comm_element T>
  request_type reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root,
                      context_type = {}) {
    check_rank("reduce", root, "root");
    if (rank_ == root) check_out_of_place("reduce", send, recv, send.size());
    reduce_to(std::span<const T>(send), rank_ == root ? recv.data() : nullptr, op, send.size(), 0);
    return {};
  }
  template <comm_element T>
  request_type reduce(std::span<T> buf, reduce_op op, int root, context_type = {}) {
    check_rank("reduce", root, "root");
    reduce_to(std::span<const T>(buf), rank_ == root ? buf.data() : nullptr, op, buf.size(), 0);
    return {};
  }
  template <comm_element T>
  request_type reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                              context_type = {}) {
    const std::size_t count = recv.size();
    const std::size_t total = count * static_cast<std::size_t>(size());
    if (send.size() < total)
      bad_argument("reduce_scatter", "send buffer holds " + std::to_string(send.size()) +
                                         " elements but size() * recv.size() = " + std::to_string(total) + " are needed");
    check_out_of_place("reduce_scatter", send.first(total), recv, count);
    reduce_to(std::span<const T>(send.first(total)), recv.data(), op, count, static_cast<std::size_t>(rank_) * count);
    return {};
  }
  template <comm_element T>
  request_type reduce_scatter(std::span<T> buf, reduce_op op, context_type = {}) {
    const std::size_t count = blocks_of("reduce_scatter", buf.size());
    const std::vector<T> in(buf.begin(), buf.end());
    reduce_to(std::span<const T>(in), buf.data() + static_cast<std::size_t>(rank_) * count, op, count,
              static_cast<std::size_t>(rank_) * count);
    return {};
  }

  // ---- data movement ---------------------------------------------------------------------------

  template <comm_element T>
  request_type broadcast(std::span<const std::type_identity_t<T>> send, std::span<T> recv, int root,
                         context_type = {}) {
    check_rank("broadcast", root, "root");
    if (rank_ == root) {
      check_out_of_place("broadcast", send, recv, recv.size());
      if (send.size() < recv.size())
        bad_argument("broadcast", "root's send buffer holds " + std::to_string(send.size()) +
                                      " elements but recv.size() = " + std::to_string(recv.size()) + " are broadcast");
      if (!recv.empty()) std::memcpy(recv.data(), send.data(), recv.size_bytes());
    }
    do_broadcast(recv, root);
    return {};
  }
  template <comm_element T>
  request_type broadcast(std::span<T> buf, int root, context_type = {}) {
    check_rank("broadcast", root, "root");
    do_broadcast(buf, root);
    return {};
  }

  template <comm_element T>
  request_type all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type = {}) {
    check_out_of_place("all_gather", send, recv, send.size() * static_cast<std::size_t>(size()));
    const auto all = gather_all(std::span<const T>(send));
    std::copy(all.begin(), all.end(), recv.begin());
    return {};
  }
  template <comm_element T>
  request_type all_gather(std::span<T> buf, context_type = {}) {
    const std::size_t count = blocks_of("all_gather", buf.size());
    const std::vector<T> mine(buf.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank_) * count),
                              buf.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(rank_ + 1) * count));
    const auto all = gather_all(std::span<const T>(mine));
    std::copy(all.begin(), all.end(), buf.begin());
    return {};
  }

  template <comm_element T>
  request_type all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type = {}) {
    const std::size_t count = blocks_of("all_to_all", send.size());
    check_out_of_place("all_to_all", send, recv, send.size());
    transpose(std::span<const T>(send), recv.data(), count);
    return {};
  }
  template <comm_element T>
  request_type all_to_all(std::span<T> buf, context_type = {}) {
    const std::size_t count = blocks_of("all_to_all", buf.size());
    const std::vector<T> in(buf.begin(), buf.end());
    transpose(std::span<const T>(in), buf.data(), count);
    return {};
  }

  template <comm_element T>
  request_type all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, std::span<T> recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            context_type = {}) {
    constexpr const char* k = "all_to_all_v";
    check_usable(k);
    const auto n = static_cast<std::size_t>(size());
    check_layout(k, "send", send.size(), send_counts, send_displs);
    check_layout(k, "recv", recv.size(), recv_counts, recv_displs);
    // Every member's counts and displacements, then every member's whole send buffer.
    std::vector<std::int64_t> meta(2 * n);
    std::copy(send_counts.begin(), send_counts.end(), meta.begin());
    std::copy(send_displs.begin(), send_displs.end(), meta.begin() + static_cast<std::ptrdiff_t>(n));
    const auto metas = gather_all(std::span<const std::int64_t>(meta));
    std::vector<std::size_t> offsets;
    const auto data = gather_var(std::span<const T>(send), offsets);
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t c = metas[j * 2 * n + static_cast<std::size_t>(rank_)];
      const std::int64_t d = metas[j * 2 * n + n + static_cast<std::size_t>(rank_)];
      if (c != recv_counts[j])
        throw collective_mismatch("meshlib: all_to_all_v on hybrid device " + std::to_string(rank_) + ": recv_counts[" +
                                  std::to_string(j) + "] = " + std::to_string(recv_counts[j]) + " but device " +
                                  std::to_string(j) + " sends " + std::to_string(c) + " elements");
      std::copy_n(data.begin() + static_cast<std::ptrdiff_t>(offsets[j] + static_cast<std::size_t>(d)), c,
                  recv.begin() + recv_displs[j]);
    }
    return {};
  }

  template <comm_element T>
  request_type ppermute(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const permute_pair> pairs, context_type = {}) {
    check_pairs(pairs);
    check_out_of_place("ppermute", send, recv, send.size());
    permute(std::span<const T>(send), recv.data(), pairs);
    return {};
  }
  template <comm_element T>
  request_type ppermute(std::span<T> buf, std::span<const permute_pair> pairs, context_type = {}) {
    check_pairs(pairs);
    const std::vector<T> in(buf.begin(), buf.end());
    permute(std::span<const T>(in), buf.data(), pairs);
    return {};
  }

  // ---- point to point --------------------------------------------------------------------------

  /// Buffered, as on the other backends: within a process through the thread communicator,
  /// between processes with `MPI_Isend` from this thread.
  template <class T>
    requires comm_element<T>
  request_type send(std::span<T> buf, int dest, int tag = 0, context_type = {}) {
    check_rank("send", dest, "destination");
    check_tag("send", tag);
    const auto& g = *group_;
    const auto d = static_cast<std::size_t>(dest);
    if (g.member_proc_pos[d] == g.my_proc_pos) return local_.send(buf, g.member_local[d], tag);
    progress_sends();
    pending p;
    p.data.resize(buf.size_bytes());
    if (!buf.empty()) std::memcpy(p.data.data(), buf.data(), buf.size_bytes());
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(buf.size()), detail::mpi_datatype<std::remove_cv_t<T>>(),
                       g.member_proc_pos[d], wire_tag(tag, my_local(), g.member_local[d]), g.p2p, &p.request),
             "MPI_Isend");
    sends_.push_back(std::move(p));
    return {};
  }

  template <comm_element T>
  request_type recv(std::span<T> buf, int source, int tag = 0, context_type = {}) {
    check_rank("recv", source, "source");
    check_tag("recv", tag);
    const auto& g = *group_;
    const auto s = static_cast<std::size_t>(source);
    if (g.member_proc_pos[s] == g.my_proc_pos) return local_.recv(buf, g.member_local[s], tag);
    MPI_Status st;
    MPI_Message msg = MPI_MESSAGE_NULL;
    const int wtag = wire_tag(tag, g.member_local[s], my_local());
    const auto deadline = std::chrono::steady_clock::now() + g.timeout;
    for (unsigned spins = 0;; ++spins) {
      progress_sends();
      int found = 0;
      check_rc(MPI_Improbe(g.member_proc_pos[s], wtag, g.p2p, &found, &msg, &st), "MPI_Improbe");
      if (found) break;
      if (spins > 256) std::this_thread::yield();
      if (g.timeout.count() > 0 && (spins & 63) == 0 && std::chrono::steady_clock::now() > deadline)
        throw comm_timeout("meshlib: recv on hybrid device " + std::to_string(rank_) + " from device " +
                           std::to_string(source) + " (tag " + std::to_string(tag) + ") timed out");
    }
    int got = 0;
    MPI_Get_count(&st, detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(buf.size())) {
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<unsigned char> sink(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on hybrid device " + std::to_string(rank_) + " expected " +
                                std::to_string(buf.size()) + " elements from device " + std::to_string(source) +
                                " but the message holds " + std::to_string(got));
    }
    check_rc(MPI_Mrecv(buf.data(), got, detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
    return {};
  }

  // ---- synchronisation and groups --------------------------------------------------------------

  request_type barrier(context_type = {}) {
    const std::int32_t token = 0;
    (void)gather_all(std::span<const std::int32_t>(&token, 1));
    return {};
  }

  /// Collective over the group: members with the same `color` form a new hybrid group, ordered by
  /// (key, rank). The processes hosting a new group that spans several get an MPI communicator
  /// split from this group's (one `MPI_Comm_split` per such color).
  hybrid_communicator split(int color, int key) {
    check_usable("split");
    if (color < 0) bad_argument("split", "color " + std::to_string(color) + " is negative; colors are >= 0");
    auto& g = *group_;
    const std::int64_t mine[3] = {color, key, g.member_device[static_cast<std::size_t>(rank_)]};
    const auto info = gather_all(std::span<const std::int64_t>(mine, 3));
    const int n = size();
    // Members of each color, in new-rank order.
    std::map<int, std::vector<int>> by_color;  // color -> old ranks
    for (int r = 0; r < n; ++r) by_color[static_cast<int>(info[static_cast<std::size_t>(3 * r)])].push_back(r);
    for (auto& [c, members] : by_color)
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return info[static_cast<std::size_t>(3 * a + 1)] < info[static_cast<std::size_t>(3 * b + 1)];
      });
    const auto& mine_members = by_color[color];
    const int new_rank = static_cast<int>(std::find(mine_members.begin(), mine_members.end(), rank_) - mine_members.begin());
    thread_communicator sub_local = local_.split(color, new_rank);

    const std::uint64_t seq = split_seq_++;
    const int my_process = g.member_device[static_cast<std::size_t>(rank_)] / g.threads_per_process;
    if (local_.rank() == 0) {
      try {
        std::map<int, std::shared_ptr<detail::hybrid_group>> made;
        for (const auto& [c, members] : by_color) {
          auto ng = std::make_shared<detail::hybrid_group>();
          ng->threads_per_process = g.threads_per_process;
          ng->timeout = g.timeout;
          for (int r : members) ng->member_device.push_back(static_cast<int>(info[static_cast<std::size_t>(3 * r + 2)]));
          ng->layout(my_process);
          bool hosts = false;
          for (int d : ng->member_device) hosts = hosts || d / g.threads_per_process == my_process;
          if (ng->spans_processes()) {
            // Every process of this group takes part; only the hosts keep the result.
            mpi_communicator sub = g.mpi.split(hosts ? 1 : 0, my_process);
            if (hosts) {
              ng->mpi = std::move(sub);
              check_rc(MPI_Comm_dup(ng->mpi.native(), &ng->p2p), "MPI_Comm_dup");
              MPI_Comm_set_errhandler(ng->p2p, MPI_ERRORS_RETURN);
              set_tag_ub(*ng);
            }
          }
          if (hosts) made.emplace(c, std::move(ng));
        }
        std::lock_guard lk(g.handoff_mutex);
        g.handoff[seq] = {std::move(made), local_.size()};
      } catch (const std::exception& e) {
        local_.abort(std::string("hybrid split failed on the process leader: ") + e.what());
        throw;
      }
    }
    local_.barrier();  // the leader has published
    std::shared_ptr<detail::hybrid_group> ng;
    {
      std::lock_guard lk(g.handoff_mutex);
      auto it = g.handoff.find(seq);
      ng = it->second.first.at(color);
      if (--it->second.second == 0) g.handoff.erase(it);
    }
    hybrid_communicator out;
    out.group_ = std::move(ng);
    out.local_ = std::move(sub_local);
    out.rank_ = new_rank;
    return out;
  }

 private:
  friend class hybrid_world;

  struct pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
  };

  static void set_tag_ub(detail::hybrid_group& g) {
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(g.p2p, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) g.tag_ub = *ub;
  }

  int my_local() const noexcept { return group_->member_local[static_cast<std::size_t>(rank_)]; }

  int wire_tag(int tag, int src_local, int dst_local) const {
    const auto l = static_cast<std::int64_t>(*std::max_element(group_->counts.begin(), group_->counts.end()));
    const std::int64_t t = (static_cast<std::int64_t>(tag) * l + src_local) * l + dst_local;
    if (t > group_->tag_ub)
      bad_argument("send", "tag " + std::to_string(tag) + " is too large for a hybrid group with " + std::to_string(l) +
                               " threads per process (MPI's tag bound is " + std::to_string(group_->tag_ub) + ")");
    return static_cast<int>(t);
  }

  // ---- checks ----------------------------------------------------------------------------------

  std::string where(std::string_view k) const {
    return std::string(k) + " on hybrid device " + std::to_string(rank_) + " of " + std::to_string(size());
  }
  void check_usable(std::string_view k) const {
    if (!group_)
      throw comm_error("meshlib: " + std::string(k) + " called on an empty hybrid_communicator handle");
  }
  [[noreturn]] void bad_argument(std::string_view k, const std::string& what) const {
    throw comm_argument_error("meshlib: invalid argument to " + where(k) + ": " + what);
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed on hybrid device " + std::to_string(rank_) + ": " +
                       detail::mpi_error_string(rc));
  }
  void check_rank(std::string_view k, int r, const char* what) const {
    check_usable(k);
    if (r < 0 || r >= size())
      bad_argument(k, std::string(what) + " " + std::to_string(r) + " is out of range [0, " + std::to_string(size()) + ")");
  }
  void check_tag(std::string_view k, int tag) const {
    if (tag < 0) bad_argument(k, "tag " + std::to_string(tag) + " is negative");
  }
  template <class T>
  void check_out_of_place(std::string_view k, std::span<const T> send, std::span<T> recv, std::size_t needed) const {
    check_usable(k);
    if (auto problem = detail::out_of_place_problem(send, recv, needed); !problem.empty()) bad_argument(k, problem);
  }
  std::size_t blocks_of(std::string_view k, std::size_t total) const {
    check_usable(k);
    const auto n = static_cast<std::size_t>(size());
    if (total % n != 0)
      bad_argument(k, "buffer of " + std::to_string(total) + " elements does not split into " + std::to_string(n) +
                          " equal blocks");
    return total / n;
  }
  void check_layout(std::string_view k, const char* which, std::size_t buffer, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs) const {
    const auto n = static_cast<std::size_t>(size());
    if (counts.size() != n || displs.size() != n)
      bad_argument(k, std::string(which) + " counts and displacements need " + std::to_string(n) + " entries each");
    for (std::size_t j = 0; j < n; ++j)
      if (counts[j] < 0 || displs[j] < 0 || static_cast<std::uint64_t>(counts[j] + displs[j]) > buffer)
        bad_argument(k, std::string(which) + " block " + std::to_string(j) + " (displacement " +
                            std::to_string(displs[j]) + ", count " + std::to_string(counts[j]) +
                            ") is negative or runs past the end of the buffer of " + std::to_string(buffer) + " elements");
  }
  void check_pairs(std::span<const permute_pair> pairs) const {
    check_usable("ppermute");
    const int n = size();
    std::vector<char> src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
    for (const auto& p : pairs) {
      if (p.source < 0 || p.source >= n || p.dest < 0 || p.dest >= n)
        bad_argument("ppermute", "pair (" + std::to_string(p.source) + ", " + std::to_string(p.dest) +
                                     ") names a rank out of range [0, " + std::to_string(n) + ")");
      if (src[static_cast<std::size_t>(p.source)]++)
        bad_argument("ppermute", "rank " + std::to_string(p.source) + " is the source of two pairs");
      if (dst[static_cast<std::size_t>(p.dest)]++)
        bad_argument("ppermute", "rank " + std::to_string(p.dest) + " is the destination of two pairs");
    }
  }

  // ---- the three-step exchange -----------------------------------------------------------------

  /// Every member's `mine` (all the same length), in group-rank order.
  template <class T>
  std::vector<T> gather_all(std::span<const T> mine) {
    check_usable("collective");
    auto& g = *group_;
    const std::size_t c = mine.size();
    std::vector<T> local_all(static_cast<std::size_t>(local_.size()) * c);
    local_.all_gather(mine, std::span(local_all));
    if (!g.spans_processes()) return reorder(std::move(local_all), c);
    std::vector<T> all(static_cast<std::size_t>(g.n) * c);
    if (local_.rank() == 0) {
      try {
        if (g.uniform()) {
          g.mpi.all_gather(std::span<const T>(local_all), std::span(all));
        } else {
          const std::size_t np = g.counts.size();
          std::vector<std::int64_t> sc(np, static_cast<std::int64_t>(local_all.size())), sd(np, 0), rc(np), rd(np);
          std::int64_t off = 0;
          for (std::size_t j = 0; j < np; ++j) {
            rc[j] = static_cast<std::int64_t>(static_cast<std::size_t>(g.counts[j]) * c);
            rd[j] = off;
            off += rc[j];
          }
          g.mpi.all_to_all_v(std::span<const T>(local_all), std::span<const std::int64_t>(sc),
                             std::span<const std::int64_t>(sd), std::span(all), std::span<const std::int64_t>(rc),
                             std::span<const std::int64_t>(rd));
        }
      } catch (const std::exception& e) {
        local_.abort(std::string("the process leader's MPI exchange failed: ") + e.what());
        throw;
      }
    }
    local_.broadcast(std::span(all), 0);
    return reorder(std::move(all), c);
  }

  /// Every member's `mine` (lengths may differ), concatenated in group-rank order; offsets[r] is
  /// where member r's part starts.
  template <class T>
  std::vector<T> gather_var(std::span<const T> mine, std::vector<std::size_t>& offsets) {
    const std::int64_t len = static_cast<std::int64_t>(mine.size());
    const auto lens = gather_all(std::span<const std::int64_t>(&len, 1));
    const auto longest = static_cast<std::size_t>(*std::max_element(lens.begin(), lens.end()));
    std::vector<T> padded(longest);
    std::copy(mine.begin(), mine.end(), padded.begin());
    const auto all = gather_all(std::span<const T>(padded));
    std::vector<T> out;
    offsets.assign(lens.size(), 0);
    for (std::size_t r = 0; r < lens.size(); ++r) {
      offsets[r] = out.size();
      out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>(r * longest),
                 all.begin() + static_cast<std::ptrdiff_t>(r * longest + static_cast<std::size_t>(lens[r])));
    }
    return out;
  }

  template <class T>
  std::vector<T> reorder(std::vector<T> gathered, std::size_t c) const {
    const auto& g = *group_;
    if (g.identity) return gathered;
    std::vector<T> out(gathered.size());
    for (std::size_t pos = 0; pos < g.gathered_to_rank.size(); ++pos)
      std::copy_n(gathered.begin() + static_cast<std::ptrdiff_t>(pos * c), c,
                  out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(g.gathered_to_rank[pos]) * c));
    return out;
  }

  /// out[i] = op over members of their input[offset + i], i < count (out == nullptr: nothing written).
  template <class T>
  void reduce_to(std::span<const T> input, T* out, reduce_op op, std::size_t count, std::size_t offset) {
    check_usable("reduce");
    const auto all = gather_all(input);
    if (!out || count == 0) return;
    const std::size_t per = input.size();
    std::vector<const T*> ptrs(static_cast<std::size_t>(size()));
    for (std::size_t r = 0; r < ptrs.size(); ++r) ptrs[r] = all.data() + r * per + offset;
    T* outs[1] = {out};
    detail::reduce_into<T>(op, ptrs.data(), size(), outs, 1, count);
  }

  template <class T>
  void transpose(std::span<const T> send, T* recv, std::size_t count) {
    const auto all = gather_all(send);
    const std::size_t per = send.size();
    for (std::size_t j = 0; j < static_cast<std::size_t>(size()); ++j)
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(j * per + static_cast<std::size_t>(rank_) * count), count,
                  recv + j * count);
  }

  template <class T>
  void permute(std::span<const T> send, T* recv, std::span<const permute_pair> pairs) {
    const auto all = gather_all(send);
    const std::size_t c = send.size();
    std::fill(recv, recv + c, T{});
    for (const auto& p : pairs)
      if (p.dest == rank_)
        std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p.source) * c), c, recv);
  }

  template <class T>
  void do_broadcast(std::span<T> buf, int root) {
    auto& g = *group_;
    const auto r = static_cast<std::size_t>(root);
    const int root_pos = g.member_proc_pos[r];
    if (!g.spans_processes()) {
      local_.broadcast(buf, g.member_local[r]);
      return;
    }
    if (g.my_proc_pos == root_pos) local_.broadcast(buf, g.member_local[r]);
    if (local_.rank() == 0) {
      try {
        g.mpi.broadcast(buf, root_pos);
      } catch (const std::exception& e) {
        local_.abort(std::string("the process leader's MPI broadcast failed: ") + e.what());
        throw;
      }
    }
    if (g.my_proc_pos != root_pos) local_.broadcast(buf, 0);
  }

  void progress_sends() {
    sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                                [](pending& p) {
                                  int done = 0;
                                  MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
                                  return done != 0;
                                }),
                 sends_.end());
  }
  void drain_sends() noexcept {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    for (auto& p : sends_) {
      if (p.request == MPI_REQUEST_NULL) continue;
      MPI_Request_free(&p.request);
      (void)new std::vector<unsigned char>(std::move(p.data));  // MPI may still read it
    }
    sends_.clear();
  }

  std::shared_ptr<detail::hybrid_group> group_;
  thread_communicator local_;
  int rank_ = 0;
  std::uint64_t split_seq_ = 0;
  std::vector<pending> sends_;
};

static_assert(communicator<hybrid_communicator>);

/// @brief One process's part of a hybrid group of `procs.size()` processes x `threads` threads.
/// Construction is collective over `procs` (it duplicates it for point-to-point traffic).
class hybrid_world {
 public:
  /// @throws comm_error when T > 1 and MPI does not provide `MPI_THREAD_MULTIPLE`;
  /// comm_argument_error when threads < 1.
  hybrid_world(const mpi_communicator& procs, int threads, thread_comm_options options = {})
      : threads_(threads), local_(threads > 0 ? threads : 1, std::move(options)) {
    if (threads < 1)
      throw comm_argument_error("meshlib: a hybrid_world needs at least 1 thread per process, got " +
                                std::to_string(threads));
    int level = 0;
    MPI_Query_thread(&level);
    if (threads > 1 && level < MPI_THREAD_MULTIPLE)
      throw comm_error("meshlib: a hybrid mesh with " + std::to_string(threads) +
                       " threads per process needs MPI_THREAD_MULTIPLE, but MPI was initialised with a lower thread "
                       "level; initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or meshlib::mpi::initialize");
    group_ = std::make_shared<detail::hybrid_group>();
    group_->threads_per_process = threads;
    group_->timeout = procs.options().timeout;
    for (int d = 0; d < procs.size() * threads; ++d) group_->member_device.push_back(d);
    group_->layout(procs.rank());
    group_->mpi = procs;
    if (MPI_Comm_dup(procs.native(), &group_->p2p) != MPI_SUCCESS)
      throw comm_error("meshlib: hybrid_world: MPI_Comm_dup failed");
    MPI_Comm_set_errhandler(group_->p2p, MPI_ERRORS_RETURN);
    hybrid_communicator::set_tag_ub(*group_);
    process_ = procs.rank();
  }

  /// Devices in the world: processes x threads.
  [[nodiscard]] int size() const noexcept { return group_->n; }
  [[nodiscard]] int threads_per_process() const noexcept { return threads_; }

  /// The handle of local thread `t` (device `process * T + t`); each once.
  [[nodiscard]] hybrid_communicator communicator(int t) {
    hybrid_communicator c;
    c.local_ = local_.communicator(t);
    c.group_ = group_;
    c.rank_ = process_ * threads_ + t;
    return c;
  }

  /// Fails this process's thread group (its members get `comm_aborted`).
  bool abort(int t, std::string_view reason) { return local_.abort(t, reason); }
  [[nodiscard]] bool failed() const noexcept { return local_.failed(); }
  /// Local thread of the root cause of a failure, -1 when none.
  [[nodiscard]] int root_cause_thread() const { return local_.root_cause_rank(); }

 private:
  int threads_;
  int process_ = 0;
  thread_world local_;
  std::shared_ptr<detail::hybrid_group> group_;
};

/// @brief Runs `fn(hybrid_communicator&)` on `threads` threads of this process, as device
/// `process * threads + t` of a hybrid world over `procs`; joins them and rethrows the first
/// failure as `participant_error` (with the device). Collective over `procs`.
template <class F>
  requires std::is_invocable_v<F&, hybrid_communicator&>
void run_hybrid(const mpi_communicator& procs, int threads, F&& fn, thread_comm_options options = {}) {
  hybrid_world world(procs, threads, std::move(options));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  auto body = [&](int t) {
    try {
      hybrid_communicator comm = world.communicator(t);
      fn(comm);
    } catch (...) {
      errors[static_cast<std::size_t>(t)] = std::current_exception();
      world.abort(t, detail::what_of(errors[static_cast<std::size_t>(t)]));
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  // The root cause: the thread that failed first (its peers then saw comm_aborted), else the
  // lowest thread that threw.
  int root = world.failed() ? world.root_cause_thread() : -1;
  if (root < 0 || root >= threads || !errors[static_cast<std::size_t>(root)]) {
    root = -1;
    for (int t = 0; t < threads && root < 0; ++t)
      if (errors[static_cast<std::size_t>(t)]) root = t;
  }
  if (root >= 0) {
    const int t = root;
    const auto& e = errors[static_cast<std::size_t>(t)];
    const int device = procs.rank() * threads + t;
    try {
      std::rethrow_exception(e);
    } catch (...) {
      throw participant_error(device, "meshlib: hybrid device " + std::to_string(device) + " of " +
                                          std::to_string(world.size()) + " failed: " + detail::what_of(e));
    }
  }
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
