// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The debug layer's observer: `run_observer` implements the collectives layer's
/// `comm_observer` (collectives/observer.hpp). The exec layer creates one per run (`shard_map`,
/// `spmd`, `reshard`: exec/detail/run_devices.hpp); when tracing, debug mode or a Kokkos tool is on,
/// every device's communicators are wrapped in the collectives' forwarding decorator
/// (`observed_comm`), which forwards every operation to the real one and reports it here around
/// it: this observer records the collective in the trace (`trace.hpp`), reports it to Kokkos tools
/// as a profiling region, checks its input and output for NaN/Inf, and marks the device's arrival
/// on the run's board so that a watchdog can warn about a device that keeps the others waiting.
/// When all three are off nothing is wrapped: the cost is one predictable branch per collective
/// (on the observer pointer, in `experimental::device_context_for::comm`).
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

#include "meshlib/collectives/observer.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/timeout.hpp"
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

namespace debug::detail {

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

}  // namespace debug::detail

/// @brief Turns debug mode on (see the file comment); later runs check as `options` says.
inline void enable_debug_mode(debug_options options = {}) {
  auto& s = debug::detail::debug_state::get();
  std::lock_guard lk(s.m);
  s.options = std::move(options);
  s.on.store(true);
}

/// @brief Turns debug mode off.
inline void disable_debug_mode() { debug::detail::debug_state::get().on.store(false); }

/// @brief True while debug mode is on (`MESHLIB_DEBUG=1` or `enable_debug_mode`).
[[nodiscard]] inline bool debug_mode() noexcept { return debug::detail::debug_state::get().on.load(std::memory_order_relaxed); }

/// @brief Debug mode for a scope; restores the previous state.
class scoped_debug_mode {
 public:
  /// Turns debug mode on with `options` until the scope ends.
  explicit scoped_debug_mode(debug_options options = {}) : was_(debug_mode()) {
    auto& s = debug::detail::debug_state::get();
    std::lock_guard lk(s.m);
    previous_ = s.options;
    s.options = std::move(options);
    s.on.store(true);
  }
  ~scoped_debug_mode() {
    auto& s = debug::detail::debug_state::get();
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

namespace debug::detail {

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

/// Shared state of one run (see the file comment). A template used through one alias
/// (`run_observer`), so that its code is compiled only where a runner is (see
/// `basic_trace_recorder`).
template <class Tag = void>
class basic_run_observer final : public experimental::comm_observer {
  using recorder = basic_trace_recorder<Tag>;

 public:
  /// Decides whether the run is observed; when it is, names the trace tracks of `local` devices
  /// and, in debug mode with slow warnings on, starts the watchdog.
  template <mesh_type Mesh>
  basic_run_observer(const Mesh& m, const std::vector<std::size_t>& local) {
    auto& rec = recorder::get();
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
      for (auto d : local) rec.name_track(d, experimental::device_label(m, d));
    if (debug_ && options_.slow_warning_fraction > 0) {
      threshold_ = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.timeout * options_.slow_warning_fraction);
      watchdog_ = std::thread([this] { watch(); });
    }
  }
  ~basic_run_observer() {
    if (watchdog_.joinable()) {
      {
        std::lock_guard lk(m_);
        stop_ = true;
      }
      cv_.notify_all();
      watchdog_.join();
    }
  }
  basic_run_observer(const basic_run_observer&) = delete;
  basic_run_observer& operator=(const basic_run_observer&) = delete;

  [[nodiscard]] bool active() const noexcept override { return tracing_ || debug_ || kokkos_; }
  [[nodiscard]] bool tracing() const noexcept { return tracing_; }
  [[nodiscard]] bool kokkos() const noexcept { return kokkos_; }
  [[nodiscard]] bool check_nonfinite() const noexcept { return debug_ && options_.check_nonfinite; }
  [[nodiscard]] std::uint64_t run() const noexcept { return run_; }

  /// A device's communicator on a group is decorated: its trace track, looked up once.
  void open(experimental::comm_site& site) override {
    if (tracing_) site.data = &recorder::get().track_of(site.device);
  }

  /// Before a collective: checks its input, opens its Kokkos region, marks the device's arrival.
  void enter(const experimental::comm_site& site, experimental::comm_call& call) override {
    if (check_nonfinite()) check_finite(site, call.name, "input", call.in, call.in_count, call.dt);
    const std::string what = std::string(call.name) + " over '" + site.axes + "'";
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::pushRegion("meshlib::" + what);
#endif
    call.start_ns = recorder::get().now_ns();
    arrive(site, call.seq, what);
  }

  /// After it, returned or not: the device's departure, the end of its Kokkos region.
  void leave(const experimental::comm_site& site, const experimental::comm_call& call) noexcept override {
    try {
      depart(site, call.seq);
    } catch (...) {  // only an allocation of the board's map can fail: the watchdog misses one exit
    }
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::popRegion();
#endif
  }

  /// After it returned: the trace event, the check of its output.
  void done(const experimental::comm_site& site, const experimental::comm_call& call) override {
    if (site.data != nullptr) {
      auto& rec = recorder::get();
      trace_event e;
      e.name = call.name;
      e.axes = site.axes;
      e.dtype = std::string(to_string(call.dt));
      e.bytes = call.send_count * size_of(call.dt);
      e.start_ns = call.start_ns;
      e.end_ns = rec.now_ns();
      e.collective = true;
      e.run = run_;
      e.mask = site.mask;
      e.color = site.color;
      e.seq = call.seq;
      e.group = experimental::join_ids(site.group);
      rec.record(*static_cast<typename recorder::track*>(site.data), std::move(e));
    }
    if (check_nonfinite()) check_finite(site, call.name, "output", call.out, call.out_count, call.dt);
  }

  /// The device of `site` entered its `seq`-th collective `what` on its group.
  void arrive(const experimental::comm_site& site, std::uint64_t seq, const std::string& what) {
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
  void depart(const experimental::comm_site& site, std::uint64_t seq) {
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
  void check_finite(const experimental::comm_site& site, const char* op, const char* which, const void* p, std::size_t n,
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
        os << std::fixed << "meshlib: warning: " << p.what << " (devices " << experimental::join_ids(p.group)
           << ") has waited " << static_cast<double>(now - p.first_ns) * 1e-9 << " s for device"
           << (missing.size() == 1 ? " " : "s ") << experimental::join_ids(missing);
        if (!elsewhere.empty()) os << (missing.empty() ? "" : " and") << " devices " << experimental::join_ids(elsewhere)
                                   << " of other processes";
        os << " (not yet arrived; devices " << experimental::join_ids(here) << " are waiting; the timeout is " << std::defaultfloat
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

/// The debug layer's observer of one run (see `basic_run_observer`).
using run_observer = basic_run_observer<>;

}  // namespace debug::detail

namespace experimental {
/// The observer debug installs on a run's devices (exec installs it).
using debug::detail::run_observer;
}  // namespace experimental
}  // namespace meshlib
