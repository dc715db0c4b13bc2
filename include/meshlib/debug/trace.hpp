// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The trace recorder: a timeline of every collective and every user region, per device,
/// written as Chrome trace event JSON (Perfetto's UI and chrome://tracing open it), and a summary
/// per collective type, axis and device. Off by default; on through `start_trace(path)` /
/// `stop_trace()` (as `jax.profiler.start_trace` / `stop_trace`), the RAII `scoped_trace`, or the
/// environment: `MESHLIB_TRACE=trace.json` traces the whole program and writes the file (and prints
/// the summary to stderr) at exit. The file is opened when tracing starts: a path that cannot be
/// written throws `error` then (for the variable: from the program's first traced call, or from
/// `tracing()`), not at the end of the run.
///
/// The recorder only stores events; the runners feed it through the debug layer's one decorator
/// point (`observe.hpp`), and `trace_region` adds the user's regions.
/// @code
/// meshlib::start_trace("step.json");
/// auto y = f(x);                                    // a shard_map: its collectives are recorded
/// std::cerr << meshlib::stop_trace();               // writes step.json; prints the summary
/// @endcode
///
/// File layout (one JSON object): `traceEvents` holds, per device, a `thread_name` metadata record
/// ("device 3 (data=1, model=1)") and a `thread_sort_index`; one complete event (`ph: "X"`) per
/// collective with `args` {axes, dtype, bytes, wait_us, group}; one per region (`cat: "region"`);
/// and flow events (`ph: "s"/"t"/"f"`) that join the devices of each collective at the moment the
/// last of them arrived. `pid` is the process index (one file per process in multi-process runs:
/// `trace.json` becomes `trace.p1.json` for process 1), `tid` the device id; regions run outside
/// any device go to the `host` track.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib/core/deferred.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/runtime/launcher.hpp"

namespace meshlib {

namespace debug::detail {
/// `std::setw` without <iomanip>, which pulls <locale> into every translation unit that includes
/// meshlib (exec installs the tracer, so this header is in the umbrella; docs/benchmarks.md).
struct column_width {
  std::streamsize n;
  friend std::ostream& operator<<(std::ostream& os, column_width w) {
    os.width(w.n);
    return os;
  }
};
}  // namespace debug::detail

/// @brief One row of a `trace_summary`: one collective type over one set of axes on one device.
struct trace_summary_row {
  std::string op;    ///< as the user called it: psum, pmean, all_gather, psum_scatter, ...
  std::string axes;  ///< "model", "data,model"
  /// The device this row counts.
  std::size_t device = 0;
  /// How many calls of the collective this device made.
  std::size_t count = 0;
  std::size_t bytes = 0;  ///< bytes this device contributed (its send buffers)
  double time_s = 0;      ///< time inside the collective, waiting included
  double wait_s = 0;      ///< time spent waiting for the last device of the group to arrive
};

/// @brief What `stop_trace()` returns: per collective type, axes and device, count, bytes, time and
/// wait time; and the slowest device (the one its peers waited for longest). Printable.
struct trace_summary {
  /// One row per collective type, axes and device.
  std::vector<trace_summary_row> rows;
  /// The number of devices traced.
  std::size_t devices = 0;
  /// Seconds from start to stop of the trace.
  double traced_s = 0;
  /// The device the others waited for longest, when any waited at all.
  std::optional<std::size_t> slowest_device;
  /// How long, summed over collectives, the others waited for `slowest_device` after their first arrival.
  double slowest_lateness_s = 0;
  /// The file written (empty when none was).
  std::string path;

  /// Prints the table: one line per row, then the slowest device.
  friend std::ostream& operator<<(std::ostream& os, const trace_summary& s) {
    os.precision(3);
    os << "meshlib trace summary: " << s.devices << " device(s), " << std::fixed
       << s.traced_s * 1e3 << " ms traced" << (s.path.empty() ? "" : ", written to " + s.path) << '\n';
    os << std::left << debug::detail::column_width{14} << "op" << debug::detail::column_width{14} << "axes" << std::right << debug::detail::column_width{7} << "device"
       << debug::detail::column_width{8} << "count" << debug::detail::column_width{12} << "bytes" << debug::detail::column_width{12} << "time ms" << debug::detail::column_width{12}
       << "wait ms" << '\n';
    for (const auto& r : s.rows)
      os << std::left << debug::detail::column_width{14} << r.op << debug::detail::column_width{14} << r.axes << std::right << debug::detail::column_width{7} << r.device
         << debug::detail::column_width{8} << r.count << debug::detail::column_width{12} << r.bytes << debug::detail::column_width{12} << r.time_s * 1e3 << debug::detail::column_width{12}
         << r.wait_s * 1e3 << '\n';
    if (s.slowest_device)
      os << "slowest device: " << *s.slowest_device << " (its peers waited " << s.slowest_lateness_s * 1e3
         << " ms for it in all)\n";
    else
      os << "slowest device: none (no collective waited for a late device)\n";
    os.unsetf(std::ios::floatfield);
    return os;
  }
  /// The table as `operator<<` prints it.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }
};

namespace debug::detail {

/// One recorded event (a collective or a region) on one track.
struct trace_event {
  std::string name;
  std::string axes;   // collectives: the axes, comma separated
  std::string dtype;  // collectives: float32, ...
  std::size_t bytes = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
  bool collective = false;
  // Identifies one collective across its devices: the run, the group (axes and color) and the
  // position of the collective in that group's sequence.
  std::uint64_t run = 0;
  std::uint64_t mask = 0;
  std::size_t color = 0;
  std::uint64_t seq = 0;
  std::string group;  // the group's device ids, "0,1"
};

/// The track of regions that run outside any device (on the host thread).
inline constexpr std::size_t host_track = static_cast<std::size_t>(-1);

/// Process-wide recorder (see the file comment). Appends are per track under the track's own
/// mutex, so device threads do not contend with each other.
///
/// A class template used through one alias (`trace_recorder`), as `std::string` is: its members
/// (maps, sorts, the JSON writer) are then compiled only in a translation unit that traces or runs
/// devices, not in every one that includes meshlib (docs/benchmarks.md, "Include cost"). The same
/// holds for every entry point to it below: none is an ordinary inline function, whose body the
/// compiler would check, with everything it calls, in every translation unit.
template <class Tag = void>
class basic_trace_recorder {
 public:
  struct track {
    std::mutex m;
    std::string name;
    std::vector<trace_event> events;
    std::uint64_t session = 0;  // the last trace session that used it
  };

  static basic_trace_recorder& get() {
    static basic_trace_recorder r;
    return r;
  }

  [[nodiscard]] bool on() const noexcept { return on_.load(std::memory_order_relaxed); }

  [[nodiscard]] std::int64_t now_ns() const noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - origin_).count();
  }

  /// @throws error when `path` (its per-process name) cannot be opened for writing: a trace the
  /// program cannot write is reported now, not after the run at `stop()`.
  void start(std::string path) {
    if (!path.empty()) check_writable(file_for_process(path), "start_trace");
    std::lock_guard lk(m_);
    // Tracks live as long as the program (a running device may hold one): restarting empties them.
    ++session_;
    for (auto& [id, t] : tracks_) {
      std::lock_guard tl(t->m);
      t->events.clear();
    }
    path_ = std::move(path);
    started_ns_ = now_ns();
    on_.store(true, std::memory_order_release);
  }

  /// A fresh id for one shard_map / spmd / reshard run.
  std::uint64_t next_run() noexcept { return runs_.fetch_add(1) + 1; }

  /// The track of `id` (a device id or `host_track`), created on first use.
  track& track_of(std::size_t id) {
    std::lock_guard lk(m_);
    auto& t = tracks_[id];
    if (!t) {
      t = std::make_unique<track>();
      t->name = id == host_track ? "host" : "device " + std::to_string(id);
    }
    t->session = session_;
    return *t;
  }

  void name_track(std::size_t id, std::string name) {
    track& t = track_of(id);
    std::lock_guard lk(t.m);
    t.name = std::move(name);
  }

  void record(track& t, trace_event e) {
    std::lock_guard lk(t.m);
    t.events.push_back(std::move(e));
  }

  /// Stops recording, writes the file (when a path was given) and returns the summary.
  trace_summary stop() {
    std::lock_guard lk(m_);
    on_.store(false, std::memory_order_release);
    // Devices of a run still going may append while this runs: take each track's events under its lock.
    snapshot_.clear();
    for (auto& [id, t] : tracks_) {
      std::lock_guard tl(t->m);
      if (t->session != session_ && t->events.empty()) continue;
      snapshot_.push_back({id, t->name, std::move(t->events)});
      t->events.clear();
    }
    trace_summary s = summarize();
    if (!path_.empty()) {
      s.path = file_for_process(path_);
      write(s.path);
    }
    snapshot_.clear();
    path_.clear();
    return s;
  }

  /// Stops at exit when MESHLIB_TRACE started the trace: writes the file, prints the summary.
  ~basic_trace_recorder() {
    if (from_env_ && on()) {
      try {
        std::cerr << stop();
      } catch (const std::exception& e) {
        std::cerr << e.what() << '\n';
      }
    }
  }

  basic_trace_recorder(const basic_trace_recorder&) = delete;
  basic_trace_recorder& operator=(const basic_trace_recorder&) = delete;

 private:
  // Throws (from `get()`, so from the program's first traced call, and again from every later one)
  // when MESHLIB_TRACE names a file that cannot be written: the user asked for a trace and would
  // otherwise learn only at exit, after the whole run, that there is none.
  basic_trace_recorder() : origin_(std::chrono::steady_clock::now()) {
    const char* env = std::getenv("MESHLIB_TRACE");  // NOLINT(concurrency-mt-unsafe): read once
    if (env != nullptr && *env != '\0') {
      check_writable(file_for_process(env), "MESHLIB_TRACE=" + std::string(env));
      from_env_ = true;
      start(env);
    }
  }

  /// Opens `file` for writing (creating or emptying it; the trace replaces it at stop) and throws
  /// `error` naming `what`, the file and the system's reason when it cannot.
  static void check_writable(const std::string& file, const std::string& what) {
    std::FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr) {
      const int e = errno;
      throw error("meshlib: " + what + ": cannot open '" + file + "' for writing the trace (" + std::strerror(e) +
                  "); give a file in an existing, writable directory");
    }
    std::fclose(f);
  }

  /// `trace.json` for a single-process run; `trace.p<index>.json` for process `index` of several.
  static std::string file_for_process(const std::string& path) {
    std::size_t index = 0, count = 1;
    try {
      const auto l = distributed::detect_launch(distributed::process_env());
      index = l.process_index;
      count = l.process_count;
    } catch (const std::exception&) {
      // An inconsistent launcher environment is reported by distributed::initialize; here one file.
    }
    if (count <= 1) return path;
    const std::size_t dot = path.rfind('.');
    const std::size_t slash = path.rfind('/');
    const std::string suffix = ".p" + std::to_string(index);
    if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + suffix;
    return path.substr(0, dot) + suffix + path.substr(dot);
  }

  static std::size_t process_index() {
    try {
      return distributed::detect_launch(distributed::process_env()).process_index;
    } catch (const std::exception&) {
      return 0;
    }
  }

  using key_t = std::tuple<std::uint64_t, std::uint64_t, std::size_t, std::uint64_t>;
  struct instance {
    std::int64_t first = INT64_MAX, last = INT64_MIN;
    std::vector<std::pair<std::size_t, const trace_event*>> members;  // (track, event)
  };

  std::map<key_t, instance> instances() const {
    std::map<key_t, instance> out;
    for (const auto& t : snapshot_)
      for (const auto& e : t.events) {
        if (!e.collective) continue;
        auto& in = out[key_t{e.run, e.mask, e.color, e.seq}];
        in.first = std::min(in.first, e.start_ns);
        in.last = std::max(in.last, e.start_ns);
        in.members.emplace_back(t.id, &e);
      }
    return out;
  }

  static std::int64_t wait_of(const instance& in, const trace_event& e) {
    return std::clamp<std::int64_t>(in.last - e.start_ns, 0, e.end_ns - e.start_ns);
  }

  trace_summary summarize() const {
    trace_summary s;
    const auto inst = instances();
    experimental::deferred_t<std::map<std::tuple<std::string, std::string, std::size_t>, trace_summary_row>, Tag> rows;
    experimental::deferred_t<std::map<std::size_t, double>, Tag> lateness;
    std::int64_t lo = started_ns_, hi = started_ns_;
    for (const auto& t : snapshot_) {
      if (t.id != host_track) ++s.devices;
      for (const auto& e : t.events) hi = std::max(hi, e.end_ns);
    }
    for (const auto& [key, in] : inst) {
      const trace_event* late = nullptr;
      std::size_t late_dev = 0;
      for (const auto& [dev, e] : in.members) {
        auto& r = rows[{e->name, e->axes, dev}];
        r.op = e->name;
        r.axes = e->axes;
        r.device = dev;
        ++r.count;
        r.bytes += e->bytes;
        r.time_s += static_cast<double>(e->end_ns - e->start_ns) * 1e-9;
        r.wait_s += static_cast<double>(wait_of(in, *e)) * 1e-9;
        if (!late || e->start_ns > late->start_ns) {
          late = e;
          late_dev = dev;
        }
      }
      if (late && in.members.size() > 1 && in.last > in.first)
        lateness[late_dev] += static_cast<double>(in.last - in.first) * 1e-9;
    }
    for (auto& [k, r] : rows) s.rows.push_back(r);
    for (const auto& [dev, l] : lateness)
      if (l > s.slowest_lateness_s) {
        s.slowest_lateness_s = l;
        s.slowest_device = dev;
      }
    s.traced_s = static_cast<double>(hi - lo) * 1e-9;
    return s;
  }

  static void json_string(std::ostream& os, std::string_view s) {
    os << '"';
    for (char c : s) {
      switch (c) {
        case '"': os << "\\\""; break;
        case '\\': os << "\\\\"; break;
        case '\n': os << "\\n"; break;
        case '\t': os << "\\t"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
            os << buf;
          } else {
            os << c;
          }
      }
    }
    os << '"';
  }

  // As std::fixed with precision 3 prints it, whatever the locale (JSON needs the '.').
  static std::string fixed3(double v) {
    char buf[400];  // the longest finite double in fixed notation with 3 decimals fits
    const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 3);
    return std::string(buf, r.ptr);
  }

  // The file is written through <cstdio>: <fstream> would cost every translation unit that includes
  // meshlib its parse time for this one function (docs/benchmarks.md, include cost).
  void write(const std::string& path) const {
    struct file_closer {
      void operator()(std::FILE* p) const noexcept { std::fclose(p); }
    };
    std::unique_ptr<std::FILE, file_closer> file(std::fopen(path.c_str(), "w"));
    if (!file) throw error("meshlib: stop_trace: cannot open '" + path + "' for writing the trace");
    std::ostringstream f;
    const std::size_t pid = process_index();
    // Microseconds with nanosecond digits: the unit of the Chrome trace format.
    auto us = [this](std::int64_t ns) {
      return fixed3(static_cast<double>(ns - started_ns_) * 1e-3);
    };
    auto dur = [](std::int64_t ns) { return fixed3(static_cast<double>(ns) * 1e-3); };
    auto tid = [](std::size_t id) { return id == host_track ? std::string("1000000") : std::to_string(id); };
    const auto inst = instances();
    f << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
    f << R"({"ph":"M","name":"process_name","pid":)" << pid << R"(,"tid":0,"args":{"name":"meshlib process )" << pid
      << "\"}}";
    for (const auto& t : snapshot_) {
      f << ",\n" << R"({"ph":"M","name":"thread_name","pid":)" << pid << ",\"tid\":" << tid(t.id) << ",\"args\":{\"name\":";
      json_string(f, t.name);
      f << "}}";
      f << ",\n" << R"({"ph":"M","name":"thread_sort_index","pid":)" << pid << ",\"tid\":" << tid(t.id)
        << ",\"args\":{\"sort_index\":" << (t.id == host_track ? std::string("-1") : std::to_string(t.id)) << "}}";
    }
    for (const auto& t : snapshot_)
      for (const auto& e : t.events) {
        const std::size_t id = t.id;
        f << ",\n{\"ph\":\"X\",\"name\":";
        json_string(f, e.name);
        f << ",\"cat\":\"" << (e.collective ? "collective" : "region") << "\",\"pid\":" << pid << ",\"tid\":" << tid(id)
          << ",\"ts\":" << us(e.start_ns) << ",\"dur\":" << dur(e.end_ns - e.start_ns);
        if (e.collective) {
          const auto& in = inst.at(key_t{e.run, e.mask, e.color, e.seq});
          f << ",\"args\":{\"axes\":";
          json_string(f, e.axes);
          f << ",\"dtype\":\"" << e.dtype << "\",\"bytes\":" << e.bytes << ",\"wait_us\":" << dur(wait_of(in, e))
            << ",\"group\":\"" << e.group << "\",\"seq\":" << e.seq << "}";
        }
        f << "}";
      }
    // Flow arrows: one chain per collective through its devices in id order, at the moment the
    // last of them arrived (a moment inside every member's slice).
    std::uint64_t flow = 0;
    for (const auto& [key, in] : inst) {
      if (in.members.size() < 2) continue;
      auto members = in.members;
      std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      ++flow;
      for (std::size_t i = 0; i < members.size(); ++i) {
        const auto& [id, e] = members[i];
        const char* ph = i == 0 ? "s" : (i + 1 == members.size() ? "f" : "t");
        const std::int64_t at = std::clamp(in.last, e->start_ns, e->end_ns);
        f << ",\n{\"ph\":\"" << ph << "\",\"name\":";
        json_string(f, e->name);
        f << ",\"cat\":\"collective\",\"id\":" << flow << ",\"pid\":" << pid << ",\"tid\":" << tid(id)
          << ",\"ts\":" << us(at) << (i + 1 == members.size() ? ",\"bp\":\"e\"" : "") << "}";
      }
    }
    f << "\n]}\n";
    const std::string text = std::move(f).str();
    if (std::fwrite(text.data(), 1, text.size(), file.get()) != text.size() || std::fclose(file.release()) != 0)
      throw error("meshlib: stop_trace: writing '" + path + "' failed");
  }

  std::atomic<bool> on_{false};
  std::atomic<std::uint64_t> runs_{0};
  std::mutex m_;
  std::map<std::size_t, std::unique_ptr<track>> tracks_;
  // What stop() took from the tracks (in id order, the host track last): summarised and written.
  struct taken {
    std::size_t id;
    std::string name;
    std::vector<trace_event> events;
  };
  std::vector<taken> snapshot_;
  std::uint64_t session_ = 0;
  std::string path_;
  std::chrono::steady_clock::time_point origin_;
  std::int64_t started_ns_ = 0;
  bool from_env_ = false;
};

/// The recorder (see `basic_trace_recorder`).
using trace_recorder = basic_trace_recorder<>;

}  // namespace debug::detail

/// @brief Starts recording a trace (as `jax.profiler.start_trace`); `stop_trace()` writes it to
/// `path` (Chrome trace event JSON). An empty path records without writing (the summary only).
/// Restarting discards what was recorded. Runs that are already going keep their state: tracing
/// is read when a `shard_map`, `spmd` or `reshard` starts.
/// @throws error when `path` cannot be opened for writing (naming it), before anything is recorded.
template <class Tag = void>
void start_trace(std::string path) {
  debug::detail::basic_trace_recorder<Tag>::get().start(std::move(path));
}

/// @brief Stops the trace, writes the file given to `start_trace` and returns the summary.
/// @throws error when the file cannot be written (naming it).
template <class Tag = void>
trace_summary stop_trace() {
  return debug::detail::basic_trace_recorder<Tag>::get().stop();
}

/// @brief True while a trace is being recorded.
/// @throws error when `MESHLIB_TRACE` names a file that cannot be written (as every traced call
/// does): a program can call it first to report that at start.
template <class Tag = void>
[[nodiscard]] bool tracing() {
  return debug::detail::basic_trace_recorder<Tag>::get().on();
}

/// @brief Traces its scope (as `with jax.profiler.trace(dir):`): starts in the constructor; the
/// destructor writes the file. Call `stop()` to get the summary earlier. Used as `scoped_trace`
/// (a template only so that its code is compiled where it is used: see `basic_trace_recorder`).
template <class Tag = void>
class basic_scoped_trace {
 public:
  /// Starts tracing; the trace file goes to `path` when the scope ends or at `stop()`.
  explicit basic_scoped_trace(std::string path) { start_trace<Tag>(std::move(path)); }
  ~basic_scoped_trace() {
    if (!stopped_) {
      try {
        (void)stop_trace<Tag>();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }
  }
  /// Stops tracing now, writes the file and returns the summary; the destructor then does nothing.
  trace_summary stop() {
    stopped_ = true;
    return stop_trace<Tag>();
  }
  basic_scoped_trace(const basic_scoped_trace&) = delete;
  basic_scoped_trace& operator=(const basic_scoped_trace&) = delete;

 private:
  bool stopped_ = false;
};

/// @brief Traces its scope (see `basic_scoped_trace`).
using scoped_trace = basic_scoped_trace<>;

}  // namespace meshlib
