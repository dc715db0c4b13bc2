// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Every benchmark's command line (issue 39 item 6): options read where they are used and checked in
// one place. A bad option (unknown, without its value, given twice, not a number, zero or out of
// range, a value the benchmark cannot run) ends the program with "<program>: <what is wrong>", the
// usage on stderr and exit status 2: never an exception, never a crash. `--help` prints the usage and
// exits 0.
//
// Standard library only, on purpose: each benchmark parses its options before including meshlib, so
// that bench/CMakeLists.txt can build the parsing part alone (MESHLIB_BENCH_OPTIONS_ONLY, a second
// or two of compiling) and the test command can run it with bad options without building the
// benchmark itself (-O3, minutes).
//
//   bench::command_line cl("train_bench", usage, argc, argv);
//   const std::size_t steps = cl.count("--steps", 10);  // a positive integer
//   const bool overlap = cl.flag("--overlap");
//   cl.done();                                          // anything left is an unknown option
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace bench {

class command_line {
 public:
  /// Reads argv; `--help` or `-h` anywhere prints `usage` and exits 0.
  command_line(const char* program, const char* usage, int argc, char** argv) : program_(program), usage_(usage) {
    for (int i = 1; i < argc; ++i) args_.emplace_back(argv[i]);
    used_.assign(args_.size(), false);
    for (const auto& a : args_)
      if (a == "--help" || a == "-h") {
        std::printf("%s", usage_.c_str());
        std::exit(0);
      }
    // Kokkos' own options (--kokkos-num-threads=2, ...) are Kokkos::initialize's to read.
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (args_[i].rfind("--kokkos-", 0) == 0) used_[i] = true;
  }

  /// Whether the flag `name` (no value) is given.
  bool flag(const char* name) {
    bool seen = false;
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (args_[i] == name) {
        if (seen) fail(std::string(name) + " given twice");
        seen = used_[i] = true;
      }
    return seen;
  }

  /// Whether option `name` is on the command line (with or without a value); consumes nothing.
  [[nodiscard]] bool given(const char* name) const {
    for (const auto& a : args_)
      if (a == name || a.rfind(std::string(name) + "=", 0) == 0) return true;
    return false;
  }

  /// A positive integer (zero is refused: a count of nothing measures nothing).
  std::size_t count(const char* name, std::size_t fallback) {
    return static_cast<std::size_t>(integer(name, static_cast<long long>(fallback), 1, std::numeric_limits<long long>::max()));
  }

  /// An integer in [lo, hi].
  long long integer(const char* name, long long fallback, long long lo, long long hi) {
    const auto v = value(name);
    if (!v) return fallback;
    return integer_of(name, *v, lo, hi);
  }

  /// A number of bytes with an optional K, M or G suffix (or KiB, MiB, GiB: powers of 1024), at least `lo`.
  std::size_t bytes(const char* name, const char* fallback, std::size_t lo = 1) {
    const auto v = value(name);
    return bytes_of(name, v ? *v : std::string(fallback), lo);
  }

  /// A decimal number in [lo, hi].
  double real(const char* name, double fallback, double lo, double hi) {
    const auto v = value(name);
    if (!v) return fallback;
    double x = 0;
    const char* b = v->data();
    const auto [p, ec] = std::from_chars(b, b + v->size(), x);
    if (ec != std::errc() || p != b + v->size() || v->empty()) fail(std::string(name) + " " + *v + ": not a number");
    if (!(x >= lo && x <= hi))
      fail(std::string(name) + " " + *v + ": out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return x;
  }

  /// Any text.
  std::string text(const char* name, const char* fallback) {
    const auto v = value(name);
    return v ? *v : std::string(fallback);
  }

  /// One of `allowed`.
  std::string choice(const char* name, std::initializer_list<const char*> allowed, const char* fallback) {
    const auto v = value(name);
    if (!v) return fallback;
    std::string list;
    for (const char* a : allowed) {
      if (*v == a) return *v;
      list += (list.empty() ? "" : ", ") + std::string(a);
    }
    fail(std::string(name) + " " + *v + ": expected one of " + list);
  }

  /// Every value of a repeatable option, in order.
  std::vector<std::string> every(const char* name) {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (auto v = take(i, name)) out.push_back(*v);
    return out;
  }

  /// The arguments that are not options (do not start with '-'), consumed; at most `max` of them.
  std::vector<std::string> positional(std::size_t max) {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (!used_[i] && !args_[i].empty() && args_[i][0] != '-') {
        if (out.size() == max) fail("unexpected argument " + args_[i]);
        used_[i] = true;
        out.push_back(args_[i]);
      }
    return out;
  }

  /// Refuses whatever no call above consumed: an unknown option (or a stray value).
  void done() const {
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (!used_[i]) fail((args_[i].rfind("-", 0) == 0 ? "unknown option " : "unexpected argument ") + args_[i]);
  }

  /// Ends the program: "<program>: <message>", the usage, exit status 2.
  [[noreturn]] void fail(const std::string& message) const {
    std::fprintf(stderr, "%s: %s\n%s", program_.c_str(), message.c_str(), usage_.c_str());
    std::exit(2);
  }

  /// `s` as an integer in [lo, hi], or fail naming `name`.
  long long integer_of(const std::string& name, const std::string& s, long long lo, long long hi) const {
    long long x = 0;
    const char* b = s.data();
    const auto [p, ec] = std::from_chars(b, b + s.size(), x);
    if (s.empty() || p != b + s.size() || ec == std::errc::invalid_argument) fail(name + " " + s + ": not an integer");
    if (ec == std::errc::result_out_of_range || x < lo || x > hi) {
      if (lo == 1 && x <= 0 && ec != std::errc::result_out_of_range) fail(name + " " + s + ": must be at least 1");
      fail(name + " " + s + ": out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return x;
  }

  /// `s` ("64M", "4096") as bytes, at least `lo`, or fail naming `name`.
  std::size_t bytes_of(const std::string& name, const std::string& s, std::size_t lo) const {
    std::size_t digits = 0;
    while (digits < s.size() && s[digits] >= '0' && s[digits] <= '9') ++digits;
    std::size_t scale = 1;
    const std::string_view suffix = std::string_view(s).substr(digits);
    if (suffix == "K" || suffix == "k" || suffix == "KiB") scale = std::size_t{1} << 10;
    else if (suffix == "M" || suffix == "m" || suffix == "MiB") scale = std::size_t{1} << 20;
    else if (suffix == "G" || suffix == "g" || suffix == "GiB") scale = std::size_t{1} << 30;
    else if (!suffix.empty()) digits = 0;  // refused below
    if (digits == 0) fail(name + " " + s + ": not a size (a whole number of bytes, optionally with K, M or G)");
    const long long n = integer_of(name, s.substr(0, digits), 0, std::numeric_limits<long long>::max());
    const auto v = static_cast<std::size_t>(n);
    if (v > std::numeric_limits<std::size_t>::max() / scale) fail(name + " " + s + ": too large");
    if (v * scale < lo) fail(name + " " + s + ": must be at least " + std::to_string(lo) + " B");
    return v * scale;
  }

  /// "a,b,c" split at commas (every part non-empty), or fail naming `name`.
  std::vector<std::string> list_of(const std::string& name, const std::string& s) const {
    std::vector<std::string> out;
    std::size_t pos = 0;
    while (true) {
      const std::size_t comma = s.find(',', pos);
      out.push_back(s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
      if (out.back().empty()) fail(name + " " + s + ": an empty item in the list");
      if (comma == std::string::npos) return out;
      pos = comma + 1;
    }
  }

  [[nodiscard]] const std::string& program() const noexcept { return program_; }

 private:
  /// The value of option `name` (`--name V` or `--name=V`), consumed; none when absent.
  std::optional<std::string> value(const char* name) {
    std::optional<std::string> out;
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (auto v = take(i, name)) {
        if (out) fail(std::string(name) + " given twice");
        out = std::move(v);
      }
    return out;
  }

  /// The value of option `name` if argument `i` is that option, consumed.
  std::optional<std::string> take(std::size_t i, const char* name) {
    if (used_[i]) return std::nullopt;
    const std::string eq = std::string(name) + "=";
    if (args_[i].rfind(eq, 0) == 0) {
      used_[i] = true;
      return args_[i].substr(eq.size());
    }
    if (args_[i] != name) return std::nullopt;
    if (i + 1 >= args_.size() || args_[i + 1].rfind("--", 0) == 0) fail(std::string(name) + " needs a value");
    used_[i] = used_[i + 1] = true;
    return args_[i + 1];
  }

  std::string program_, usage_;
  std::vector<std::string> args_;
  std::vector<bool> used_;
};

}  // namespace bench
