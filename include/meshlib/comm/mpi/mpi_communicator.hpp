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
/// Timeouts (`mpi_comm_options::timeout`, default `MESHLIB_COMM_TIMEOUT` or 60 s). No wait is
/// unbounded: a payload under `blocking_min_bytes` runs as MPI's non-blocking collective, polled
/// against the deadline; a larger one first polls a non-blocking barrier (every rank has arrived)
/// and then runs MPI's blocking collective, whose tuned algorithms are faster than the
/// non-blocking ones for large payloads (docs/benchmarks.md), except when the node runs more
/// ranks than it has cores: there the extra barrier costs more than the non-blocking algorithms
/// lose, so large payloads are polled non-blocking collectives too (`large_payloads`). A deadline that passes raises
/// `comm_timeout` naming the operation and the rank. MPI cannot cancel a collective, so the
/// communicator is then failed: every later call throws `comm_timeout` with the same message;
/// end the run (an uncaught exception does so through `MPI_Abort`, see `<meshlib/mpi.hpp>`).
///
/// Faults. A rank that throws does not reach its next collective; its peers then time out instead
/// of hanging. `abort(reason)` (and the terminate handler `<meshlib/mpi.hpp>` installs) prints
/// "meshlib: MPI rank R of N aborts the run: <reason>" and calls `MPI_Abort`, which ends every
/// process. Argument errors (`comm_argument_error`) are thrown on the rank that made them, before
/// any data moves; peers see a timeout. With `verify_collectives`, every collective first exchanges
/// a descriptor of the call, and ranks that disagree (operation, type, count, op, root) all throw
/// `collective_mismatch` listing each rank's call, as the thread backend always does.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/detail/mpi_types.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/comm/thread/options.hpp"

namespace meshlib {

/// @brief Options of an `mpi_communicator`.
struct mpi_comm_options {
  /// How long a rank waits for its peers in one operation before `comm_timeout`. Zero or
  /// negative: no deadline (MPI's blocking calls throughout).
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// Payloads (bytes per rank) at least this large are "large" (see `large_payloads`); smaller
  /// ones run MPI's non-blocking collective, polled.
  std::size_t blocking_min_bytes = std::size_t{64} << 10;
  /// How large payloads wait under a deadline.
  enum class large_payload_mode {
    automatic,              ///< barrier then blocking, unless the node's ranks outnumber its cores
    barrier_then_blocking,  ///< a polled `MPI_Ibarrier`, then MPI's blocking collective
    nonblocking,            ///< MPI's non-blocking collective, polled
  };
  large_payload_mode large_payloads = large_payload_mode::automatic;
  /// bfloat16 reductions: false (default) widens to float, reduces with MPI's float ops and rounds
  /// once (bitwise equal to the thread backend for min and max, within float rounding for sums);
  /// true sends 16-bit values and combines them with a user-defined op in float, rounding after
  /// every combination (half the traffic; each combination may lose half an ulp of bfloat16).
  bool bfloat16_on_wire = false;
  /// Check before every collective that every rank makes the same call (one extra small
  /// all-gather per collective); a disagreement throws `collective_mismatch` on every rank.
  bool verify_collectives = false;
};

namespace detail {

/// The MPI state shared by the handles of one communicator.
struct mpi_comm_state {
  MPI_Comm adopted = MPI_COMM_NULL;  ///< the application's communicator; never freed
  MPI_Comm comm = MPI_COMM_NULL;     ///< meshlib's own (a dup or a split result); freed by meshlib
  int rank = 0;
  int size = 0;
  int tag_ub = 32767;
  /// Whether this node runs more ranks (of the adopted communicator) than it has cores.
  bool oversubscribed = false;
  mpi_comm_options options;
  bool failed = false;
  std::string failure;
  struct pending_send {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
  };
  std::vector<pending_send> sends;

  mpi_comm_state() = default;
  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;

  ~mpi_comm_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // nothing can be freed any more
    // Buffered sends still in flight: give them the timeout to complete, then leave them to MPI.
    const auto deadline = std::chrono::steady_clock::now() + (options.timeout.count() > 0 ? options.timeout : std::chrono::nanoseconds(0));
    for (auto& s : sends) {
      int done = 0;
      while (s.request != MPI_REQUEST_NULL && !done) {
        MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
        if (!done && std::chrono::steady_clock::now() > deadline) break;
        if (!done) std::this_thread::yield();
      }
      if (!done && s.request != MPI_REQUEST_NULL) {
        MPI_Request_free(&s.request);  // allowed for point-to-point: MPI finishes it on its own
        // ... reading the buffer until then, so it must outlive this object: leak it on purpose.
        (void)new std::vector<unsigned char>(std::move(s.data));
      }
    }
    if (comm != MPI_COMM_NULL && !failed) MPI_Comm_free(&comm);
  }
};

}  // namespace detail

/// @brief One MPI rank's handle on a communicator. Copies share the same MPI communicator.
class mpi_communicator {
 public:
  using is_communicator = void;
  using request_type = ready_request;
  using context_type = host_context;

  /// An empty handle; only assignable and destructible.
  mpi_communicator() = default;

  /// @brief Adopts `comm` (collective over it: duplicates it once). `comm` stays the
  /// application's: meshlib never frees or modifies it.
  /// @throws comm_error when MPI is not initialised or `comm` is `MPI_COMM_NULL`.
  explicit mpi_communicator(MPI_Comm comm, mpi_comm_options options = {}) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
      throw comm_error("meshlib: mpi_communicator needs MPI to be initialised first (MPI_Init or "
                       "meshlib::mpi::initialize)");
    if (comm == MPI_COMM_NULL) throw comm_argument_error("meshlib: mpi_communicator cannot adopt MPI_COMM_NULL");
    auto s = std::make_shared<detail::mpi_comm_state>();
    s->adopted = comm;
    s->options = options;
    check_rc(MPI_Comm_dup(comm, &s->comm), "MPI_Comm_dup");
    finish(*s);
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

  /// Rank of this process in the communicator.
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  /// Number of ranks (0 for an empty handle).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// The adopted `MPI_Comm`, or for a split result meshlib's own.
  [[nodiscard]] MPI_Comm native() const noexcept {
    if (!state_) return MPI_COMM_NULL;
    return state_->adopted != MPI_COMM_NULL ? state_->adopted : state_->comm;
  }
  /// Whether this node runs more ranks than it has cores (decides `large_payload_mode::automatic`).
  [[nodiscard]] bool oversubscribed() const noexcept { return state_ && state_->oversubscribed; }
  [[nodiscard]] const mpi_comm_options& options() const {
    require_valid("options");
    return state_->options;
  }

  /// @brief Ends every process of the run: prints "meshlib: MPI rank R of N aborts the run:
  /// <reason>" on stderr and calls `MPI_Abort` on this communicator.
  [[noreturn]] void abort(std::string_view reason, int exit_code = 1) const {
    std::cerr << "meshlib: MPI rank " << rank() << " of " << size() << " aborts the run: " << reason << std::endl;
    MPI_Abort(state_ ? state_->comm : MPI_COMM_WORLD, exit_code);
    std::abort();  // MPI_Abort does not return; this satisfies [[noreturn]] if it ever did
  }

  // ---- reducing collectives --------------------------------------------------------------------

  /// @brief recv[i] = op over every rank of send[i], on every rank.
  template <comm_element T>
  request_type all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                          context_type = {}) {
    check_out_of_place("all_reduce", send, recv, send.size());
    do_all_reduce<T>(send.data(), recv.data(), send.size(), op);
    return {};
  }
  /// @brief In-place all_reduce (`MPI_IN_PLACE`).
  template <comm_element T>
  request_type all_reduce(std::span<T> buf, reduce_op op, context_type = {}) {
    check_usable("all_reduce");
    do_all_reduce<T>(nullptr, buf.data(), buf.size(), op);
    return {};
  }

  /// @brief Only `root` receives the reduction; recv is ignored elsewhere.
  template <comm_element T>
  request_type reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root,
                      context_type = {}) {
    check_root("reduce", root);
    if (rank() == root) check_out_of_place("reduce", send, recv, send.size());
    do_reduce<T>(send.data(), recv.data(), send.size(), op, root);
    return {};
  }
  /// @brief In-place reduce: root's buf receives the result (`MPI_IN_PLACE` on root).
  template <comm_element T>
  request_type reduce(std::span<T> buf, reduce_op op, int root, context_type = {}) {
    check_root("reduce", root);
    do_reduce<T>(rank() == root ? nullptr : buf.data(), buf.data(), buf.size(), op, root);
    return {};
  }

  /// @brief recv = block `rank()` of the reduction of every rank's send (`size() * recv.size()`).
  template <comm_element T>
  request_type reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                              context_type = {}) {
    const std::size_t count = recv.size();
    const std::size_t total = checked_mul("reduce_scatter", count);
    if (send.size() < total)
      bad_argument("reduce_scatter", "send buffer holds " + std::to_string(send.size()) +
                                         " elements but size() * recv.size() = " + std::to_string(total) +
                                         " are needed");
    check_out_of_place("reduce_scatter", send.first(total), recv, count);
    do_reduce_scatter<T>(send.data(), recv.data(), count, op);
    return {};
  }
  /// @brief In-place reduce_scatter (NCCL's convention): the result lands in block `rank()` of buf.
  template <comm_element T>
  request_type reduce_scatter(std::span<T> buf, reduce_op op, context_type = {}) {
    check_usable("reduce_scatter");
    const std::size_t count = blocks_of("reduce_scatter", buf.size());
    // MPI's in-place form puts the result at the start of the buffer and may use the rest as
    // scratch; meshlib's leaves every other block as it was. So the input is copied, and the result
    // written straight into block rank().
    const std::vector<T> input(buf.begin(), buf.end());
    do_reduce_scatter<T>(input.data(), buf.data() + static_cast<std::size_t>(rank()) * count, count, op);
    return {};
  }

  // ---- data movement ---------------------------------------------------------------------------

  /// @brief Every rank's recv receives root's send (read on root only).
  template <comm_element T>
  request_type broadcast(std::span<const std::type_identity_t<T>> send, std::span<T> recv, int root,
                         context_type = {}) {
    check_root("broadcast", root);
    if (rank() == root) {
      check_out_of_place("broadcast", send, recv, recv.size());
      if (send.size() < recv.size())
        bad_argument("broadcast", "root's send buffer holds " + std::to_string(send.size()) +
                                      " elements but recv.size() = " + std::to_string(recv.size()) + " are broadcast");
      if (!recv.empty()) std::memcpy(recv.data(), send.data(), recv.size_bytes());
    }
    do_broadcast<T>(recv.data(), recv.size(), root);
    return {};
  }
  /// @brief In-place broadcast.
  template <comm_element T>
  request_type broadcast(std::span<T> buf, int root, context_type = {}) {
    check_root("broadcast", root);
    do_broadcast<T>(buf.data(), buf.size(), root);
    return {};
  }

  /// @brief recv = [send of rank 0, send of rank 1, ...].
  template <comm_element T>
  request_type all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type = {}) {
    const std::size_t count = send.size();
    check_out_of_place("all_gather", send, recv, checked_mul("all_gather", count));
    do_all_gather<T>(send.data(), recv.data(), count);
    return {};
  }
  /// @brief In-place all_gather (`MPI_IN_PLACE`): own block already at block `rank()`.
  template <comm_element T>
  request_type all_gather(std::span<T> buf, context_type = {}) {
    check_usable("all_gather");
    do_all_gather<T>(nullptr, buf.data(), blocks_of("all_gather", buf.size()));
    return {};
  }

  /// @brief Block j of send goes to rank j, landing in its block `rank()`.
  template <comm_element T>
  request_type all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type = {}) {
    const std::size_t count = blocks_of("all_to_all", send.size());
    check_out_of_place("all_to_all", send, recv, send.size());
    do_all_to_all<T>(send.data(), recv.data(), count);
    return {};
  }
  /// @brief In-place all_to_all (`MPI_IN_PLACE`).
  template <comm_element T>
  request_type all_to_all(std::span<T> buf, context_type = {}) {
    check_usable("all_to_all");
    do_all_to_all<T>(nullptr, buf.data(), blocks_of("all_to_all", buf.size()));
    return {};
  }

  /// @brief all_to_all with a count per peer (`MPI_Alltoallv`). Counts and displacements must fit
  /// in an `int` (MPI's), else `comm_argument_error`.
  template <comm_element T>
  request_type all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, std::span<T> recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            context_type = {}) {
    constexpr const char* k = "all_to_all_v";
    check_usable(k);
    const auto sc = layout(k, "send", send.size(), send_counts);
    const auto sd = layout(k, "send", send.size(), send_displs, &send_counts);
    const auto rc = layout(k, "recv", recv.size(), recv_counts);
    const auto rd = layout(k, "recv", recv.size(), recv_displs, &recv_counts);
    if (detail::buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
      bad_argument(k, "the send and receive buffers overlap; all_to_all_v has no in-place form");
    if (state_->options.verify_collectives) {
      verify(k, datatype_of<T>, 0, 0, 0);
      // Every rank's recv_counts[j] must be rank j's send_counts[rank()].
      std::vector<int> their(static_cast<std::size_t>(size()));
      timed("all_to_all_v (count check)", sizeof(int) * their.size(),
            [&](MPI_Request* r) { return MPI_Ialltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm, r); },
            [&] { return MPI_Alltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm); });
      for (int j = 0; j < size(); ++j)
        if (their[static_cast<std::size_t>(j)] != rc[static_cast<std::size_t>(j)])
          throw collective_mismatch("meshlib: all_to_all_v on MPI rank " + std::to_string(rank()) + ": recv_counts[" +
                                    std::to_string(j) + "] = " + std::to_string(rc[static_cast<std::size_t>(j)]) +
                                    " but rank " + std::to_string(j) + " sends " +
                                    std::to_string(their[static_cast<std::size_t>(j)]) + " elements");
    }
    const MPI_Datatype t = detail::mpi_datatype<T>();
    std::size_t bytes = 0;
    for (int c : sc) bytes += static_cast<std::size_t>(c) * sizeof(T);
    timed(k, bytes,
          [&](MPI_Request* r) {
            return MPI_Ialltoallv(send.data(), sc.data(), sd.data(), t, recv.data(), rc.data(), rd.data(), t,
                                  state_->comm, r);
          },
          [&] {
            return MPI_Alltoallv(send.data(), sc.data(), sd.data(), t, recv.data(), rc.data(), rd.data(), t,
                                 state_->comm);
          });
    return {};
  }

  /// @brief recv gets the send of the pair whose destination this rank is, or zeros (as JAX).
  template <comm_element T>
  request_type ppermute(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const permute_pair> pairs, context_type = {}) {
    check_pairs(pairs);
    check_out_of_place("ppermute", send, recv, send.size());
    do_ppermute<T>(send.data(), recv.data(), send.size(), pairs);
    return {};
  }
  /// @brief In-place ppermute.
  template <comm_element T>
  request_type ppermute(std::span<T> buf, std::span<const permute_pair> pairs, context_type = {}) {
    check_pairs(pairs);
    const std::vector<T> copy(buf.begin(), buf.end());
    do_ppermute<T>(copy.data(), buf.data(), buf.size(), pairs);
    return {};
  }

  // ---- point to point --------------------------------------------------------------------------

  /// @brief Sends buf to rank `dest` with `tag` (0 <= tag < the MPI tag bound - 1). Buffered:
  /// returns once buf is copied, so exchanges written as send-then-recv on every rank cannot
  /// deadlock.
  template <class T>
    requires comm_element<T>
  request_type send(std::span<T> buf, int dest, int tag = 0, context_type = {}) {
    check_usable("send");
    check_peer("send", dest, "destination");
    check_tag("send", tag);
    progress_sends();
    detail::mpi_comm_state::pending_send p;
    p.data.resize(buf.size_bytes());
    if (!buf.empty()) std::memcpy(p.data.data(), buf.data(), buf.size_bytes());
    check_count("send", buf.size());
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(buf.size()), detail::mpi_datatype<std::remove_cv_t<T>>(), dest,
                       tag, state_->comm, &p.request),
             "MPI_Isend");
    state_->sends.push_back(std::move(p));
    return {};
  }

  /// @brief Receives into buf the oldest message from `source` with `tag`; its count must be
  /// buf's (else `collective_mismatch`).
  template <comm_element T>
  request_type recv(std::span<T> buf, int source, int tag = 0, context_type = {}) {
    check_usable("recv");
    check_peer("recv", source, "source");
    check_tag("recv", tag);
    check_count("recv", buf.size());
    // Probe first (matched probe: safe when other threads use the communicator), so that a
    // message of another length is reported instead of truncated.
    MPI_Status st;
    MPI_Message msg = MPI_MESSAGE_NULL;
    poll("recv", [&](int* done) {
      progress_sends();
      return MPI_Improbe(source, tag, state_->comm, done, &msg, &st);
    });
    int got = 0;
    MPI_Get_count(&st, detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(buf.size())) {
      // Consume the message so the stream stays in order, then report.
      std::vector<unsigned char> sink;
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      sink.resize(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                                " expected " + std::to_string(buf.size()) + " elements of " +
                                std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(source) +
                                " (tag " + std::to_string(tag) + ") but the message holds " +
                                (got == MPI_UNDEFINED ? std::to_string(bytes) + " bytes" : std::to_string(got)));
    }
    check_rc(MPI_Mrecv(buf.data(), got, detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
    return {};
  }

  // ---- synchronisation and groups --------------------------------------------------------------

  /// @brief Returns once every rank has called barrier (polled against the timeout).
  request_type barrier(context_type = {}) {
    check_usable("barrier");
    progress_sends();
    timed("barrier", 0, [&](MPI_Request* r) { return MPI_Ibarrier(state_->comm, r); },
          [&] { return MPI_Barrier(state_->comm); });
    return {};
  }

  /// @brief `MPI_Comm_split`: ranks with the same `color` (>= 0) form a new communicator, ordered
  /// by (key, rank). The result owns its `MPI_Comm` and has this one's options.
  mpi_communicator split(int color, int key) {
    check_usable("split");
    if (color < 0) bad_argument("split", "color " + std::to_string(color) + " is negative; colors are >= 0");
    // Arrive first (polled), so that a rank that never splits is a timeout, not a hang.
    barrier();
    auto s = std::make_shared<detail::mpi_comm_state>();
    s->options = state_->options;
    s->oversubscribed = state_->oversubscribed;  // a property of the placement, not of the group
    check_rc(MPI_Comm_split(state_->comm, color, key, &s->comm), "MPI_Comm_split");
    finish(*s);
    mpi_communicator out;
    out.state_ = std::move(s);
    return out;
  }

 private:
  // ---- checks ----------------------------------------------------------------------------------

  std::string where(std::string_view k) const {
    return std::string(k) + " on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size());
  }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty mpi_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    if (state_->failed) throw comm_timeout("meshlib: refused " + where(k) + ": the communicator has failed: " + state_->failure);
  }
  [[noreturn]] void bad_argument(std::string_view k, const std::string& what) const {
    throw comm_argument_error("meshlib: invalid argument to " + where(k) + ": " + what);
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed" + (state_ ? " on MPI rank " + std::to_string(rank()) : "") +
                       ": " + detail::mpi_error_string(rc));
  }
  void check_root(std::string_view k, int root) const {
    check_usable(k);
    if (root < 0 || root >= size())
      bad_argument(k, "root " + std::to_string(root) + " is out of range [0, " + std::to_string(size()) + ")");
  }
  void check_peer(std::string_view k, int peer, const char* what) const {
    if (peer < 0 || peer >= size())
      bad_argument(k, std::string(what) + " rank " + std::to_string(peer) + " is out of range [0, " +
                          std::to_string(size()) + ")");
  }
  void check_tag(std::string_view k, int tag) const {
    if (tag < 0 || tag >= state_->tag_ub)
      bad_argument(k, "tag " + std::to_string(tag) + " is out of range [0, " + std::to_string(state_->tag_ub) +
                          "); the top tag is meshlib's");
  }
  void check_count(std::string_view k, std::size_t count) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      bad_argument(k, "count " + std::to_string(count) + " exceeds MPI's int count (" + std::to_string(INT_MAX) +
                          "); split the call");
  }
  template <class T>
  void check_out_of_place(std::string_view k, std::span<const T> send, std::span<T> recv, std::size_t needed) const {
    check_usable(k);
    if (auto problem = detail::out_of_place_problem(send, recv, needed); !problem.empty()) bad_argument(k, problem);
  }
  std::size_t checked_mul(std::string_view k, std::size_t count) const {
    check_usable(k);
    const auto n = static_cast<std::size_t>(size());
    if (count > std::numeric_limits<std::size_t>::max() / n)
      bad_argument(k, "count " + std::to_string(count) + " times " + std::to_string(n) + " ranks overflows");
    return count * n;
  }
  std::size_t blocks_of(std::string_view k, std::size_t total) const {
    const auto n = static_cast<std::size_t>(size());
    if (total % n != 0)
      bad_argument(k, "buffer of " + std::to_string(total) + " elements does not split into " + std::to_string(n) +
                          " equal blocks");
    return total / n;
  }
  /// Counts (or, with `counts`, displacements) of an all_to_all_v side as MPI's ints.
  std::vector<int> layout(std::string_view k, const char* which, std::size_t buffer, std::span<const std::int64_t> v,
                          const std::span<const std::int64_t>* counts = nullptr) const {
    const auto n = static_cast<std::size_t>(size());
    const std::string w = std::string(which) + (counts ? "_displs" : "_counts");
    if (v.size() != n)
      bad_argument(k, w + " needs " + std::to_string(n) + " entries, got " + std::to_string(v.size()));
    std::vector<int> out(n);
    for (std::size_t j = 0; j < n; ++j) {
      if (v[j] < 0 || v[j] > INT_MAX)
        bad_argument(k, w + "[" + std::to_string(j) + "] = " + std::to_string(v[j]) + " is negative or exceeds MPI's int");
      out[j] = static_cast<int>(v[j]);
      if (counts) {
        const std::int64_t c = (*counts)[j];
        if (static_cast<std::uint64_t>(c) + static_cast<std::uint64_t>(v[j]) > buffer)
          bad_argument(k, std::string(which) + " block " + std::to_string(j) + " (displacement " + std::to_string(v[j]) +
                              ", count " + std::to_string(c) + ") runs past the end of the " + which + " buffer of " +
                              std::to_string(buffer) + " elements");
      }
    }
    return out;
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
        bad_argument("ppermute", "rank " + std::to_string(p.source) + " is the source of two pairs; each rank sends at most once");
      if (dst[static_cast<std::size_t>(p.dest)]++)
        bad_argument("ppermute", "rank " + std::to_string(p.dest) + " is the destination of two pairs; each rank receives at most once");
    }
  }

  // ---- waiting ---------------------------------------------------------------------------------

  bool has_deadline() const noexcept { return state_->options.timeout.count() > 0; }

  /// Polls `test(&done)` (an MPI call returning its error code) until done or the deadline.
  template <class Test>
  void poll(std::string_view k, Test&& test) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = has_deadline() ? start + state_->options.timeout : std::chrono::steady_clock::time_point::max();
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      check_rc(test(&done), "MPI_Test");
      if (done) return;
      if (spins > 256) std::this_thread::yield();  // oversubscribed ranks must let their peers run
      if ((spins & 63) == 0 && std::chrono::steady_clock::now() > deadline) fail_timeout(k);
    }
  }
  void wait(std::string_view k, MPI_Request& r) {
    poll(k, [&](int* done) { return MPI_Test(&r, done, MPI_STATUS_IGNORE); });
  }

  [[noreturn]] void fail_timeout(std::string_view k) {
    const double secs = std::chrono::duration<double>(state_->options.timeout).count();
    state_->failed = true;
    state_->failure = "meshlib: " + where(k) + " did not complete within " + std::to_string(secs) +
                      " s: a peer never called it (it failed, or called another operation); MPI cannot cancel a "
                      "collective, so this communicator refuses further operations; end the run";
    throw comm_timeout(state_->failure);
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
      check_rc(MPI_Ibarrier(state_->comm, &r), "MPI_Ibarrier");
      wait(k, r);
      check_rc(bl(), k);
    } else {
      check_rc(nb(&r), k);
      wait(k, r);
    }
  }

  void progress_sends() {
    auto& v = state_->sends;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](detail::mpi_comm_state::pending_send& s) {
                             int done = 0;
                             check_rc(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
                             return done != 0;
                           }),
            v.end());
  }

  static constexpr std::string_view verified_ops[] = {"all_reduce", "reduce",     "reduce_scatter", "broadcast",
                                                      "all_gather", "all_to_all", "all_to_all_v",   "ppermute"};

  /// With verify_collectives: every rank's (operation, type, count, op, root) must agree.
  void verify(std::string_view k, datatype dt, std::size_t count, int op, int root) {
    std::int64_t kind = 0;
    while (kind < 8 && verified_ops[kind] != k) ++kind;
    std::int64_t mine[5] = {kind, static_cast<std::int64_t>(dt), static_cast<std::int64_t>(count), op, root};
    std::vector<std::int64_t> all(5 * static_cast<std::size_t>(size()));
    timed(k, 0, [&](MPI_Request* r) { return MPI_Iallgather(mine, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, state_->comm, r); },
          [&] { return MPI_Allgather(mine, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, state_->comm); });
    bool same = true;
    for (int r = 1; r < size(); ++r)
      same = same && std::equal(all.begin(), all.begin() + 5, all.begin() + 5 * r);
    if (same) return;
    std::string msg = "meshlib: collective mismatch on an MPI communicator of " + std::to_string(size()) +
                      " ranks (seen by rank " + std::to_string(rank()) + "): the ranks called different collectives:";
    for (int r = 0; r < size(); ++r) {
      const auto* d = all.data() + 5 * r;
      const bool reducing = d[0] <= 2;
      msg += std::string(r ? ";" : "") + " rank " + std::to_string(r) + ": " +
             std::string(d[0] < 8 ? verified_ops[d[0]] : "?") + " of " + std::to_string(d[2]) + " " +
             std::string(to_string(static_cast<datatype>(d[1]))) +
             (reducing ? ", op " + std::string(to_string(static_cast<reduce_op>(d[3]))) : std::string()) +
             (d[0] == 1 || d[0] == 3 ? ", root " + std::to_string(d[4]) : std::string());
    }
    throw collective_mismatch(msg);
  }

  template <class T>
  void maybe_verify(std::string_view k, std::size_t count, reduce_op op, int root) {
    if (state_->options.verify_collectives) verify(k, datatype_of<T>, count, static_cast<int>(op), root);
  }

  // ---- operations ------------------------------------------------------------------------------

  static const void* in_place(const void* p) noexcept { return p ? p : MPI_IN_PLACE; }

  /// send == nullptr: in place.
  template <class T>
  void do_all_reduce(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>("all_reduce", count, op, 0);
    check_count("all_reduce", count);
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
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("all_reduce", count * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallreduce(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Allreduce(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  /// On root, send == nullptr means in place; elsewhere send is read.
  template <class T>
  void do_reduce(const T* send, T* recv, std::size_t count, reduce_op op, int root) {
    maybe_verify<T>("reduce", count, op, root);
    check_count("reduce", count);
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
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    const void* s = is_root ? in_place(send) : static_cast<const void*>(send);
    void* rb = is_root ? static_cast<void*>(recv) : nullptr;
    timed("reduce", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ireduce(s, rb, n, t, o, root, state_->comm, r); },
          [&] { return MPI_Reduce(s, rb, n, t, o, root, state_->comm); });
    if (is_root && op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  /// send == nullptr: in place, the result at the start of recv (MPI's convention).
  template <class T>
  void do_reduce_scatter(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>("reduce_scatter", count, op, 0);
    check_count("reduce_scatter", count * static_cast<std::size_t>(size()));
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
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("reduce_scatter", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Reduce_scatter_block(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  template <class T>
  void do_broadcast(T* buf, std::size_t count, int root) {
    maybe_verify<T>("broadcast", count, reduce_op::sum, root);
    check_count("broadcast", count);
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("broadcast", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ibcast(buf, n, t, root, state_->comm, r); },
          [&] { return MPI_Bcast(buf, n, t, root, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_gather(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>("all_gather", count, reduce_op::sum, 0);
    check_count("all_gather", count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    // MPI_IN_PLACE ignores the send count and type.
    timed("all_gather", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallgather(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Allgather(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_to_all(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>("all_to_all", count, reduce_op::sum, 0);
    check_count("all_to_all", count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("all_to_all", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ialltoall(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Alltoall(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  template <class T>
  void do_ppermute(const T* send, T* recv, std::size_t count, std::span<const permute_pair> pairs) {
    maybe_verify<T>("ppermute", count, reduce_op::sum, static_cast<int>(pairs.size()));
    check_count("ppermute", count);
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
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
    if constexpr (std::is_same_v<T, bfloat16>) return detail::bf16_mpi_op(op);
    else return detail::mpi_op(op);
  }

  void finish(detail::mpi_comm_state& s) {
    check_rc(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(s.comm, &s.rank);
    MPI_Comm_size(s.comm, &s.size);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(s.comm, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) s.tag_ub = *ub;
  }

  std::shared_ptr<detail::mpi_comm_state> state_;
};

static_assert(communicator<mpi_communicator>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
