// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The MPI communicator: one participant per MPI process (rank), for CPU clusters and for
/// programs that already use MPI. Satisfies `communicator`.
///
/// @code
/// MPI_Init(&argc, &argv);
/// {
///   meshlib::mpi_communicator comm(MPI_COMM_WORLD);      // adopts: never frees MPI_COMM_WORLD
///   std::vector<float> x(1024, float(comm.rank()));
///   comm.all_reduce(std::span(x), meshlib::reduce_op::sum);
/// }
/// MPI_Finalize();
/// @endcode
///
/// Communicators. Adopting an `MPI_Comm` duplicates it once (`MPI_Comm_dup`, collective) into a
/// private communicator that carries every meshlib operation, with `MPI_ERRORS_RETURN` so that MPI
/// errors become `comm_error`s and meshlib's messages can never match the application's. The
/// duplicate, and every communicator `split` makes, is freed when the last handle goes (unless
/// MPI is already finalised); the adopted one is never freed or modified. `native()` is the
/// adopted `MPI_Comm`.
///
/// Threads. A handle and its copies share one MPI communicator and must be used by one thread at a
/// time (as an `MPI_Comm` in most programs); several threads use several communicators (`split`),
/// or `hybrid_communicator`.
///
/// Completion. Every operation is complete when it returns (the buffers hold the result) and
/// returns a `ready_request`, as the thread communicator does. `send` is buffered: it copies its
/// data and returns; the copy is sent in the background and progressed by later calls.
///
/// Determinism. Float and double sum, prod and mean over more than two ranks are reduced in rank
/// order with the thread backend's kernel (`detail/ordered_reduce.hpp`), not in MPI's unspecified
/// order, so every backend gives the same bits for the same inputs; two ranks, integers, min and
/// max run MPI's native reduction (whose result does not depend on the order there).
///
/// Mismatch detection (always on). Before its data moves, every collective exchanges a
/// fingerprint of the call (call number, operation, element type, count, reduce op, root,
/// ppermute pairs) in one polled 16-byte all-reduce; ranks that disagree (another count, type, op,
/// root, operation or order) all throw `collective_mismatch` naming every rank's call, so a
/// mismatch never reaches MPI's data collectives (no `MPI_ERR_TRUNCATE`, garbage or heap
/// corruption). all_to_all_v also checks every rank's receive counts against its peers' send
/// counts. The cost is measured in docs/benchmarks.md ("MPI overhead").
///
/// Timeouts (`mpi_comm_options::timeout`, default `MESHLIB_COMM_TIMEOUT` or 60 s). No wait is
/// unbounded: the fingerprint exchange is polled against the deadline, and it tells every rank
/// that all have arrived; then the payload runs as MPI's blocking collective, which can no longer
/// wait unboundedly and whose tuned algorithms are faster than the non-blocking ones at every size
/// (docs/benchmarks.md), except when the node runs more ranks than it has cores: there payloads
/// are polled non-blocking collectives, which yield the core (`large_payloads`,
/// `blocking_min_bytes`). A deadline that passes raises `comm_timeout` naming the operation and the
/// rank. MPI cannot cancel a collective, so the communicator is then failed: every later call
/// throws the root cause's error with the same message; end the run (an uncaught exception does
/// so through `MPI_Abort`, see `<meshlib/mpi.hpp>`).
///
/// Faults. A rank that throws and calls `fail(reason)` (as `mpi_runner` does) releases
/// its peers within milliseconds: they get `comm_aborted` naming "MPI rank R of N" and the reason,
/// through the abort channel (`detail::abort_channel`) that their polled waits test. An exception
/// that unwinds a handle does the same without `fail` (the reason then says that an exception left
/// the communicator's scope on rank R): any handle, a copy of `mpi::world()` included, so a
/// plain MPI program releases its peers within milliseconds when a rank's exception leaves the
/// scope of its handle. What still needs the timeout: a rank that catches its exception within
/// the handle's scope and stops calling collectives (meshlib never sees it), a rank that dies
/// without unwinding (a signal, `_exit`), and waits with no deadline; its peers then time out
/// (never hang), after which `root_cause_rank()` names it; a `fail_guard` around the step
/// releases them at once instead. `abort(reason)` (and the terminate handler `<meshlib/mpi.hpp>` installs) prints
/// "meshlib: MPI rank R of N aborts the run: <reason>" and calls `MPI_Abort`, which ends every
/// process. Argument errors (`comm_argument_error`, checked by `communicator_frontend`) are thrown
/// on the rank that made them, before any data moves; peers see a timeout. Errors on the adopted
/// communicator (the application's, e.g. `MPI_COMM_WORLD`) are never made fatal or otherwise
/// changed by meshlib: only its own duplicates use `MPI_ERRORS_RETURN`.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/core/hash.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/mpi/detail/abort_channel.hpp"
#include "meshlib/comm/mpi/detail/call_record.hpp"
#include "meshlib/comm/mpi/detail/mpi_comm_state.hpp"
#include "meshlib/comm/mpi/detail/mpi_types.hpp"
#include "meshlib/comm/mpi/detail/ordered_reduce.hpp"
#include "meshlib/comm/mpi/detail/settle.hpp"
#include "meshlib/comm/mpi/mpi_comm_options.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/comm/timeout.hpp"

namespace meshlib {

/// @brief One MPI rank's handle on a communicator. Copies share the same MPI communicator.
class mpi_communicator : public communicator_frontend<mpi_communicator> {
  friend class communicator_frontend<mpi_communicator>;
  friend class hybrid_world;  // installs check_interrupt on its own duplicate
  friend class hybrid_communicator;  // its leaders read which processes never arrived (mpi_comm_state::missing)
  friend class fail_guard;           // fails the communicator when an exception unwinds it
  using op_kind = comm::detail::op_kind;

 public:

  /// An empty handle; only assignable and destructible.
  mpi_communicator() = default;

  /// Another handle on the same communicator. Written out (not defaulted) so that the copy
  /// counts the exceptions in flight where it is made, not where `o` was (see the destructor).
  mpi_communicator(const mpi_communicator& o) : state_(o.state_), fail_on_unwind_(o.fail_on_unwind_) {}
  /// Takes `o`'s communicator over; `o` becomes an empty handle.
  mpi_communicator(mpi_communicator&& o) noexcept : state_(std::move(o.state_)), fail_on_unwind_(o.fail_on_unwind_) {}
  /// Makes this a handle on `o`'s communicator (this handle keeps its own exception count).
  mpi_communicator& operator=(const mpi_communicator& o) {
    state_ = o.state_;
    fail_on_unwind_ = o.fail_on_unwind_;
    return *this;
  }
  /// Takes `o`'s communicator over; `o` becomes an empty handle.
  mpi_communicator& operator=(mpi_communicator&& o) noexcept {
    state_ = std::move(o.state_);
    fail_on_unwind_ = o.fail_on_unwind_;
    return *this;
  }

  /// Any handle of an application's communicator (or of a split of it) that an exception unwinds
  /// (the rank threw, and nothing caught it within the handle's scope) fails the communicator as
  /// `fail` would: the rank will not reach its next collective on it, and its peers would
  /// otherwise wait for the whole timeout. Any handle, not only the last (issue 40 §4): the
  /// handle most programs use is a copy of `mpi::world()`, whose last handle the runtime keeps, so
  /// a rule on the last handle never fired in a plain MPI program. Handles whose owner reports
  /// failures itself opt out (`set_fail_on_unwind(false)`: the runners, whose message is the
  /// exception's own). The exception cannot be read from a destructor, so the peers'
  /// `comm_aborted` says that an exception left the communicator's scope on that rank, whose own
  /// handler has the message.
  ~mpi_communicator() {
    if (state_ && fail_on_unwind_ && std::uncaught_exceptions() > exceptions_at_birth_) fail_for_unwind();
  }

  /// @brief Whether this handle fails its communicator when an exception unwinds it (see the
  /// destructor; default on). Owners that report a rank's failure with its message themselves
  /// (`mpi_runner`, `hybrid_runner`) turn it off on the handles they hold; copies and splits of a
  /// handle inherit its setting.
  /// @code
  /// auto comm = meshlib::mpi::world();
  /// comm.set_fail_on_unwind(false);  // this program catches and recovers: its peers time out instead
  /// @endcode
  void set_fail_on_unwind(bool on) noexcept { fail_on_unwind_ = on; }
  /// Whether this handle fails its communicator when an exception unwinds it.
  [[nodiscard]] bool fails_on_unwind() const noexcept { return fail_on_unwind_; }

  /// @brief Adopts `comm` (collective over it: duplicates it once). `comm` stays the
  /// application's: meshlib never frees or modifies it.
  /// @throws comm_error when MPI is not initialised or `comm` is `MPI_COMM_NULL`.
  explicit mpi_communicator(MPI_Comm comm, mpi_comm_options options = {}) : mpi_communicator(comm, options, true) {}

  /// Rank of this process in the communicator.
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  /// Number of ranks (0 for an empty handle).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// The adopted `MPI_Comm`, or for a split result meshlib's own.
  [[nodiscard]] MPI_Comm native() const noexcept {
    if (!state_) return MPI_COMM_NULL;
    return state_->adopted != MPI_COMM_NULL ? state_->adopted : state_->comm;
  }
  /// Whether this node runs more ranks than it has cores (decides `large_payload_mode::automatic`).
  [[nodiscard]] bool oversubscribed() const noexcept { return state_ && state_->oversubscribed; }
  /// The options the communicator was made with.
  [[nodiscard]] const mpi_comm_options& options() const {
    require_valid("options");
    return state_->options;
  }

 private:
  /// `own_channel` false: the owner (a hybrid world) installs its own abort channel and
  /// `check_interrupt` right after, so none is opened here (no extra duplicate).
  mpi_communicator(MPI_Comm comm, mpi_comm_options options, bool own_channel) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
      throw comm_error("meshlib: mpi_communicator needs MPI to be initialised first (MPI_Init or "
                       "meshlib::mpi::initialize)");
    if (comm == MPI_COMM_NULL) throw comm_argument_error("meshlib: mpi_communicator cannot adopt MPI_COMM_NULL");
    auto s = std::make_shared<comm::detail::mpi_comm_state>();
    s->adopted = comm;
    s->options = options;
    s->fail_on_unwind = own_channel;
    check_rc(MPI_Comm_dup(comm, &s->comm), "MPI_Comm_dup");
    finish(*s);
    if (own_channel) {
      // The abort channel is polled by the waiting thread itself (no watcher), at any thread level.
      s->channel = std::make_shared<comm::detail::abort_channel>();
      s->channel->open(s->comm, true);
      s->check_interrupt = [ch = s->channel.get()] {
        int r = -1;
        std::string what;
        comm::detail::failure_kind kind{};  // always aborted on a plain communicator: every rank detects the rest itself
        if (ch->poll(r, what, kind))
          ch->interrupt("meshlib: communicator aborted: MPI rank " + std::to_string(r) + " of " +
                        std::to_string(ch->processes) + " failed: " + what, r);
        ch->check();
      };
    }
    {
      MPI_Comm node = MPI_COMM_NULL;
      check_rc(MPI_Comm_split_type(s->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
      int on_node = 1;
      MPI_Comm_size(node, &on_node);
      MPI_Comm_free(&node);
      const unsigned cores = std::thread::hardware_concurrency();
      s->oversubscribed = cores != 0 && static_cast<unsigned>(on_node) > cores;
    }
    state_ = std::move(s);
  }

 public:

  /// @brief Ends every process of the run: prints "meshlib: MPI rank R of N aborts the run:
  /// <reason>" on stderr and calls `MPI_Abort` on this communicator.
  [[noreturn]] void abort(std::string_view reason, int exit_code = 1) const {
    meshlib::comm::detail::write_stderr_line("meshlib: MPI rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                              " aborts the run: " + std::string(reason));
    MPI_Abort(state_ ? state_->comm : MPI_COMM_WORLD, exit_code);
    std::abort();  // MPI_Abort does not return; this satisfies [[noreturn]] if it ever did
  }

  /// @brief Fails this communicator with this rank as the root cause, without ending the
  /// process (the runner of a rank that threw calls it): every other rank's polled wait on this
  /// communicator or a split of it ends within milliseconds with `comm_aborted` "meshlib:
  /// communicator aborted: MPI rank R of N failed: <reason>" (R and N in the adopted
  /// communicator), and every later call on any rank throws it too. Waits without a deadline
  /// (`timeout` 0: blocking MPI calls) cannot be released.
  ///
  /// @code
  /// try { step(comm); } catch (const std::exception& e) { comm.fail(e.what()); throw; }
  /// @endcode
  void fail(std::string_view reason) const {
    require_valid("fail");
    auto& ch = *state_->channel;
    ch.interrupt("meshlib: communicator aborted: MPI rank " + std::to_string(ch.process) + " of " +
                 std::to_string(ch.processes) + " failed: " + std::string(reason), ch.process);
    if (ch.remote_device.load() < 0) ch.notify(ch.process, std::string(reason));  // a remote failure is not sent back
  }

  /// @brief The rank to blame for this communicator's failure, once this rank knows of it:
  /// - the rank that failed it (or the communicator it was split from) through `fail`, a
  ///   `fail_guard` or an unwound handle, here or in another process (-1 when that rank is not a
  ///   member of this split);
  /// - else, after this rank's `comm_timeout` "rank(s) R never arrived", the rank R that never
  ///   arrived; when several never arrived, the lowest of them (the message lists them all);
  /// - else -1: no failure, a collective mismatch (every rank's call is in the message), or a
  ///   timeout in which every rank arrived, but late.
  ///
  /// A rank that throws without failing the communicator (it caught the exception within the
  /// scope of its handle, so nothing unwound one) is named only after the timeout; a `fail_guard`
  /// names it within milliseconds.
  ///
  /// @code
  /// catch (const meshlib::comm_error&) { std::cerr << "rank " << comm.root_cause_rank() << " failed\n"; }
  /// @endcode
  [[nodiscard]] int root_cause_rank() const noexcept {
    if (!state_) return -1;
    const bool interrupted = state_->channel && state_->channel->interrupted.load(std::memory_order_acquire);
    if (!interrupted) {
      // The timeout of this rank's fingerprint exchange recorded who never arrived (ascending).
      if (state_->failed && !state_->failed_by_mismatch && !state_->missing.empty()) return state_->missing.front();
      return -1;
    }
    const int r = state_->channel->root_cause.load();
    if (r < 0 || state_->adopted != MPI_COMM_NULL || state_->channel->comm == MPI_COMM_NULL) return r;
    // A split: the channel names ranks of the adopted communicator.
    MPI_Group from = MPI_GROUP_NULL, to = MPI_GROUP_NULL;
    MPI_Comm_group(state_->channel->comm, &from);
    MPI_Comm_group(state_->comm, &to);
    int mine = MPI_UNDEFINED;
    MPI_Group_translate_ranks(from, 1, &r, to, &mine);
    MPI_Group_free(&from);
    MPI_Group_free(&to);
    return mine == MPI_UNDEFINED ? -1 : mine;
  }

  // The collectives, point to point and barrier: communicator_frontend; the transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// @brief `MPI_Comm_split`: ranks with the same `color` (>= 0) form a new communicator, ordered
  /// by (key, rank). The result owns its `MPI_Comm` and has this one's options.
  mpi_communicator split(int color, int key) {
    check_split(color);
    // Arrive first (polled, with the fingerprint), so that a rank that never splits is a timeout,
    // not a hang, and a rank that calls something else a mismatch.
    agree(op_kind::split, datatype::float32, 0, reduce_op::sum, 0);
    auto s = std::make_shared<comm::detail::mpi_comm_state>();
    s->options = state_->options;
    s->oversubscribed = state_->oversubscribed;  // a property of the placement, not of the group
    s->check_interrupt = state_->check_interrupt;
    s->channel = state_->channel;
    s->fail_on_unwind = state_->fail_on_unwind;
    check_rc(MPI_Comm_split(state_->comm, color, key, &s->comm), "MPI_Comm_split");
    finish(*s);
    mpi_communicator out;
    out.state_ = std::move(s);
    out.fail_on_unwind_ = fail_on_unwind_;  // a runner's splits leave the report to the runner too
    return out;
  }

 private:
  // ---- the front end's hooks -------------------------------------------------------------------

  std::string label() const { return "MPI rank " + std::to_string(rank()); }
  std::string where(std::string_view k) const {
    return std::string(k) + " on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size());
  }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty mpi_communicator handle (default-constructed or moved from)");
  }
  void ensure_usable(op_kind k) const {
    require_valid(comm::detail::op_name(k));
    if (state_->channel && state_->channel->interrupted.load(std::memory_order_acquire))
      state_->channel->rethrow(" [refused " + where(comm::detail::op_name(k)) + ": the communicator has failed]");
    if (!state_->failed) return;
    const std::string msg = "meshlib: refused " + where(comm::detail::op_name(k)) + ": the communicator has failed: " + state_->failure;
    if (state_->failed_by_mismatch) throw collective_mismatch(msg);
    throw comm_timeout(msg);
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed" + (state_ ? " on MPI rank " + std::to_string(rank()) : "") +
                       ": " + comm::detail::mpi_error_string(rc));
  }
  void check_tag_bound(op_kind k, int tag) const {
    if (tag >= state_->tag_ub)
      bad_argument(k, "tag " + std::to_string(tag) + " is out of range [0, " + std::to_string(state_->tag_ub) +
                          "); the top tag is meshlib's");
  }
  /// MPI counts are ints.
  void check_count(op_kind k, std::size_t count) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      bad_argument(k, "count " + std::to_string(count) + " exceeds MPI's int count (" + std::to_string(INT_MAX) +
                          "); split the call");
  }
  /// An all_to_all_v side's counts or displacements as MPI's ints.
  std::vector<int> ints(op_kind k, const char* what, const std::int64_t* v) const {
    std::vector<int> out(static_cast<std::size_t>(size()));
    for (std::size_t j = 0; j < out.size(); ++j) {
      if (v[j] > INT_MAX)
        bad_argument(k, std::string(what) + "[" + std::to_string(j) + "] = " + std::to_string(v[j]) + " exceeds MPI's int");
      out[j] = static_cast<int>(v[j]);
    }
    return out;
  }

  /// The transport of operation K (the front end has checked its arguments).
  template <op_kind K, class T>
  request_type transport(const comm::detail::operation<T>& o, context_type) {
    const bool is_root = rank() == o.root;
    if constexpr (K == op_kind::all_reduce) {
      do_all_reduce<T>(o.in_place ? nullptr : o.send, o.recv, o.count, o.op);
    } else if constexpr (K == op_kind::reduce) {
      do_reduce<T>(o.in_place && is_root ? nullptr : o.send, o.recv, o.count, o.op, o.root);
    } else if constexpr (K == op_kind::reduce_scatter) {
      if (o.in_place) {
        // MPI's in-place form puts the result at the start of the buffer and may use the rest as
        // scratch; meshlib's leaves every other block as it was. So the input is copied, and the
        // result written straight into block rank().
        const std::vector<T> input(o.send, o.send + o.count * static_cast<std::size_t>(size()));
        do_reduce_scatter<T>(input.data(), o.recv, o.count, o.op);
      } else {
        do_reduce_scatter<T>(o.send, o.recv, o.count, o.op);
      }
    } else if constexpr (K == op_kind::broadcast) {
      if (is_root && !o.in_place && o.count != 0) std::memcpy(o.recv, o.send, o.count * sizeof(T));
      do_broadcast<T>(o.recv, o.count, o.root);
    } else if constexpr (K == op_kind::all_gather) {
      do_all_gather<T>(o.in_place ? nullptr : o.send, o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all) {
      do_all_to_all<T>(o.in_place ? nullptr : o.send, o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all_v) {
      do_all_to_all_v<T>(o);
    } else if constexpr (K == op_kind::ppermute) {
      if (o.in_place) {
        const std::vector<T> copy(o.send, o.send + o.count);
        do_ppermute<T>(copy.data(), o.recv, o.count, o.pairs);
      } else {
        do_ppermute<T>(o.send, o.recv, o.count, o.pairs);
      }
    } else if constexpr (K == op_kind::send) {
      do_send<T>(o);
    } else if constexpr (K == op_kind::recv) {
      do_recv<T>(o);
    } else {
      static_assert(K == op_kind::barrier);
      progress_sends();
      agree(K, datatype::float32, 0, reduce_op::sum, 0);  // the fingerprint exchange is a barrier
    }
    return {};
  }

  template <class T>
  void do_all_to_all_v(const comm::detail::operation<T>& o) {
    constexpr auto k = op_kind::all_to_all_v;
    const auto sc = ints(k, "send_counts", o.v[0]);
    const auto sd = ints(k, "send_displs", o.v[1]);
    const auto rc = ints(k, "recv_counts", o.v[2]);
    const auto rd = ints(k, "recv_displs", o.v[3]);
    agree(k, datatype_of<T>, 0, reduce_op::sum, 0);
    {
      // Every rank's recv_counts[j] must be rank j's send_counts[rank()]; all ranks learn whether
      // any rank disagrees, so that all throw (never MPI_ERR_TRUNCATE or a hang).
      std::vector<int> their(static_cast<std::size_t>(size()));
      timed("all_to_all_v", sizeof(int) * their.size(),
            [&](MPI_Request* r) { return MPI_Ialltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm, r); },
            [&] { return MPI_Alltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm); });
      std::string mine;
      for (int j = 0; j < size() && mine.empty(); ++j)
        if (their[static_cast<std::size_t>(j)] != rc[static_cast<std::size_t>(j)])
          mine = comm::detail::describe_counts_disagreement("rank " + std::to_string(j), "rank " + std::to_string(rank()),
                                                      their[static_cast<std::size_t>(j)], rc[static_cast<std::size_t>(j)]);
      int bad = mine.empty() ? -1 : rank();
      int first_bad = -1;
      timed("all_to_all_v", 0,
            [&](MPI_Request* r) { return MPI_Iallreduce(&bad, &first_bad, 1, MPI_INT, MPI_MAX, state_->comm, r); },
            [&] { return MPI_Allreduce(&bad, &first_bad, 1, MPI_INT, MPI_MAX, state_->comm); });
      if (first_bad >= 0) {
        state_->failed = true;
        state_->failed_by_mismatch = true;
        state_->failure = "meshlib: collective mismatch in all_to_all_v on an MPI communicator of " +
                          std::to_string(size()) + " ranks: the counts disagree" +
                          (mine.empty() ? " (rank " + std::to_string(first_bad) + " saw it)" : ": " + mine);
        throw collective_mismatch(state_->failure);
      }
    }
    progress_sends();
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    std::size_t bytes = 0;
    for (int c : sc) bytes += static_cast<std::size_t>(c) * sizeof(T);
    timed("all_to_all_v", bytes,
          [&](MPI_Request* r) {
            return MPI_Ialltoallv(o.send, sc.data(), sd.data(), t, o.recv, rc.data(), rd.data(), t, state_->comm, r);
          },
          [&] { return MPI_Alltoallv(o.send, sc.data(), sd.data(), t, o.recv, rc.data(), rd.data(), t, state_->comm); });
  }

  /// Buffered: the data is copied and sent in the background (progressed by later calls).
  template <class T>
  void do_send(const comm::detail::operation<T>& o) {
    check_tag_bound(op_kind::send, o.tag);
    check_count(op_kind::send, o.count);
    progress_sends();
    comm::detail::mpi_comm_state::pending_send p;
    p.data.resize(o.count * sizeof(T));
    if (o.count != 0) std::memcpy(p.data.data(), o.send, o.count * sizeof(T));
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(o.count), comm::detail::mpi_datatype<T>(), o.peer, o.tag, state_->comm,
                       &p.request),
             "MPI_Isend");
    state_->sends.push_back(std::move(p));
  }

  template <class T>
  void do_recv(const comm::detail::operation<T>& o) {
    check_tag_bound(op_kind::recv, o.tag);
    check_count(op_kind::recv, o.count);
    const int source = o.peer;
    const int tag = o.tag;
    // Probe first (matched probe: safe when other threads use the communicator), so that a
    // message of another length is reported instead of truncated.
    MPI_Status st;
    MPI_Message msg = MPI_MESSAGE_NULL;
    poll("recv", [&](int* done) {
      progress_sends();
      return MPI_Improbe(source, tag, state_->comm, done, &msg, &st);
    }, /*interruptible=*/true);  // a probe leaves nothing pending; a failed sender never sends
    int got = 0;
    MPI_Get_count(&st, comm::detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(o.count)) {
      // Consume the message so the stream stays in order, then report.
      std::vector<unsigned char> sink;
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      sink.resize(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                                " expected " + std::to_string(o.count) + " elements of " +
                                std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(source) +
                                " (tag " + std::to_string(tag) + ") but the message holds " +
                                (got == MPI_UNDEFINED ? std::to_string(bytes) + " bytes" : std::to_string(got)));
    }
    check_rc(MPI_Mrecv(o.recv, got, comm::detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }

  // ---- waiting ---------------------------------------------------------------------------------

  bool has_deadline() const noexcept { return state_->options.timeout.count() > 0; }

  /// Polls `test(&done)` (an MPI call returning its error code) until done or the deadline.
  /// `interruptible`: whether a failure elsewhere (`check_interrupt`) may end the wait. Only waits
  /// that leave nothing pending may be (a matched probe); a data transfer posted after the
  /// fingerprint exchange completes on every rank without help (every rank has posted it), and
  /// abandoning it would leave MPI writing into the caller's buffers after the throw.
  template <class Test>
  void poll(std::string_view k, Test&& test, bool interruptible = false) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = has_deadline() ? start + state_->options.timeout : std::chrono::steady_clock::time_point::max();
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      check_rc(test(&done), "MPI_Test");
      if (done) return;
      if (spins > 256) std::this_thread::yield();  // oversubscribed ranks must let their peers run
      if ((spins & 63) != 0) continue;
      if (interruptible && state_->check_interrupt) state_->check_interrupt();
      if (std::chrono::steady_clock::now() > deadline) {
        state_->missing.clear();  // a data transfer after every rank arrived: nobody to name
        fail_timeout(k);
      }
    }
  }
  void wait(std::string_view k, MPI_Request& r) {
    poll(k, [&](int* done) { return MPI_Test(&r, done, MPI_STATUS_IGNORE); });
  }

  /// `who`: who is late. Only the arrival check (`wait_arrival`) knows which ranks never arrived
  /// (`state_->missing`, which `root_cause_rank` reads); every other wait empties it.
  [[noreturn]] void fail_timeout(std::string_view k, const std::string& who = "a peer never called it") {
    const double secs = std::chrono::duration<double>(state_->options.timeout).count();
    state_->failed = true;
    state_->failure = "meshlib: " + where(k) + " did not complete within " + std::to_string(secs) + " s: " + who +
                      " (it failed, is still busy, or called another operation); MPI cannot cancel a "
                      "collective, so this communicator refuses further operations; end the run";
    throw comm_timeout(state_->failure);
  }

  static constexpr int arrival_tag = comm::detail::mpi_comm_state::arrival_tag;

  /// Reads the arrival notes peers have sent so far (`peer_waits_in`).
  void drain_arrival_notes() {
    for (;;) {
      int found = 0;
      MPI_Status st;
      check_rc(MPI_Iprobe(MPI_ANY_SOURCE, arrival_tag, state_->side, &found, &st), "MPI_Iprobe");
      if (!found) return;
      std::uint64_t call = 0;
      check_rc(MPI_Recv(&call, 1, MPI_UINT64_T, st.MPI_SOURCE, arrival_tag, state_->side, MPI_STATUS_IGNORE), "MPI_Recv");
      state_->peer_waits_in[static_cast<std::size_t>(st.MPI_SOURCE)] = call + 1;
      ++state_->notes_received[static_cast<std::size_t>(st.MPI_SOURCE)];
    }
  }

  /// Waits for the fingerprint exchange of call `call` (every rank has arrived once it completes).
  /// After 10 ms it tells the peers that it waits in this call (so nothing is sent on the fast
  /// path); at the deadline it reads the peers' notes for a short grace and names the ranks that
  /// never said they arrived.
  void wait_arrival(std::string_view k, MPI_Request& r, std::uint64_t call) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + state_->options.timeout;
    bool noted = false;
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      check_rc(MPI_Test(&r, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (spins > 256) std::this_thread::yield();
      if ((spins & 63) != 0) continue;
      if (state_->check_interrupt) state_->check_interrupt();
      const auto now = clock::now();
      if (!noted && now - start > std::chrono::milliseconds(10)) {
        noted = true;
        drain_arrival_notes();
        for (int peer = 0; peer < size(); ++peer) {
          if (peer == rank()) continue;
          comm::detail::mpi_comm_state::pending_send p;
          p.data.resize(sizeof(call));
          std::memcpy(p.data.data(), &call, sizeof(call));
          check_rc(MPI_Isend(p.data.data(), 1, MPI_UINT64_T, peer, arrival_tag, state_->side, &p.request), "MPI_Isend");
          state_->sends.push_back(std::move(p));
          ++state_->notes_sent[static_cast<std::size_t>(peer)];
        }
      }
      if (now > deadline) {
        // Peers that arrived at about the same time send their notes within 10 ms of arriving.
        const auto grace_end = clock::now() + std::chrono::milliseconds(50);
        while (clock::now() < grace_end) {
          drain_arrival_notes();
          progress_sends();
          std::this_thread::yield();
        }
        std::string missing;
        int count = 0;
        state_->missing.clear();
        for (int peer = 0; peer < size(); ++peer)
          if (peer != rank() && state_->peer_waits_in[static_cast<std::size_t>(peer)] != call + 1) {
            missing += (count++ ? ", " : "") + std::to_string(peer);
            state_->missing.push_back(peer);
          }
        fail_timeout(k, count ? "rank(s) " + missing + " never arrived" : "every rank arrived, but not in time");
      }
    }
  }

  /// Runs one collective under the timeout: see the file comment.
  template <class NonBlocking, class Blocking>
  void timed(std::string_view k, std::size_t bytes, NonBlocking&& nb, Blocking&& bl) {
    if (!has_deadline()) {
      check_rc(bl(), k);
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;
    using mode = mpi_comm_options::large_payload_mode;
    const mode m = state_->options.large_payloads;
    const bool barrier_first = m == mode::barrier_then_blocking || (m == mode::automatic && !state_->oversubscribed);
    if (bytes >= state_->options.blocking_min_bytes && barrier_first) {
      // Every rank has arrived: the fingerprint exchange (agree) that precedes every data
      // collective completed, so MPI's blocking collective cannot wait unboundedly.
      check_rc(bl(), k);
    } else {
      check_rc(nb(&r), k);
      wait(k, r);
    }
  }

  void progress_sends() {
    auto& v = state_->sends;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](comm::detail::mpi_comm_state::pending_send& s) {
                             int done = 0;
                             check_rc(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
                             return done != 0;
                           }),
            v.end());
  }

  /// Always-on mismatch detection. Before the data moves, every rank contributes a fingerprint of
  /// its call (call number on this communicator, operation, element type, count, reduce op, root,
  /// ppermute pairs) to one polled 16-byte all-reduce (max of the fingerprint and of its
  /// complement: all ranks agree exactly when both maxima are this rank's own values, so every
  /// rank reaches the same verdict). It doubles as the arrival check of the blocking large-payload
  /// path (see `timed`). On disagreement the ranks exchange their full calls, the communicator is
  /// failed, and every rank throws `collective_mismatch` naming each rank's call: a mismatched
  /// count, type, op, root or order never reaches MPI's data collectives (no MPI_ERR_TRUNCATE, no
  /// garbage, no hang).
  void agree(op_kind k, datatype dt, std::size_t count, reduce_op op, int root, std::uint64_t extra = 0) {
    const bool has_op = comm::detail::uses_op(k);
    const bool has_root = comm::detail::uses_root(k);
    const std::uint64_t rec[call_fields] = {state_->calls++,
                                            static_cast<std::uint64_t>(k),
                                            k == op_kind::barrier || k == op_kind::split ? 0 : static_cast<std::uint64_t>(dt) + 1,
                                            static_cast<std::uint64_t>(count),
                                            has_op ? static_cast<std::uint64_t>(op) : 0,
                                            has_root ? static_cast<std::uint64_t>(root) : 0,
                                            extra};
    meshlib::experimental::fnv1a fingerprint;  // over the record's words
    for (std::uint64_t w : rec) fingerprint.add(w);
    const std::uint64_t h = fingerprint.value;
    // {mine[2], most[2]} on the heap: a wait that ends early (timeout, or a failure elsewhere)
    // leaves the all-reduce pending, and MPI may still read and write them; they are then leaked.
    auto fp = std::make_unique<std::array<std::uint64_t, 4>>(std::array<std::uint64_t, 4>{h, ~h, 0, 0});
    const std::uint64_t* mine = fp->data();
    std::uint64_t* most = fp->data() + 2;
    const std::string_view name = comm::detail::op_name(k);
    if (!has_deadline()) {
      check_rc(MPI_Allreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, state_->comm), name);
    } else {
      MPI_Request r = MPI_REQUEST_NULL;
      check_rc(MPI_Iallreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, state_->comm, &r), name);
      try {
        wait_arrival(name, r, rec[0]);
      } catch (...) {
        (void)fp.release();  // still MPI's: see above
        throw;
      }
    }
    if (most[0] == mine[0] && most[1] == mine[1]) return;
    std::vector<std::uint64_t> all(call_fields * static_cast<std::size_t>(size()));
    timed(name, 0, [&](MPI_Request* r) {
            return MPI_Iallgather(rec, call_fields, MPI_UINT64_T, all.data(), call_fields, MPI_UINT64_T, state_->comm, r);
          },
          [&] { return MPI_Allgather(rec, call_fields, MPI_UINT64_T, all.data(), call_fields, MPI_UINT64_T, state_->comm); });
    std::string msg = "meshlib: collective mismatch on an MPI communicator of " + std::to_string(size()) +
                      " ranks: the ranks called different collectives";
    for (int r = 0; r < size(); ++r)
      msg += (r ? "; " : ": ") + comm::detail::describe_record("rank " + std::to_string(r), all.data() + call_fields * r);
    state_->failed = true;
    state_->failed_by_mismatch = true;
    state_->failure = msg;
    throw collective_mismatch(msg + " (seen by MPI rank " + std::to_string(rank()) + ")");
  }

  static constexpr int call_fields = 7;


  template <class T>
  void maybe_verify(op_kind k, std::size_t count, reduce_op op, int root, std::uint64_t extra = 0) {
    agree(k, datatype_of<T>, count, op, root, extra);
  }

  static std::uint64_t pairs_hash(std::span<const permute_pair> pairs) noexcept { return comm::detail::pairs_hash(pairs); }

  // ---- operations ------------------------------------------------------------------------------

  static const void* in_place(const void* p) noexcept { return p ? p : MPI_IN_PLACE; }

  /// send == nullptr: in place.
  template <class T>
  void do_all_reduce(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>(op_kind::all_reduce, count, op, 0);
    check_count(op_kind::all_reduce, count);
    progress_sends();
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        std::vector<float> w(count);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < count; ++i) w[i] = src[i];
        all_reduce_raw<float>(nullptr, w.data(), count, op);
        for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    all_reduce_raw<T>(send, recv, count, op);
  }

  template <class T>
  void all_reduce_raw(const T* send, T* recv, std::size_t count, reduce_op op) {
    if (comm::detail::needs_rank_order<T>(op, size())) {
      ordered_all_reduce<T>(send ? send : recv, recv, count, op);
      return;
    }
    const MPI_Datatype t = comm::detail::mpi_datatype<T>(comm::detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("all_reduce", count * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallreduce(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Allreduce(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) comm::detail::finish_avg(recv, count, size());
  }

  /// On root, send == nullptr means in place; elsewhere send is read.
  template <class T>
  void do_reduce(const T* send, T* recv, std::size_t count, reduce_op op, int root) {
    maybe_verify<T>(op_kind::reduce, count, op, root);
    check_count(op_kind::reduce, count);
    progress_sends();
    const bool is_root = rank() == root;
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        std::vector<float> w(count);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < count; ++i) w[i] = src[i];
        std::vector<float> res(is_root ? count : 0);
        do_reduce<float>(is_root ? nullptr : w.data(), is_root ? w.data() : res.data(), count, op, root);
        if (is_root)
          for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    if (comm::detail::needs_rank_order<T>(op, size())) {
      ordered_reduce<T>(is_root && !send ? recv : send, recv, count, op, root);
      return;
    }
    const MPI_Datatype t = comm::detail::mpi_datatype<T>(comm::detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    const void* s = is_root ? in_place(send) : static_cast<const void*>(send);
    void* rb = is_root ? static_cast<void*>(recv) : nullptr;
    timed("reduce", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ireduce(s, rb, n, t, o, root, state_->comm, r); },
          [&] { return MPI_Reduce(s, rb, n, t, o, root, state_->comm); });
    if (is_root && op == reduce_op::mean) comm::detail::finish_avg(recv, count, size());
  }

  /// send == nullptr: in place, the result at the start of recv (MPI's convention).
  template <class T>
  void do_reduce_scatter(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>(op_kind::reduce_scatter, count, op, 0);
    check_count(op_kind::reduce_scatter, count * static_cast<std::size_t>(size()));
    progress_sends();
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        const std::size_t total = count * static_cast<std::size_t>(size());
        std::vector<float> w(total);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < total; ++i) w[i] = src[i];
        do_reduce_scatter<float>(nullptr, w.data(), count, op);
        for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    if (comm::detail::needs_rank_order<T>(op, size())) {
      ordered_reduce_scatter<T>(send ? send : recv, recv, count, op);
      return;
    }
    const MPI_Datatype t = comm::detail::mpi_datatype<T>(comm::detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("reduce_scatter", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Reduce_scatter_block(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) comm::detail::finish_avg(recv, count, size());
  }

  // Float sum, prod and mean over more than two ranks, in rank order (detail/ordered_reduce.hpp):
  // the inputs move, and the thread backend's kernel reduces them, so the bits are the thread
  // backend's. `src` may be `recv` (in place): every input is copied out before a result is written.

  /// Rank me's result block: block me of every rank, reduced in rank order.
  template <class T>
  void ordered_reduce_scatter(const T* src, T* recv, std::size_t count, reduce_op op) {
    const auto n = static_cast<std::size_t>(size());
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int c = static_cast<int>(count);
    std::vector<T> blocks(count * n);
    timed("reduce_scatter", count * n * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ialltoall(src, c, t, blocks.data(), c, t, state_->comm, r); },
          [&] { return MPI_Alltoall(src, c, t, blocks.data(), c, t, state_->comm); });
    comm::detail::reduce_blocks_in_order(op, blocks.data(), size(), count, recv, count);
  }

  /// A reduce-scatter of blocks of ceil(count / n) elements (the input padded), then an all-gather.
  template <class T>
  void ordered_all_reduce(const T* src, T* recv, std::size_t count, reduce_op op) {
    if (count == 0) return;
    const auto n = static_cast<std::size_t>(size());
    const std::size_t c = (count + n - 1) / n;
    std::vector<T> padded(c * n), mine(c), all(c * n);
    std::copy_n(src, count, padded.begin());
    ordered_reduce_scatter<T>(padded.data(), mine.data(), c, op);
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int ci = static_cast<int>(c);
    timed("all_reduce", c * n * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallgather(mine.data(), ci, t, all.data(), ci, t, state_->comm, r); },
          [&] { return MPI_Allgather(mine.data(), ci, t, all.data(), ci, t, state_->comm); });
    std::copy_n(all.begin(), count, recv);
  }

  /// Every rank's input gathered on the root, reduced there in rank order.
  template <class T>
  void ordered_reduce(const T* src, T* recv, std::size_t count, reduce_op op, int root) {
    const auto n = static_cast<std::size_t>(size());
    const bool is_root = rank() == root;
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int c = static_cast<int>(count);
    std::vector<T> all(is_root ? count * n : 0);
    timed("reduce", count * sizeof(T),
          [&](MPI_Request* r) { return MPI_Igather(src, c, t, all.data(), c, t, root, state_->comm, r); },
          [&] { return MPI_Gather(src, c, t, all.data(), c, t, root, state_->comm); });
    if (is_root) comm::detail::reduce_blocks_in_order(op, all.data(), size(), count, recv, count);
  }

  template <class T>
  void do_broadcast(T* buf, std::size_t count, int root) {
    maybe_verify<T>(op_kind::broadcast, count, reduce_op::sum, root);
    check_count(op_kind::broadcast, count);
    progress_sends();
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("broadcast", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ibcast(buf, n, t, root, state_->comm, r); },
          [&] { return MPI_Bcast(buf, n, t, root, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_gather(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>(op_kind::all_gather, count, reduce_op::sum, 0);
    check_count(op_kind::all_gather, count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    // MPI_IN_PLACE ignores the send count and type.
    timed("all_gather", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallgather(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Allgather(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_to_all(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>(op_kind::all_to_all, count, reduce_op::sum, 0);
    check_count(op_kind::all_to_all, count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("all_to_all", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ialltoall(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Alltoall(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  template <class T>
  void do_ppermute(const T* send, T* recv, std::size_t count, std::span<const permute_pair> pairs) {
    maybe_verify<T>(op_kind::ppermute, count, reduce_op::sum, 0, pairs_hash(pairs));
    check_count(op_kind::ppermute, count);
    progress_sends();
    const MPI_Datatype t = comm::detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    const int tag = state_->tag_ub;  // meshlib's own tag: never a user's
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    bool receives = false;
    for (const auto& p : pairs) {
      if (p.dest == rank()) {
        check_rc(MPI_Irecv(recv, n, t, p.source, tag, state_->comm, &reqs[0]), "MPI_Irecv");
        receives = true;
      }
      if (p.source == rank()) check_rc(MPI_Isend(send, n, t, p.dest, tag, state_->comm, &reqs[1]), "MPI_Isend");
    }
    if (!receives && count != 0) std::fill(recv, recv + count, T{});
    poll("ppermute", [&](int* done) { return MPI_Testall(2, reqs, done, MPI_STATUSES_IGNORE); });
  }

  template <class T>
  static MPI_Op reduce_mpi_op(reduce_op op) {
    if constexpr (std::is_same_v<T, bfloat16>) return comm::detail::bf16_mpi_op(op);
    else return comm::detail::mpi_op<T>(op);
  }

  void finish(comm::detail::mpi_comm_state& s) {
    check_rc(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(s.comm, &s.rank);
    MPI_Comm_size(s.comm, &s.size);
    check_rc(MPI_Comm_dup(s.comm, &s.side), "MPI_Comm_dup");
    check_rc(MPI_Comm_set_errhandler(s.side, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    s.peer_waits_in.assign(static_cast<std::size_t>(s.size), 0);
    s.notes_sent.assign(static_cast<std::size_t>(s.size), 0);
    s.notes_received.assign(static_cast<std::size_t>(s.size), 0);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(s.comm, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) s.tag_ub = *ub;
  }

  /// See the destructor.
  void fail_for_unwind() const noexcept {
    fail_unless_failed("an exception left the scope of its communicator there (that rank's handler has its message)");
  }
  /// `fail(reason)` for an exception that unwinds a handle or a `fail_guard`: only the
  /// application's communicators (a hybrid world's own is failed by the world, which knows the
  /// device and the message), and never over a failure already known here (a timeout, mismatch or
  /// another rank's failure is not this rank's fault).
  void fail_unless_failed(const char* reason) const noexcept {
    if (!state_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    const auto& s = *state_;
    if (finalized || !s.fail_on_unwind || s.failed || !s.channel || s.channel->interrupted.load(std::memory_order_acquire))
      return;
    try {
      fail(reason);
    } catch (...) {  // called from destructors, which must not throw; the peers then time out
    }
  }

  std::shared_ptr<comm::detail::mpi_comm_state> state_;
  /// `std::uncaught_exceptions()` when this handle was made: a larger count at its destruction
  /// means that an exception is unwinding it.
  int exceptions_at_birth_ = std::uncaught_exceptions();
  /// Whether an exception that unwinds this handle fails the communicator (`set_fail_on_unwind`).
  bool fail_on_unwind_ = true;
};

static_assert(communicator<mpi_communicator>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
