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
/// different groups call MPI concurrently), else `comm_error` at construction. When a device fails
/// (it throws, or a mismatch fails its process's thread group), every device of every process is
/// released within milliseconds with `comm_aborted` naming the global device ("hybrid device 3 of
/// 4 failed: <what>"): its process aborts its thread group and tells the others through an abort
/// channel (`detail::abort_channel`: a duplicate communicator polled by a watcher thread; on with
/// `MPI_THREAD_MULTIPLE`), whose leaders' MPI waits end too. A device that never arrives is
/// detected by its local peers, and every device of every process gets `comm_timeout` naming the
/// operation the user called and the global device(s) that never arrived ("all_reduce timed out on
/// hybrid device 2 of 4 after 1 s: hybrid device(s) 3 never arrived"; the leaders' exchange waits
/// a little longer, `hybrid_group::patience`, so that this precise report comes first). Errors of
/// the internal steps are rethrown naming the operation the user called; a failed world refuses
/// every later call. `run_hybrid` throws `participant_error` naming the global device at fault
/// (for a timeout, the device that never arrived).

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <atomic>
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
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/mpi/detail/abort_channel.hpp"
#include "meshlib/comm/mpi/detail/call_record.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

namespace comm::detail {

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
  /// How much longer than a local step a member waits for its leader's exchange between processes
  /// (`thread_communicator::patience_`); the leaders' own MPI waits get half of it. So a device
  /// that never arrives is detected first in its own process, by the peers that wait for it
  /// locally, and their report naming it reaches every process before anyone blames a leader.
  std::chrono::nanoseconds patience{};
  mpi_communicator mpi;                 ///< over the hosting processes; used by the leader only
  std::shared_ptr<abort_channel> channel;  ///< the world's (shared by every group split from it)
  MPI_Comm p2p = MPI_COMM_NULL;         ///< meshlib's duplicate for point-to-point between processes
  int tag_ub = 32767;

  std::mutex handoff_mutex;             ///< split results, from the leader to the other members
  std::map<std::uint64_t, std::pair<std::map<int, std::shared_ptr<hybrid_group>>, int>> handoff;

  hybrid_group() = default;
  hybrid_group(const hybrid_group&) = delete;
  hybrid_group& operator=(const hybrid_group&) = delete;
  ~hybrid_group();

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

inline hybrid_group::~hybrid_group() {
  int fin = 0;
  MPI_Finalized(&fin);
  // After a failure, point-to-point messages of the abandoned operations may still be in flight
  // to this process: the duplicate stays allocated so that no later communicator inherits them
  // with its context id (detail/settle.hpp).
  // A group that an exception unwinds (a device thread leaving fn, with the sub-communicators it
  // split) is dying before run_hybrid's handler records the failure in the channel, so
  // `interrupted` may still be false although the run is failing and a peer's send may still be
  // on its way: treat it as failed. Defensive (no crash was traced to it): it costs one
  // communicator left allocated on a failing run.
  const bool failed = (channel && channel->interrupted.load()) || std::uncaught_exceptions() > 0;
  if (!fin && !failed && p2p != MPI_COMM_NULL) MPI_Comm_free(&p2p);
}

}  // namespace comm::detail

/// @brief One device's handle on a hybrid group (P processes x T threads). Move-only, as the
/// thread communicator it contains.
class hybrid_communicator : public communicator_frontend<hybrid_communicator> {
  friend class communicator_frontend<hybrid_communicator>;
  using op_kind = comm::detail::op_kind;

 public:

  hybrid_communicator() = default;
  /// Movable: the moved-from communicator is no longer valid.
  hybrid_communicator(hybrid_communicator&&) noexcept = default;
  /// Move assignment: the moved-from communicator is no longer valid.
  hybrid_communicator& operator=(hybrid_communicator&&) noexcept = default;
  ~hybrid_communicator() { drain_sends(); }

  /// This participant's rank over all processes and threads.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of participants: processes times threads per process (0 when moved from).
  [[nodiscard]] int size() const noexcept { return group_ ? group_->n : 0; }
  /// This device's handle on the members of its group in its own process.
  [[nodiscard]] thread_communicator& local() noexcept { return local_; }
  /// Whether the group spans more than one process.
  [[nodiscard]] bool spans_processes() const noexcept { return group_ && group_->spans_processes(); }

  // The collectives, point to point and barrier: communicator_frontend; the transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// Collective over the group: members with the same `color` form a new hybrid group, ordered by
  /// (key, rank). The processes hosting a new group that spans several get an MPI communicator
  /// split from this group's (one `MPI_Comm_split` per such color).
  hybrid_communicator split(int color, int key) {
    check_split(color);
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
        std::map<int, std::shared_ptr<comm::detail::hybrid_group>> made;
        for (const auto& [c, members] : by_color) {
          auto ng = std::make_shared<comm::detail::hybrid_group>();
          ng->threads_per_process = g.threads_per_process;
          ng->timeout = g.timeout;
          ng->patience = g.patience;
          ng->channel = g.channel;
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
    std::shared_ptr<comm::detail::hybrid_group> ng;
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

  static void set_tag_ub(comm::detail::hybrid_group& g) {
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
      bad_argument(op_kind::send, "tag " + std::to_string(tag) + " is too large for a hybrid group with " + std::to_string(l) +
                               " threads per process (MPI's tag bound is " + std::to_string(group_->tag_ub) + ")");
    return static_cast<int>(t);
  }

  // ---- the front end's hooks -------------------------------------------------------------------

  std::string label() const { return "hybrid device " + std::to_string(rank_); }
  void check_usable(std::string_view k) const {
    if (!group_)
      throw comm_error("meshlib: " + std::string(k) + " called on an empty hybrid_communicator handle");
  }
  void ensure_usable(op_kind k) const;

  /// Runs `f` (a transport), rethrowing a failure of the internal steps with the same type and
  /// root-cause message but naming the operation the user called and the global device.
  template <class F>
  request_type guarded(op_kind k, F&& f) {
    auto context = [&](const std::exception& e) {
      std::string m = e.what();
      if (const auto at = m.rfind(" ["); at != std::string::npos && m.back() == ']') m.erase(at);
      return m + " [seen by " + std::string(comm::detail::op_name(k)) + " on " + label() + " of " + std::to_string(size()) + "]";
    };
    current_ = k;
    try {
      return f();
    } catch (const comm_argument_error&) {
      throw;
    } catch (const comm_aborted& e) {
      throw comm_aborted(context(e));
    } catch (const comm_timeout& e) {
      throw comm_timeout(context(comm_timeout(restate_timeout(k, e))));
    } catch (const collective_mismatch& e) {
      throw collective_mismatch(context(e));
    }
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed on hybrid device " + std::to_string(rank_) + ": " +
                       comm::detail::mpi_error_string(rc));
  }

  // ---- failures seen by one process, told to all ------------------------------------------------

  /// Global device of local thread `t` of this process.
  int device_of_thread(int t) const {
    const auto& g = *group_;
    return g.member_device[static_cast<std::size_t>(rank_)] / g.threads_per_process * g.threads_per_process + t;
  }

  /// Records failure `msg` of kind `k` for every device of every process: the abort channel, whose
  /// report the other processes' watchers turn into the same error, then this process's thread
  /// world (unless it failed already, as it has when it detected the failure itself).
  /// `culprit`: the global device at fault, -1 when unknown.
  void tell_everyone(comm::detail::failure_kind k, int culprit, const std::string& msg) {
    auto& ch = *group_->channel;
    const bool remote = culprit >= 0 && culprit / group_->threads_per_process !=
                                            device_of_thread(0) / group_->threads_per_process;
    int none = -1;
    if (remote) ch.remote_device.compare_exchange_strong(none, culprit);  // run_hybrid blames it
    // The channel first (see the watcher in hybrid_world): a device released by the thread world
    // that leaves run_hybrid must find this root cause there, not record its own abort.
    ch.interrupt(msg, culprit, k);
    ch.notify(culprit, msg, k);
    local_.state_->world->fail(k, -1, msg);
  }

  /// A timeout in terms of the user's call: when this process's thread world detected it (a local
  /// peer never arrived at an internal step), the message names the operation the user called and
  /// the global devices that never arrived, never an internal step or a local thread, and every
  /// process is told; a timeout from elsewhere (another process's report, or the leader's exchange,
  /// `leader_failed`) is already in those terms.
  std::string restate_timeout(op_kind k, const comm_timeout& e) {
    comm::detail::missing_report facts;
    if (!local_.valid() || !local_.state_->world->timeout_facts(facts)) return e.what();
    const std::string msg = comm::detail::timeout_message(
        comm::detail::op_name(k), "hybrid device " + std::to_string(device_of_thread(facts.waiter)), size(),
        local_.state_->policy.timeout,
        comm::detail::list_participants("hybrid device", facts.missing,
                                  [&](int t) { return std::to_string(device_of_thread(t)); }),
        "thread_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
    tell_everyone(comm::detail::failure_kind::timeout,
                  device_of_thread(facts.missing.empty() ? facts.waiter : facts.missing.front()), msg);
    return msg;
  }

  /// The leader's exchange between processes failed with `e` (rethrown by the caller). Its own
  /// timeout means whole processes never reached the exchange (their devices were not even
  /// missing locally, or their report would have come first): named by their devices, with the
  /// operation the user called, and told to every process. Any other failure aborts this
  /// process's thread world, so that the members waiting for the leader are released.
  void leader_failed(const std::exception& e) {
    auto& g = *group_;
    if (g.channel->interrupted.load()) {
      // Released by the root cause the channel holds (from another process, or from a device
      // here): the members waiting for this leader get the same error.
      std::string msg;
      const auto kind = g.channel->recorded(msg);
      local_.state_->world->fail(kind, -1, msg);
      return;
    }
    if (dynamic_cast<const comm_timeout*>(&e) == nullptr) {
      local_.abort(std::string("the process leader's MPI exchange failed: ") + e.what());
      return;
    }
    std::vector<int> devices;
    for (int pos : g.mpi.state_->missing)
      for (int r = 0; r < g.n; ++r)
        if (g.member_proc_pos[static_cast<std::size_t>(r)] == pos) devices.push_back(g.member_device[static_cast<std::size_t>(r)]);
    std::sort(devices.begin(), devices.end());
    const std::string who = comm::detail::list_participants("hybrid device", devices, [](int d) { return std::to_string(d); });
    const std::string msg = comm::detail::timeout_message(
        comm::detail::op_name(current_), "hybrid device " + std::to_string(g.member_device[static_cast<std::size_t>(rank_)]),
        size(), g.mpi.state_->options.timeout, who.empty() ? who : who + " (whole processes)",
        "thread_comm_options::timeout, mpi_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
    tell_everyone(comm::detail::failure_kind::timeout, devices.empty() ? -1 : devices.front(), msg);
    throw comm_timeout(msg);
  }

  /// While a member waits for its leader's exchange between processes (see `hybrid_group::patience`).
  struct patient {
    thread_communicator& c;
    patient(thread_communicator& comm, std::chrono::nanoseconds extra) : c(comm) { c.patience_ = extra; }
    patient(const patient&) = delete;
    patient& operator=(const patient&) = delete;
    ~patient() { c.patience_ = std::chrono::nanoseconds(0); }
  };

  /// The transport of operation K (the front end has checked its arguments). Every collective
  /// gathers its inputs before it writes an output, so in-place calls need no copies.
  template <op_kind K, class T>
  request_type transport(const comm::detail::operation<T>& o, context_type ctx) {
    return guarded(K, [&] {
      if constexpr (K != op_kind::send && K != op_kind::recv) {
        agree(K, o);
        if constexpr (K == op_kind::barrier) return request_type{};  // the fingerprint exchange is a barrier
      }
      return transport_steps<K, T>(o, ctx);
    });
  }

  /// Always-on mismatch detection across every device of every process. Before the data moves,
  /// the members gather a fingerprint of their calls (call number on this group, operation,
  /// element type, count, reduce op, root, ppermute pairs) with the same internal exchange every
  /// call shares, so that all members see every call and every member of every process throws
  /// `collective_mismatch` naming the operation it called and each device's call (global device
  /// ids), instead of an internal step failing on one process leader.
  template <class T>
  void agree(op_kind k, const comm::detail::operation<T>& o) {
    const bool has_op = comm::detail::uses_op(k);
    const bool has_root = comm::detail::uses_root(k);
    const std::uint64_t rec[call_fields] = {calls_++,
                                            static_cast<std::uint64_t>(k),
                                            k == op_kind::barrier ? 0 : static_cast<std::uint64_t>(datatype_of<T>) + 1,
                                            static_cast<std::uint64_t>(o.count),
                                            has_op ? static_cast<std::uint64_t>(o.op) : 0,
                                            has_root ? static_cast<std::uint64_t>(o.root) : 0,
                                            k == op_kind::ppermute ? comm::detail::pairs_hash(o.pairs) : 0};
    // int64 on the wire (a communicator element type); the bits are the record's.
    std::int64_t wire[call_fields];
    std::memcpy(wire, rec, sizeof(rec));
    const auto got = gather_all(std::span<const std::int64_t>(wire, call_fields));
    std::vector<std::uint64_t> all(got.size());
    std::memcpy(all.data(), got.data(), got.size() * sizeof(std::uint64_t));
    bool same = true;
    for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == rec[i % call_fields];
    if (same) return;
    const auto& g = *group_;
    // Blame the device whose call differed (see `odd_member`), computed from every member's call
    // as every member has them: every process blames the same device, whichever saw it first.
    if (g.channel) g.channel->blame_mismatch(g.member_device[odd_member(all, static_cast<std::size_t>(size()))]);
    std::string msg = "meshlib: collective mismatch on a hybrid communicator of " + std::to_string(size()) +
                      " devices: the devices called different collectives";
    for (int r = 0; r < size(); ++r)
      msg += (r ? "; " : ": ") +
             comm::detail::describe_record("hybrid device " + std::to_string(g.member_device[static_cast<std::size_t>(r)]),
                                   all.data() + call_fields * static_cast<std::size_t>(r));
    throw collective_mismatch(msg);
  }
  static constexpr std::size_t call_fields = 7;

  /// The member whose call differs from the most common call among `n` members' records (`all`,
  /// `call_fields` words each; ties between equally common calls go to the one of the lowest
  /// member), the lowest such member when several differ. With two members that disagree, member
  /// 1. A pure function of the records, so every member computes the same.
  static std::size_t odd_member(const std::vector<std::uint64_t>& all, std::size_t n) {
    auto same = [&](std::size_t a, std::size_t b) {
      return std::equal(all.begin() + static_cast<std::ptrdiff_t>(a * call_fields),
                        all.begin() + static_cast<std::ptrdiff_t>((a + 1) * call_fields),
                        all.begin() + static_cast<std::ptrdiff_t>(b * call_fields));
    };
    std::size_t common = 0, most = 0;
    for (std::size_t a = 0; a < n; ++a) {
      std::size_t count = 0;
      for (std::size_t b = 0; b < n; ++b) count += same(a, b) ? 1 : 0;
      if (count > most) {
        most = count;
        common = a;
      }
    }
    for (std::size_t a = 0; a < n; ++a)
      if (!same(a, common)) return a;
    return 0;
  }

  template <op_kind K, class T>
  request_type transport_steps(const comm::detail::operation<T>& o, context_type) {
    const auto n = static_cast<std::size_t>(size());
    if constexpr (K == op_kind::all_reduce) {
      reduce_to(std::span<const T>(o.send, o.count), o.recv, o.op, o.count, 0);
    } else if constexpr (K == op_kind::reduce) {
      reduce_to(std::span<const T>(o.send, o.count), rank_ == o.root ? o.recv : nullptr, o.op, o.count, 0);
    } else if constexpr (K == op_kind::reduce_scatter) {
      reduce_to(std::span<const T>(o.send, o.count * n), o.recv, o.op, o.count,
                static_cast<std::size_t>(rank_) * o.count);
    } else if constexpr (K == op_kind::broadcast) {
      if (rank_ == o.root && !o.in_place && o.count != 0) std::memcpy(o.recv, o.send, o.count * sizeof(T));
      do_broadcast(std::span<T>(o.recv, o.count), o.root);
    } else if constexpr (K == op_kind::all_gather) {
      const auto all = gather_all(std::span<const T>(o.send, o.count));
      std::copy(all.begin(), all.end(), o.recv);
    } else if constexpr (K == op_kind::all_to_all) {
      transpose(std::span<const T>(o.send, o.count * n), o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all_v) {
      do_all_to_all_v<T>(o);
    } else if constexpr (K == op_kind::ppermute) {
      permute(std::span<const T>(o.send, o.count), o.recv, o.pairs);
    } else if constexpr (K == op_kind::send) {
      return do_send<T>(o);
    } else if constexpr (K == op_kind::recv) {
      return do_recv<T>(o);
    } else {
      static_assert(K == op_kind::barrier);
      const std::int32_t token = 0;
      (void)gather_all(std::span<const std::int32_t>(&token, 1));
    }
    return {};
  }

  template <class T>
  void do_all_to_all_v(const comm::detail::operation<T>& o) {
    const auto n = static_cast<std::size_t>(size());
    const std::int64_t* sc = o.v[0];
    const std::int64_t* sd = o.v[1];
    const std::int64_t* rcounts = o.v[2];
    const std::int64_t* rd = o.v[3];
    std::size_t send_len = 0;  // the send buffer as far as the blocks reach
    for (std::size_t j = 0; j < n; ++j) send_len = std::max(send_len, static_cast<std::size_t>(sc[j] + sd[j]));
    // Every member's send counts, send displacements and receive counts, then every member's send
    // blocks. With every member's counts, every device checks every (sender, receiver) pair in the
    // same order and names the same first disagreement: the devices whose own counts agree fail
    // too, instead of returning as if the call had worked (as on the thread and MPI backends).
    std::vector<std::int64_t> meta(3 * n);
    std::copy(sc, sc + n, meta.begin());
    std::copy(sd, sd + n, meta.begin() + static_cast<std::ptrdiff_t>(n));
    std::copy(rcounts, rcounts + n, meta.begin() + static_cast<std::ptrdiff_t>(2 * n));
    const auto metas = gather_all(std::span<const std::int64_t>(meta));
    if (const auto bad = comm::detail::first_counts_disagreement(
            n, [&](std::size_t i, std::size_t j) { return metas[i * 3 * n + j]; },
            [&](std::size_t j, std::size_t i) { return metas[j * 3 * n + 2 * n + i]; })) {
      // Blamed on the receiver, whose expected count is the one that disagrees with what was sent
      // (every member names the same pair, so every process blames the same device).
      if (group_->channel) group_->channel->blame_mismatch(group_->member_device[bad->receiver]);
      throw collective_mismatch(
          "meshlib: collective mismatch in all_to_all_v on a hybrid communicator of " + std::to_string(size()) +
          " devices: the counts disagree: " +
          comm::detail::describe_counts_disagreement("hybrid device " + std::to_string(group_->member_device[bad->sender]),
                                               "hybrid device " + std::to_string(group_->member_device[bad->receiver]),
                                               bad->sent, bad->expected));
    }
    std::vector<std::size_t> offsets;
    const auto data = gather_var(std::span<const T>(o.send, send_len), offsets);
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t c = metas[j * 3 * n + static_cast<std::size_t>(rank_)];
      const std::int64_t d = metas[j * 3 * n + n + static_cast<std::size_t>(rank_)];
      std::copy_n(data.begin() + static_cast<std::ptrdiff_t>(offsets[j] + static_cast<std::size_t>(d)), c,
                  o.recv + rd[j]);
    }
  }

  /// Buffered, as on the other backends: within a process through the thread communicator,
  /// between processes with `MPI_Isend` from this thread.
  template <class T>
  request_type do_send(const comm::detail::operation<T>& o) {
    const auto& g = *group_;
    const auto d = static_cast<std::size_t>(o.peer);
    if (g.member_proc_pos[d] == g.my_proc_pos)
      return local_.send(std::span<const T>(o.send, o.count), g.member_local[d], o.tag);
    progress_sends();
    pending p;
    p.data.resize(o.count * sizeof(T));
    if (o.count != 0) std::memcpy(p.data.data(), o.send, o.count * sizeof(T));
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(o.count), comm::detail::mpi_datatype<T>(), g.member_proc_pos[d],
                       wire_tag(o.tag, my_local(), g.member_local[d]), g.p2p, &p.request),
             "MPI_Isend");
    sends_.push_back(std::move(p));
    return {};
  }

  template <class T>
  request_type do_recv(const comm::detail::operation<T>& o) {
    const auto& g = *group_;
    const int source = o.peer;
    const int tag = o.tag;
    const auto s = static_cast<std::size_t>(source);
    if (g.member_proc_pos[s] == g.my_proc_pos)
      return local_.recv(std::span<T>(o.recv, o.count), g.member_local[s], tag);
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
    MPI_Get_count(&st, comm::detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(o.count)) {
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<unsigned char> sink(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on hybrid device " + std::to_string(rank_) + " expected " +
                                std::to_string(o.count) + " elements from device " + std::to_string(source) +
                                " but the message holds " + std::to_string(got));
    }
    check_rc(MPI_Mrecv(o.recv, got, comm::detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
    return {};
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
        leader_failed(e);
        throw;
      }
    }
    {
      patient wait_for_leader(local_, g.patience);
      local_.broadcast(std::span(all), 0);
    }
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
    comm::detail::reduce_into<T>(op, ptrs.data(), size(), outs, 1, count);
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
        leader_failed(e);
        throw;
      }
    }
    if (g.my_proc_pos != root_pos) {
      patient wait_for_leader(local_, g.patience);
      local_.broadcast(buf, 0);
    }
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

  std::shared_ptr<comm::detail::hybrid_group> group_;
  thread_communicator local_;
  int rank_ = 0;
  std::uint64_t split_seq_ = 0;
  std::uint64_t calls_ = 0;  ///< collectives called on this handle's group (the fingerprint's sequence number)
  op_kind current_ = op_kind::barrier;  ///< the operation the user called last (named by a leader's timeout)
  std::vector<pending> sends_;
};

/// Refuses calls on an empty handle, and every call once the world has failed (here or in another
/// process), with the root cause's message.
inline void hybrid_communicator::ensure_usable(op_kind k) const {
  check_usable(comm::detail::op_name(k));
  if (group_->channel && group_->channel->interrupted.load(std::memory_order_acquire))
    group_->channel->rethrow(" [refused " + std::string(comm::detail::op_name(k)) + " on " + label() + " of " +
                             std::to_string(size()) + ": the communicator has failed]");
}

static_assert(communicator<hybrid_communicator>);

}  // namespace meshlib

// The world and run_hybrid, which every user of the communicator needs (after the class: they use it).
#include "meshlib/comm/mpi/hybrid_world.hpp"

#endif  // MESHLIB_ENABLE_MPI
