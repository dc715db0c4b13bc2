// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The debug layer's one decorator point. A runner creates one `run_observer` per run
/// (`shard_map`, `spmd`, `reshard`); when tracing, debug mode or a Kokkos tool is on, every device's
/// communicators are wrapped in an `observed_comm`, which forwards every operation to the real one
/// and around it: records the collective in the trace (`trace.hpp`), reports it to Kokkos tools as a
/// profiling region, checks its input and output for NaN/Inf, and marks the device's arrival on the
/// run's board so that a watchdog can warn about a device that keeps the others waiting. When all
/// three are off the runner does not wrap: the cost is one predictable branch per collective (on
/// the observer pointer, in `device_context_for::comm`).
///
/// Debug mode: `MESHLIB_DEBUG=1` in the environment, or `enable_debug_mode(options)`.
/// @code
/// meshlib::enable_debug_mode({.slow_warning_fraction = 0.1, .timeout = std::chrono::seconds(5)});
/// auto y = f(x);   // NaN/Inf in a collective -> nonfinite_error; a device 0.5 s late -> one warning
/// @endcode

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/debug/errors.hpp"
#include "meshlib/debug/trace.hpp"

// Kokkos' profiling interface (Kokkos 3.4 and 4.x both have Kokkos::Profiling::pushRegion /
// popRegion / profileLibraryLoaded). The comm layer builds without Kokkos; so does this header.
#if __has_include(<Kokkos_Core.hpp>)
#include <Kokkos_Core.hpp>
/// 1 when Kokkos' headers are on the include path (this header then uses Kokkos' profiling hooks).
#define MESHLIB_DEBUG_HAS_KOKKOS 1
#else
/// 0 when Kokkos' headers are not on the include path (the header builds without Kokkos).
#define MESHLIB_DEBUG_HAS_KOKKOS 0
#endif

namespace meshlib {

/// @brief What debug mode checks.
struct debug_options {
  /// Check every collective's input and output for NaN and infinity (floating-point types).
  bool check_nonfinite = true;
  /// Check that `shard_map` outputs are identical over the axes their type says they are replicated over.
  bool check_replicas = true;
  /// Warn once about a collective whose devices have waited this fraction of `timeout` for a late
  /// peer. 0 disables the warning.
  double slow_warning_fraction = 0.25;
  /// The communicators' timeout that the fraction is of (the backend's own setting is not visible
  /// here; default: `MESHLIB_COMM_TIMEOUT` or 60 s, the communicators' default too).
  std::chrono::nanoseconds timeout = [] {
    try {
      return default_comm_timeout();
    } catch (const std::exception&) {
      return std::chrono::nanoseconds(default_comm_timeout_fallback);
    }
  }();
  /// Where warnings go (default: one line on std::cerr).
  std::function<void(const std::string&)> on_warning;
};

namespace detail {

struct debug_state {
  std::mutex m;
  std::atomic<bool> on{false};
  debug_options options;

  static debug_state& get() {
    static debug_state s;
    return s;
  }

 private:
  debug_state() {
    const char* env = std::getenv("MESHLIB_DEBUG");  // NOLINT(concurrency-mt-unsafe): read once
    on.store(env != nullptr && *env != '\0' && std::string_view(env) != "0");
  }
};

}  // namespace detail

/// @brief Turns debug mode on (see the file comment); later runs check as `options` says.
inline void enable_debug_mode(debug_options options = {}) {
  auto& s = detail::debug_state::get();
  std::lock_guard lk(s.m);
  s.options = std::move(options);
  s.on.store(true);
}

/// @brief Turns debug mode off.
inline void disable_debug_mode() { detail::debug_state::get().on.store(false); }

/// @brief True while debug mode is on (`MESHLIB_DEBUG=1` or `enable_debug_mode`).
[[nodiscard]] inline bool debug_mode() noexcept { return detail::debug_state::get().on.load(std::memory_order_relaxed); }

/// @brief Debug mode for a scope; restores the previous state.
class scoped_debug_mode {
 public:
  /// Turns debug mode on with `options` until the scope ends.
  explicit scoped_debug_mode(debug_options options = {}) : was_(debug_mode()) {
    auto& s = detail::debug_state::get();
    std::lock_guard lk(s.m);
    previous_ = s.options;
    s.options = std::move(options);
    s.on.store(true);
  }
  ~scoped_debug_mode() {
    auto& s = detail::debug_state::get();
    std::lock_guard lk(s.m);
    s.options = std::move(previous_);
    s.on.store(was_);
  }
  scoped_debug_mode(const scoped_debug_mode&) = delete;
  scoped_debug_mode& operator=(const scoped_debug_mode&) = delete;

 private:
  bool was_;
  debug_options previous_;
};

namespace detail {

/// Inside this scope the calling thread's collectives are not observed: the debug layer's own
/// collectives (ordered printing, replica checks) stay out of the trace and the checks.
inline int& unobserved_depth() noexcept {
  thread_local int depth = 0;
  return depth;
}
struct unobserved_scope {
  unobserved_scope() noexcept { ++unobserved_depth(); }
  ~unobserved_scope() { --unobserved_depth(); }
  unobserved_scope(const unobserved_scope&) = delete;
  unobserved_scope& operator=(const unobserved_scope&) = delete;
};

/// "device 3 (data=1, model=1)".
template <mesh_type Mesh>
std::string device_label(const Mesh& m, std::size_t device) {
  std::string s = "device " + std::to_string(device) + " (";
  const auto c = m.coords(device);
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    s += (a ? ", " : "") + std::string(Mesh::axis_names[a]) + "=" + std::to_string(c[a]);
  return s + ")";
}

inline std::string join_ids(const std::vector<std::size_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

/// Where a device's communicator sits: the device, its group along `mask` and the axes' names.
struct comm_site {
  std::size_t device = 0;
  std::string device_label;
  axis_mask mask = 0;
  std::string axes;  // "model", "data,model"
  std::size_t color = 0;
  std::vector<std::size_t> group;  // device ids in group-rank order
  std::size_t group_rank = 0;
};

/// The user-level name of a reduction: psum, pmean, pmax, pmin (the typed collectives' names).
constexpr const char* reduction_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "psum";
    case reduce_op::mean: return "pmean";
    case reduce_op::max: return "pmax";
    case reduce_op::min: return "pmin";
    default: return "all_reduce";
  }
}

/// The first non-finite element of `n` elements of `dt` at `p`, or -1.
inline std::ptrdiff_t first_nonfinite(const void* p, std::size_t n, datatype dt, double& value) {
  auto scan = [&](auto tag) -> std::ptrdiff_t {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<float>(x[i]));
      if (!std::isfinite(v)) {
        value = v;
        return static_cast<std::ptrdiff_t>(i);
      }
    }
    return -1;
  };
  switch (dt) {
    case datatype::float32: return scan(float{});
    case datatype::bfloat16: return scan(bfloat16{});
    case datatype::float64: {
      const double* x = static_cast<const double*>(p);
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) {
          value = x[i];
          return static_cast<std::ptrdiff_t>(i);
        }
      return -1;
    }
    default: return -1;
  }
}

/// Shared state of one run (see the file comment).
class run_observer {
 public:
  /// Decides whether the run is observed; when it is, names the trace tracks of `local` devices
  /// and, in debug mode with slow warnings on, starts the watchdog.
  template <mesh_type Mesh>
  run_observer(const Mesh& m, const std::vector<std::size_t>& local) {
    auto& rec = trace_recorder::get();
    tracing_ = rec.on();
    auto& dbg = debug_state::get();
    debug_ = dbg.on.load();
#if MESHLIB_DEBUG_HAS_KOKKOS
    kokkos_ = Kokkos::Profiling::profileLibraryLoaded();
#endif
    if (!(tracing_ || debug_ || kokkos_)) return;
    if (debug_) {
      std::lock_guard lk(dbg.m);
      options_ = dbg.options;
    }
    run_ = rec.next_run();
    local_.assign(m.size(), false);
    for (auto d : local) local_[d] = true;
    if (tracing_)
      for (auto d : local) rec.name_track(d, device_label(m, d));
    if (debug_ && options_.slow_warning_fraction > 0) {
      threshold_ = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.timeout * options_.slow_warning_fraction);
      watchdog_ = std::thread([this] { watch(); });
    }
  }
  ~run_observer() {
    if (watchdog_.joinable()) {
      {
        std::lock_guard lk(m_);
        stop_ = true;
      }
      cv_.notify_all();
      watchdog_.join();
    }
  }
  run_observer(const run_observer&) = delete;
  run_observer& operator=(const run_observer&) = delete;

  [[nodiscard]] bool active() const noexcept { return tracing_ || debug_ || kokkos_; }
  [[nodiscard]] bool tracing() const noexcept { return tracing_; }
  [[nodiscard]] bool kokkos() const noexcept { return kokkos_; }
  [[nodiscard]] bool check_nonfinite() const noexcept { return debug_ && options_.check_nonfinite; }
  [[nodiscard]] std::uint64_t run() const noexcept { return run_; }

  template <mesh_type Mesh>
  comm_site site(const Mesh& m, std::size_t device, axis_mask mask) const {
    comm_site s;
    s.device = device;
    s.device_label = device_label(m, device);
    s.mask = mask & Mesh::all_axes;
    for (std::size_t a = 0; a < Mesh::ndim; ++a)
      if (s.mask & (axis_mask{1} << a)) s.axes += (s.axes.empty() ? "" : ",") + std::string(Mesh::axis_names[a]);
    s.color = m.group_color(device, s.mask);
    s.group = m.group(device, s.mask);
    s.group_rank = m.group_rank(device, s.mask);
    return s;
  }

  /// The device of `site` entered its `seq`-th collective `what` on its group.
  void arrive(const comm_site& site, std::uint64_t seq, const std::string& what) {
    if (!watchdog_.joinable()) return;
    std::lock_guard lk(m_);
    auto& p = board_[key_t{site.mask, site.color, seq}];
    if (p.arrived.empty()) {
      p.what = what;
      p.group = site.group;
      p.arrived.assign(site.group.size(), false);
      p.first_ns = now_ns();
      for (auto d : site.group) p.local += d < local_.size() && local_[d] ? 1 : 0;
    }
    p.arrived[site.group_rank] = true;
  }
  /// The device of `site` left it (returned or threw).
  void depart(const comm_site& site, std::uint64_t seq) {
    if (!watchdog_.joinable()) return;
    std::lock_guard lk(m_);
    auto it = board_.find(key_t{site.mask, site.color, seq});
    if (it != board_.end() && ++it->second.departed >= it->second.local) board_.erase(it);
  }

  void warn(const std::string& message) const {
    if (options_.on_warning) options_.on_warning(message);
    else std::cerr << message << '\n' << std::flush;
  }

  /// Throws nonfinite_error when `n` elements of `dt` at `p` hold a NaN or an infinity.
  void check_finite(const comm_site& site, const char* op, const char* which, const void* p, std::size_t n,
                    datatype dt) const {
    double v = 0;
    const std::ptrdiff_t i = first_nonfinite(p, n, dt, v);
    if (i < 0) return;
    std::ostringstream os;
    os << "meshlib: debug mode: " << op << " over '" << site.axes << "' on " << site.device_label << ": " << which
       << " element " << i << " is " << v << " (" << to_string(dt) << ")";
    throw nonfinite_error(os.str());
  }

 private:
  using key_t = std::tuple<axis_mask, std::size_t, std::uint64_t>;
  struct pending {
    std::string what;
    std::vector<std::size_t> group;
    std::vector<bool> arrived;
    std::size_t local = 0;
    std::size_t departed = 0;
    std::int64_t first_ns = 0;
    bool warned = false;
  };

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void watch() {
    const auto poll = std::clamp<std::chrono::nanoseconds>(threshold_ / 8, std::chrono::milliseconds(1),
                                                           std::chrono::milliseconds(100));
    std::unique_lock lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, poll);
      const std::int64_t now = now_ns();
      for (auto& [key, p] : board_) {
        if (p.warned || now - p.first_ns < threshold_.count()) continue;
        std::vector<std::size_t> missing, here, elsewhere;
        for (std::size_t r = 0; r < p.group.size(); ++r) {
          const std::size_t d = p.group[r];
          if (p.arrived[r]) here.push_back(d);
          else if (d < local_.size() && local_[d]) missing.push_back(d);
          else elsewhere.push_back(d);
        }
        if (missing.empty() && elsewhere.empty()) continue;
        p.warned = true;
        std::ostringstream os;
        os.precision(2);  // not std::setprecision: <iomanip> pulls <locale> into every TU
        os << std::fixed << "meshlib: warning: " << p.what << " (devices " << join_ids(p.group)
           << ") has waited " << static_cast<double>(now - p.first_ns) * 1e-9 << " s for device"
           << (missing.size() == 1 ? " " : "s ") << join_ids(missing);
        if (!elsewhere.empty()) os << (missing.empty() ? "" : " and") << " devices " << join_ids(elsewhere)
                                   << " of other processes";
        os << " (not yet arrived; devices " << join_ids(here) << " are waiting; the timeout is " << std::defaultfloat
           << std::chrono::duration<double>(options_.timeout).count() << " s); carrying on";
        warn(os.str());
      }
    }
  }

  bool tracing_ = false, debug_ = false, kokkos_ = false;
  debug_options options_;
  std::uint64_t run_ = 0;
  std::vector<bool> local_;
  std::chrono::nanoseconds threshold_{0};
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<key_t, pending> board_;
  std::thread watchdog_;
};

/// `Iface` (the typed collectives' per-device communicator interface, `device_comm`) decorated:
/// every operation goes to `inner` with the observation around it (see the file comment).
template <class Iface>
class observed_comm final : public Iface {
 public:
  observed_comm(Iface& inner, run_observer& obs, comm_site site) : inner_(inner), obs_(obs), site_(std::move(site)) {
    if (obs_.tracing()) track_ = &trace_recorder::get().track_of(site_.device);
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

  void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, buf, count, buf, count, [&] { inner_.all_reduce(buf, count, dt, op); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, send, count, recv, count,
            [&] { inner_.all_reduce(send, recv, count, dt, op); });
  }
  void all_gather(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_gather", dt, count, send, count, recv, count * n(), [&] { inner_.all_gather(send, recv, count, dt); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    const char* name = op == reduce_op::sum ? "psum_scatter" : "reduce_scatter";
    observe(name, dt, count * n(), send, count * n(), recv, count,
            [&] { inner_.reduce_scatter(send, recv, count, dt, op); });
  }
  void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_to_all", dt, count * n(), send, count * n(), recv, count * n(),
            [&] { inner_.all_to_all(send, recv, count, dt); });
  }
  void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                    void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                    std::size_t send_total, std::size_t recv_total, datatype dt) override {
    observe("all_to_all_v", dt, send_total, send, send_total, recv, recv_total, [&] {
      inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, send_total, recv_total, dt);
    });
  }
  void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                std::span<const permute_pair> pairs) override {
    observe("ppermute", dt, count, send, count, recv, count, [&] { inner_.ppermute(send, recv, count, dt, pairs); });
  }
  void broadcast(void* buf, std::size_t count, datatype dt, int root) override {
    // Only the root's buffer is an input: the others' may hold anything before the call.
    const bool is_root = static_cast<int>(site_.group_rank) == root;
    observe("broadcast", dt, is_root ? count : 0, buf, is_root ? count : 0, buf, count,
            [&] { inner_.broadcast(buf, count, dt, root); });
  }

 private:
  std::size_t n() const { return static_cast<std::size_t>(inner_.size()); }

  template <class F>
  void observe(const char* name, datatype dt, std::size_t send_count, const void* in, std::size_t in_count,
               const void* out, std::size_t out_count, F&& call) {
    if (unobserved_depth() > 0) {
      call();
      return;
    }
    const std::uint64_t seq = seq_++;
    if (obs_.check_nonfinite()) obs_.check_finite(site_, name, "input", in, in_count, dt);
    const std::string what = std::string(name) + " over '" + site_.axes + "'";
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (obs_.kokkos()) Kokkos::Profiling::pushRegion("meshlib::" + what);
#endif
    auto& rec = trace_recorder::get();
    const std::int64_t start = rec.now_ns();
    obs_.arrive(site_, seq, what);
    struct leave {
      observed_comm& self;
      std::uint64_t seq;
      ~leave() {
        self.obs_.depart(self.site_, seq);
#if MESHLIB_DEBUG_HAS_KOKKOS
        if (self.obs_.kokkos()) Kokkos::Profiling::popRegion();
#endif
      }
    };
    {
      leave guard{*this, seq};
      call();
    }
    if (track_ != nullptr) {
      trace_event e;
      e.name = name;
      e.axes = site_.axes;
      e.dtype = std::string(to_string(dt));
      e.bytes = send_count * size_of(dt);
      e.start_ns = start;
      e.end_ns = rec.now_ns();
      e.collective = true;
      e.run = obs_.run();
      e.mask = site_.mask;
      e.color = site_.color;
      e.seq = seq;
      e.group = join_ids(site_.group);
      rec.record(*track_, std::move(e));
    }
    if (obs_.check_nonfinite()) obs_.check_finite(site_, name, "output", out, out_count, dt);
  }

  Iface& inner_;
  run_observer& obs_;
  comm_site site_;
  trace_recorder::track* track_ = nullptr;
  std::uint64_t seq_ = 0;
};

}  // namespace detail
}  // namespace meshlib
