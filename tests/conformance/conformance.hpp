// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The communicator conformance kit: one suite, templated on the communicator, that every backend
// (thread, MPI, hybrid, and any new one such as NCCL) passes before it lands.
//
// Value rows: every operation x element type x reduce op, out of place and in place, for 0 and 19
// elements per rank (and 3000 for float and int64: the large-payload algorithms), with NaN (on every rank in turn, not only rank 0), +/-Inf and signed
// zeros among the float inputs, on the whole group and on sub-communicators from split. Inputs are
// small integers plus those specials, so the expected result is the same bits in any reduction
// order: every backend must match the independently computed reference exactly (NaN: any NaN).
//
// Fault rows: a body per participant and what every participant must see (error type, the words
// its message must contain, and a loose time bound). A backend runs each row on a fresh group.
//
// Catch2 is not thread-safe: participants record findings; the test checks them on the main thread.
//
// A new backend instantiates it with a few lines (see tests/conformance/test_thread_conformance.cpp):
//   conformance::findings f;  run every participant with  conformance::check_values(comm, f);
//   CHECK(f.failures.empty());  and  for (auto& row : conformance::fault_rows<Comm>()) run it.
// A backend on device memory gives a buffer policy: conformance::check_values<Policy>(comm, f)
// (host_buffers below; tests/conformance/cuda_buffers.hpp for CUDA), and the fault rows take it
// too (mismatch_rows<Comm, Policy>(), throw_rows<Comm, Policy>(bound, "backend")). Where backends'
// messages differ, the rows take the backend's words from one table (words_table).
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../unit/comm/comm_test_support.hpp"
#include "meshlib/comm.hpp"

namespace conformance {

using meshlib::bfloat16;
using meshlib::permute_pair;
using meshlib::reduce_op;

/// What one participant found wrong (thread-safe: participants of a thread group share one).
struct findings {
  std::mutex m;
  std::vector<std::string> failures;
  void fail(const std::string& s) {
    std::lock_guard lk(m);
    if (failures.size() < 50) failures.push_back(s);
  }
};

template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;

template <class T>
constexpr bool is_float = !std::is_integral_v<T>;

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// Input element i of rank r for `op` (n ranks). Floats: every 8th element is NaN on rank
/// (i / 8) % n only; others hold +Inf and -Inf, +0 and -0, or only -0 (see `special`).
template <class T>
T value(int r, int n, std::size_t i, reduce_op op) {
  if constexpr (is_float<T>) {
    const double inf = std::numeric_limits<double>::infinity();
    switch (i % 8) {
      case 0: return from_double<T>(r == static_cast<int>((i / 8) % static_cast<std::size_t>(n)) ? std::nan("") : 1.0 + r);
      case 1: return from_double<T>(r == 0 ? -inf : (r == n - 1 ? inf : 2.0));
      case 2: return from_double<T>(r % 2 ? -0.0 : 0.0);
      case 3: return from_double<T>(-0.0);
      case 4: return from_double<T>(r == n - 1 ? inf : -3.0);
      default: break;
    }
  }
  const long v = op == reduce_op::prod ? static_cast<long>((static_cast<std::size_t>(r) + i) % 5) - 2
                                       : static_cast<long>((static_cast<std::size_t>(r) * 7 + i * 3) % 23) - 11;
  if constexpr (std::is_integral_v<T>) return static_cast<T>(v);
  else return from_double<T>(static_cast<double>(v));
}

/// The documented semantics, written independently of the backends: rank order; integers wrap;
/// floats: IEEE arithmetic, min/max propagate NaN and order -0 < +0; avg = sum / n.
template <class T>
T expected(reduce_op op, int n, std::size_t i) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    U acc = static_cast<U>(value<T>(0, n, i, op));
    for (int r = 1; r < n; ++r) {
      const T x = value<T>(r, n, i, op);
      if (op == reduce_op::sum || op == reduce_op::mean) acc = static_cast<U>(acc + static_cast<U>(x));
      else if (op == reduce_op::prod) acc = static_cast<U>(acc * static_cast<U>(x));
      else if (op == reduce_op::min) acc = x < static_cast<T>(acc) ? static_cast<U>(x) : acc;
      else acc = x > static_cast<T>(acc) ? static_cast<U>(x) : acc;
    }
    if (op == reduce_op::mean) return static_cast<T>(static_cast<T>(acc) / static_cast<T>(n));
    return static_cast<T>(acc);
  } else {
    using A = acc_t<T>;
    if (op == reduce_op::min || op == reduce_op::max) {
      bool nan = false;
      A best{};
      for (int r = 0; r < n; ++r) {
        const A x = static_cast<A>(value<T>(r, n, i, op));
        if (std::isnan(x)) nan = true;
        else if (r == 0 || (op == reduce_op::max ? (x > best || (x == best && !std::signbit(x)))
                                                 : (x < best || (x == best && std::signbit(x)))))
          best = x;
      }
      return from_double<T>(nan ? std::nan("") : static_cast<double>(best));
    }
    A acc = static_cast<A>(value<T>(0, n, i, op));
    for (int r = 1; r < n; ++r) {
      const A x = static_cast<A>(value<T>(r, n, i, op));
      acc = op == reduce_op::prod ? acc * x : acc + x;
    }
    if (op == reduce_op::mean) acc = acc / static_cast<A>(n);
    return static_cast<T>(acc);
  }
}

/// Bitwise equality, any NaN matching any NaN.
template <class T>
bool same(T got, T want) {
  if constexpr (is_float<T>) {
    if (std::isnan(static_cast<double>(static_cast<acc_t<T>>(want))))
      return std::isnan(static_cast<double>(static_cast<acc_t<T>>(got)));
  }
  return std::memcmp(&got, &want, sizeof(T)) == 0;
}

template <class T>
std::string show(T x) {
  std::ostringstream os;
  if constexpr (std::is_integral_v<T>) os << static_cast<long long>(x);
  else os << static_cast<double>(static_cast<acc_t<T>>(x)) << (std::signbit(static_cast<double>(static_cast<acc_t<T>>(x))) && static_cast<double>(static_cast<acc_t<T>>(x)) == 0 ? " (-0)" : "");
  return os.str();
}

template <class T>
void expect_range(findings& f, const std::string& what, const std::vector<T>& got, std::size_t at,
                  const std::vector<T>& want) {
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!same(got[at + i], want[i])) {
      f.fail(what + ": element " + std::to_string(at + i) + " is " + show(got[at + i]) + ", expected " + show(want[i]));
      return;
    }
}

/// @brief Where the value rows keep their buffers: host memory, for host backends (the default).
/// A buffer policy gives `make(comm, values)` (a buffer holding `values`, usable by `comm`), and
/// buffers with `span()`, `cspan()` (what the calls get) and `get()` (the contents now, as a
/// vector, after every call made so far on the buffer's communicator; requests may be dropped
/// without wait(), so a device policy synchronises the stream there). It also says how send/recv
/// behave: `buffered_sends` (a send returns before its receive is posted; otherwise the ring is
/// ordered even ranks send first, odd ranks receive first, and one rank has no one to send to)
/// and the `tag` to use. tests/conformance/cuda_buffers.hpp is the device policy.
struct host_buffers {
  template <class T>
  struct buffer {
    std::vector<T> v;
    std::span<T> span() { return std::span<T>(v); }
    std::span<const T> cspan() const { return std::span<const T>(v); }
    std::vector<T> get() const { return v; }
  };
  template <class T, class Comm>
  static buffer<T> make(Comm&, std::vector<T> values) {
    return buffer<T>{std::move(values)};
  }
  static constexpr bool buffered_sends = true;
  static constexpr int tag = 5;
};

/// Every operation of the concept on `c` for element type T and `count` elements per rank, with
/// the buffers of policy `Buffers`.
template <class T, class Buffers = host_buffers, class Comm>
void check_type(Comm& c, findings& f, std::size_t count, const std::string& where) {
  const int n = c.size();
  const int me = c.rank();
  const auto un = static_cast<std::size_t>(n);
  const auto ume = static_cast<std::size_t>(me);
  const std::string tag = where + " " + std::string(meshlib::to_string(meshlib::datatype_of<T>)) + " count " +
                          std::to_string(count) + " rank " + std::to_string(me) + ": ";
  auto buf = [&](std::vector<T> values) { return Buffers::make(c, std::move(values)); };
  auto mine = [&](reduce_op op, std::size_t len, std::size_t offset = 0) {
    std::vector<T> v(len);
    for (std::size_t i = 0; i < len; ++i) v[i] = value<T>(me, n, offset + i, op);
    return v;
  };
  auto reference = [&](reduce_op op, std::size_t len, std::size_t offset = 0) {
    std::vector<T> v(len);
    for (std::size_t i = 0; i < len; ++i) v[i] = expected<T>(op, n, offset + i);
    return v;
  };
  const T fill = from_double<T>(7);
  for (reduce_op op : meshlib::all_reduce_ops) {
    const std::string o = tag + std::string(meshlib::to_string(op)) + " ";
    const auto want = reference(op, count);
    {
      auto s = buf(mine(op, count));
      auto r = buf(std::vector<T>(count + 1, fill));  // a longer receive buffer: the rest is untouched
      c.all_reduce(s.cspan(), r.span(), op).wait();
      const auto got = r.get();
      expect_range(f, o + "all_reduce", got, 0, want);
      expect_range(f, o + "all_reduce (tail untouched)", got, count, std::vector<T>{fill});
      c.all_reduce(s.span(), op);
      expect_range(f, o + "all_reduce in place", s.get(), 0, want);
    }
    {
      const int root = n - 1;
      auto s = buf(mine(op, count));
      auto r = buf(std::vector<T>(count, fill));
      c.reduce(s.cspan(), r.span(), op, root);
      expect_range(f, o + "reduce", r.get(), 0, me == root ? want : std::vector<T>(count, fill));
      c.reduce(s.span(), op, root);
      expect_range(f, o + "reduce in place", s.get(), 0, me == root ? want : mine(op, count));
    }
    {
      const auto before = mine(op, count * un);
      auto s = buf(before);
      const auto w = reference(op, count, ume * count);
      auto r = buf(std::vector<T>(count, fill));
      c.reduce_scatter(s.cspan(), r.span(), op);
      expect_range(f, o + "reduce_scatter", r.get(), 0, w);
      c.reduce_scatter(s.span(), op);
      const auto got = s.get();
      expect_range(f, o + "reduce_scatter in place", got, ume * count, w);
      for (std::size_t b = 0; b < un; ++b)
        if (b != ume)
          expect_range(f, o + "reduce_scatter in place (other blocks untouched)", got, b * count,
                       std::vector<T>(before.begin() + static_cast<std::ptrdiff_t>(b * count),
                                      before.begin() + static_cast<std::ptrdiff_t>((b + 1) * count)));
    }
  }
  const reduce_op any = reduce_op::sum;
  auto of = [&](int r, std::size_t len, std::size_t offset = 0) {
    std::vector<T> v(len);
    for (std::size_t i = 0; i < len; ++i) v[i] = value<T>(r, n, offset + i, any);
    return v;
  };
  {
    const int root = n - 1;
    auto s = buf(of(me, count));
    auto r = buf(std::vector<T>(count, fill));
    c.broadcast(s.cspan(), r.span(), root);
    expect_range(f, tag + "broadcast", r.get(), 0, of(root, count));
    c.broadcast(s.span(), 0);
    expect_range(f, tag + "broadcast in place", s.get(), 0, of(0, count));
  }
  {
    std::vector<T> all;
    for (int r = 0; r < n; ++r) {
      auto v = of(r, count);
      all.insert(all.end(), v.begin(), v.end());
    }
    const auto m = of(me, count);
    auto s = buf(m);
    auto r = buf(std::vector<T>(count * un, fill));
    c.all_gather(s.cspan(), r.span());
    expect_range(f, tag + "all_gather", r.get(), 0, all);
    std::vector<T> in_place(count * un, fill);
    std::copy(m.begin(), m.end(), in_place.begin() + static_cast<std::ptrdiff_t>(ume * count));
    auto b = buf(std::move(in_place));
    c.all_gather(b.span());
    expect_range(f, tag + "all_gather in place", b.get(), 0, all);
  }
  {
    // Block j of rank r's send is of(r, count, j * count); rank me receives block me of every rank.
    std::vector<T> want;
    for (int r = 0; r < n; ++r) {
      auto v = of(r, count, ume * count);
      want.insert(want.end(), v.begin(), v.end());
    }
    auto s = buf(of(me, count * un));
    auto r = buf(std::vector<T>(count * un, fill));
    c.all_to_all(s.cspan(), r.span());
    expect_range(f, tag + "all_to_all", r.get(), 0, want);
    c.all_to_all(s.span());
    expect_range(f, tag + "all_to_all in place", s.get(), 0, want);
  }
  {
    // all_to_all_v: rank me sends (j + 1) * count elements... scaled down: min(count, j + me) elements to rank j.
    auto cnt = [&](int from, int to) { return static_cast<std::int64_t>(std::min<std::size_t>(count, static_cast<std::size_t>(from + to))); };
    std::vector<std::int64_t> sc(un), sd(un), rc(un), rd(un);
    std::int64_t so = 0, ro = 0;
    for (int j = 0; j < n; ++j) {
      sc[static_cast<std::size_t>(j)] = cnt(me, j);
      sd[static_cast<std::size_t>(j)] = so;
      so += cnt(me, j);
      rc[static_cast<std::size_t>(j)] = cnt(j, me);
      rd[static_cast<std::size_t>(j)] = ro;
      ro += cnt(j, me);
    }
    auto s = buf(of(me, static_cast<std::size_t>(so)));
    auto r = buf(std::vector<T>(static_cast<std::size_t>(ro), fill));
    std::vector<T> want;
    for (int j = 0; j < n; ++j) {
      std::int64_t off = 0;  // where rank j's block for me starts in its send buffer
      for (int k = 0; k < me; ++k) off += cnt(j, k);
      auto v = of(j, static_cast<std::size_t>(cnt(j, me)), static_cast<std::size_t>(off));
      want.insert(want.end(), v.begin(), v.end());
    }
    c.all_to_all_v(s.cspan(), sc, sd, r.span(), rc, rd);
    expect_range(f, tag + "all_to_all_v", r.get(), 0, want);
  }
  {
    // A ring shift, with the last rank receiving nothing (zeros) when n > 1.
    std::vector<permute_pair> pairs;
    for (int r = 0; r + 1 < n; ++r) pairs.push_back({r, r + 1});
    auto s = buf(of(me, count));
    auto r = buf(std::vector<T>(count, fill));
    const auto want = me == 0 ? std::vector<T>(count, T{}) : of(me - 1, count);
    c.ppermute(s.cspan(), r.span(), std::span<const permute_pair>(pairs));
    expect_range(f, tag + "ppermute", r.get(), 0, want);
    c.ppermute(s.span(), std::span<const permute_pair>(pairs));
    expect_range(f, tag + "ppermute in place", s.get(), 0, want);
  }
  if (Buffers::buffered_sends || n > 1) {
    // send / recv around the ring: buffered sends go first everywhere; unbuffered ones (NCCL's
    // complete only when the peer receives) on even ranks, while odd ranks receive first.
    auto s = buf(of(me, count));
    auto r = buf(std::vector<T>(count, fill));
    const bool send_first = Buffers::buffered_sends || me % 2 == 0;
    if (send_first) c.send(s.cspan(), (me + 1) % n, Buffers::tag);
    c.recv(r.span(), (me + n - 1) % n, Buffers::tag);
    if (!send_first) c.send(s.cspan(), (me + 1) % n, Buffers::tag);
    expect_range(f, tag + "send/recv", r.get(), 0, of((me + n - 1) % n, count));
  }
  c.barrier().wait();
}

/// Every value row on `c` (and on the two halves of a split), for every element type, with the
/// buffers of policy `Buffers`.
template <class Buffers = host_buffers, class Comm>
void check_values(Comm& c, findings& f, const std::vector<std::size_t>& counts = {0, 19, 3000}) {
  for (std::size_t count : counts) {
    check_type<float, Buffers>(c, f, count, "group");
    check_type<std::int64_t, Buffers>(c, f, count, "group");
    if (count > 64) continue;  // large payloads (other algorithms) for two types keep CI cheap
    check_type<double, Buffers>(c, f, count, "group");
    check_type<bfloat16, Buffers>(c, f, count, "group");
    check_type<std::int32_t, Buffers>(c, f, count, "group");
  }
  // Sub-communicators: odd and even ranks, reversed order by key.
  Comm half = c.split(c.rank() % 2, -c.rank());
  const int expect_size = (c.size() + (c.rank() % 2 ? 0 : 1)) / 2;
  if (half.size() != expect_size)
    f.fail("split: rank " + std::to_string(c.rank()) + " is in a group of " + std::to_string(half.size()) +
           ", expected " + std::to_string(expect_size));
  const int expect_rank = (c.size() - 1 - c.rank()) / 2;
  if (half.rank() != expect_rank)
    f.fail("split: rank " + std::to_string(c.rank()) + " has sub-rank " + std::to_string(half.rank()) + ", expected " +
           std::to_string(expect_rank));
  check_type<float, Buffers>(half, f, 19, "split");
  check_type<std::int64_t, Buffers>(half, f, 19, "split");
}

// ---- fault rows ----------------------------------------------------------------------------------

/// What one participant saw in a fault row: error type ("aborted", "timeout", "mismatch",
/// "argument", "other", "" for none), message and seconds (the comm tests' own record).
using outcome = comm_test::caught;
using comm_test::classify;

/// A fault row: `body` runs on every participant of a fresh group; `check(rank, n, outcome)` says
/// what is wrong with what that participant saw ("" when it is right).
template <class Comm>
struct fault_row {
  std::string name;
  std::function<void(Comm&)> body;
  std::function<std::string(int, int, const outcome&)> check;
};

inline bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// How soon a failure that needs no timeout (a mismatch, an invalid argument, a peer's throw or
/// departure) must reach every participant, against the group timeout `fault_timeout_s` the rows
/// run with (issue 40: no verdict may depend on timing). Such a release takes milliseconds; the
/// exception's type and message (which only the failure itself can carry) are the verdict, and the
/// bound a backstop that tells a release by the failure from one by the timeout with seconds of
/// room for a loaded machine (2 shared cores, parallel tests, MPI ranks that poll).
inline constexpr double prompt_s = 10.0;
inline constexpr double fault_timeout_s = 20.0;

/// @brief The words a backend's messages use where backends differ, one row per backend: how they
/// name a participant that threw, left or never came. The fault rows are written once and take a
/// backend's words from here (issue 40), never from a copy of the rows.
struct backend_words {
  std::string_view backend;      ///< as the tests name it
  std::string_view participant;  ///< "<participant> <r>" names participant r
};
inline constexpr backend_words words_table[] = {
    {"thread", "rank"},
    {"MPI", "MPI rank"},
    {"hybrid", "hybrid device"},
    // The devices meet on a thread_communicator, whose rank r is device r; the message begins
    // "<the call> on shared-GPU device <r> of <n> (GPU <g>)" and says so.
    {"shared-GPU", "rank"},
};

/// How `backend`'s messages name participant r ("rank 1", "hybrid device 1").
inline std::function<std::string(int)> participant_label(std::string_view backend) {
  for (const auto& w : words_table)
    if (w.backend == backend) return [noun = std::string(w.participant)](int r) { return noun + " " + std::to_string(r); };
  throw std::logic_error("conformance: no words for backend '" + std::string(backend) + "'; add its row to words_table");
}

/// "" when `o` is of `type`, contains every word of `words` and came within `max_s` seconds.
inline std::string want(const outcome& o, const std::string& type, std::vector<std::string> words, double max_s) {
  if (o.type != type) return "got '" + o.type + "' (" + o.what + "), expected '" + type + "'";
  for (const auto& w : words)
    if (!has(o.what, w)) return "message '" + o.what + "' does not name '" + w + "'";
  if (o.seconds > max_s) return "took " + std::to_string(o.seconds) + " s, more than " + std::to_string(max_s) + " s";
  return {};
}

/// An argument error: comm_argument_error naming `words`. A backend that fails the group at the
/// first invalid argument (thread) may give a participant that checks later comm_aborted naming it.
inline std::string want_argument(const outcome& o, std::vector<std::string> words, double max_s) {
  if (o.type == "aborted" && has(o.what, "invalid argument")) return {};
  return want(o, "argument", std::move(words), max_s);
}

/// The mismatch rows: every participant must get collective_mismatch naming both calls, quickly.
/// The expected words are the one text every backend gives a call (meshlib/comm/detail/
/// call_text.hpp); the buffers are the policy's (device memory for the device backends).
template <class Comm, class Buffers = host_buffers>
std::vector<fault_row<Comm>> mismatch_rows() {
  std::vector<fault_row<Comm>> rows;
  rows.push_back({"count mismatch (4 vs 8 floats)",
                  [](Comm& c) {
                    auto x = Buffers::make(c, std::vector<float>(c.rank() == 0 ? 4 : 8, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"count 4", "count 8"}, prompt_s); }});
  rows.push_back({"op mismatch (sum vs max)",
                  [](Comm& c) {
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), c.rank() == 0 ? reduce_op::sum : reduce_op::max);
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"op sum", "op max"}, prompt_s); }});
  rows.push_back({"dtype mismatch (float32 vs float64)",
                  [](Comm& c) {
                    if (c.rank() == 0) {
                      auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                      c.all_reduce(x.span(), reduce_op::sum);
                    } else {
                      auto x = Buffers::make(c, std::vector<double>(4, 1.0));
                      c.all_reduce(x.span(), reduce_op::sum);
                    }
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"float32", "float64"}, prompt_s); }});
  rows.push_back({"root mismatch (broadcast from 0 vs 1)",
                  [](Comm& c) {
                    auto x = Buffers::make(c, std::vector<int>(4, c.rank()));
                    c.broadcast(x.span(), c.rank() == 0 ? 0 : 1);
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"root 0", "root 1"}, prompt_s); }});
  rows.push_back({"order mismatch (all_reduce then broadcast vs the reverse)",
                  [](Comm& c) {
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    if (c.rank() == 0) {
                      c.all_reduce(x.span(), reduce_op::sum);
                      c.broadcast(x.span(), 0);
                    } else {
                      c.broadcast(x.span(), 0);
                      c.all_reduce(x.span(), reduce_op::sum);
                    }
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"all_reduce(", "broadcast("}, prompt_s); }});
  // Participant 0 passes the pairs of a ring shift, every other participant the same shift
  // without its last pair (the last participant sends to none): the same operation with other
  // arguments, and every participant must fail.
  rows.push_back({"ppermute pairs that disagree (a ring shift vs the shift without its last pair)",
                  [](Comm& c) {
                    const int n = c.size();
                    std::vector<permute_pair> pairs;
                    for (int r = 0; r < (c.rank() == 0 ? n : n - 1); ++r) pairs.push_back({r, (r + 1) % n});
                    auto s = Buffers::make(c, std::vector<float>(4, 1.0f));
                    auto r = Buffers::make(c, std::vector<float>(4, 0.0f));
                    c.ppermute(s.cspan(), r.span(), std::span<const permute_pair>(pairs));
                  },
                  [](int, int, const outcome& o) { return want(o, "mismatch", {"ppermute"}, prompt_s); }});
  // One element to every peer, but participant 1 expects two from participant 0: every
  // participant fails, none returns as if the call had worked; participant 1, which holds the
  // disagreeing count, names the pair on every backend (the others may name it too, or only say
  // that participant 1 saw it).
  rows.push_back({"all_to_all_v counts that disagree (1 expects 2 elements from 0, which sends 1)",
                  [](Comm& c) {
                    const auto n = static_cast<std::size_t>(c.size());
                    std::vector<std::int64_t> sc(n, 1), sd(n), rc(n, 1), rd(n);
                    if (c.rank() == 1) rc[0] = 2;
                    std::int64_t at = 0;
                    for (std::size_t j = 0; j < n; ++j) {
                      sd[j] = static_cast<std::int64_t>(j);
                      rd[j] = at;
                      at += rc[j];
                    }
                    auto s = Buffers::make(c, std::vector<float>(n, 1.0f));
                    auto r = Buffers::make(c, std::vector<float>(static_cast<std::size_t>(at), 0.0f));
                    c.all_to_all_v(s.cspan(), sc, sd, r.span(), rc, rd);
                  },
                  [](int rank, int, const outcome& o) {
                    if (rank != 1) return want(o, "mismatch", {"all_to_all_v"}, prompt_s);
                    return want(o, "mismatch", {"all_to_all_v", "0 sends 1 elements to ", "1, which expects 2"}, prompt_s);
                  }});
  return rows;
}

/// Argument errors that every participant detects on its own (same arguments everywhere): every
/// participant gets comm_argument_error naming what was wrong, before any data moves.
template <class Comm>
std::vector<fault_row<Comm>> argument_rows() {
  std::vector<fault_row<Comm>> rows;
  rows.push_back({"aliasing: overlapping send and receive buffers",
                  [](Comm& c) {
                    std::vector<float> x(8, 1.0f);
                    c.all_reduce(std::span<const float>(x.data(), 4), std::span<float>(x.data() + 2, 4), reduce_op::sum);
                  },
                  [](int, int, const outcome& o) { return want_argument(o, {"overlap", "all_reduce"}, prompt_s); }});
  rows.push_back({"receive buffer too short",
                  [](Comm& c) {
                    std::vector<float> s(4, 1.0f), r(2);
                    c.all_reduce(std::span<const float>(s), std::span(r), reduce_op::sum);
                  },
                  [](int, int, const outcome& o) { return want_argument(o, {"receive buffer holds 2"}, prompt_s); }});
  rows.push_back({"root out of range",
                  [](Comm& c) {
                    std::vector<float> x(4, 1.0f);
                    c.broadcast(std::span(x), c.size());
                  },
                  [](int, int, const outcome& o) { return want_argument(o, {"root", "out of range"}, prompt_s); }});
  rows.push_back({"all_to_all_v: count + displacement overflows int64",
                  [](Comm& c) {
                    const auto n = static_cast<std::size_t>(c.size());
                    std::vector<std::int64_t> sc(n, 0), sd(n, 0), rc(n, 0), rd(n, 0);
                    sc[0] = 2;
                    sd[0] = std::numeric_limits<std::int64_t>::max();
                    std::vector<float> s(4), r(4);
                    c.all_to_all_v(std::span<const float>(s), sc, sd, std::span(r), rc, rd);
                  },
                  [](int, int, const outcome& o) { return want_argument(o, {"overflows"}, prompt_s); }});
  return rows;
}

/// A slow participant (0.1 s late: enough to be last) succeeds. Run with `fault_timeout_s`, so that
/// a loaded machine that delays a participant by seconds cannot turn the success into a timeout.
template <class Comm, class Buffers = host_buffers>
std::vector<fault_row<Comm>> slow_rows() {
  std::vector<fault_row<Comm>> rows;
  rows.push_back({"slow participant (well within the timeout) succeeds",
                  [](Comm& c) {
                    if (c.rank() == c.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                    if (x.get()[0] != static_cast<float>(c.size())) throw std::runtime_error("wrong sum after a slow rank");
                  },
                  [](int, int, const outcome& o) { return o.type.empty() ? std::string() : "got " + o.type + ": " + o.what; }});
  return rows;
}

/// The timing rows that need no cross-process release: a participant that never arrives makes every
/// other one time out, naming it. `timeout_s` is the group's timeout (short: 1 s keeps CI cheap).
/// The missing participant keeps its handle for 4 timeouts, then leaves (which would release the
/// others as "aborted", not "timeout"): the others' verdict is the type and the message, and a
/// loaded machine has 3 timeouts of room to start their wait.
template <class Comm, class Buffers = host_buffers>
std::vector<fault_row<Comm>> timing_rows(double timeout_s) {
  std::vector<fault_row<Comm>> rows;
  rows.push_back({"missing participant: the others time out naming it",
                  [timeout_s](Comm& c) {
                    // The last participant stays in the group (its handle alive) but never calls.
                    if (c.rank() == c.size() - 1) {
                      std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s * 4));
                      return;
                    }
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                  },
                  [timeout_s](int r, int n, const outcome& o) {
                    if (r == n - 1) return o.type.empty() || o.type == "timeout" || o.type == "aborted"
                                               ? std::string()
                                               : "the missing rank got " + o.type;
                    return want(o, "timeout", {"all_reduce", std::to_string(n - 1)}, timeout_s * 4 + prompt_s);
                  }});
  return rows;
}

/// The throw rows: a participant throws (before its first call, or between two collectives, or two
/// at once); every other participant must be released well before the timeout (`bound_s`) with
/// `comm_aborted` naming the participant (its rank in the group) and its message; a failed group
/// stays failed (sticky). `backend` picks the words of its messages (`words_table`).
template <class Comm, class Buffers = host_buffers>
std::vector<fault_row<Comm>> throw_rows(double bound_s, std::string_view backend) {
  const auto label = participant_label(backend);
  std::vector<fault_row<Comm>> rows;
  auto thrower_ok = [](const outcome& o, const std::string& msg) {
    return o.type == "other" && has(o.what, msg) ? std::string() : "the thrower saw " + o.type + ": " + o.what;
  };
  rows.push_back({"throw before the first call",
                  [](Comm& c) {
                    if (c.rank() == 1) throw std::runtime_error("device gives up early");
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                  },
                  [=](int r, int, const outcome& o) {
                    if (r == 1) return thrower_ok(o, "device gives up early");
                    return want(o, "aborted", {label(1), "device gives up early"}, bound_s);
                  }});
  rows.push_back({"throw mid-collective sequence (after one all_reduce, before the next)",
                  [](Comm& c) {
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                    if (c.rank() == c.size() - 1) throw std::runtime_error("boom in the middle");
                    c.all_reduce(x.span(), reduce_op::max);
                  },
                  [=](int r, int n, const outcome& o) {
                    if (r == n - 1) return thrower_ok(o, "boom in the middle");
                    return want(o, "aborted", {label(n - 1), "boom in the middle"}, bound_s);
                  }});
  rows.push_back({"sticky: a failed group refuses every later call with the root cause",
                  [](Comm& c) {
                    if (c.rank() == 0) throw std::runtime_error("first failure");
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    try {
                      c.all_reduce(x.span(), reduce_op::sum);
                    } catch (const meshlib::comm_aborted&) {
                    }
                    c.barrier();  // must be refused
                  },
                  [=](int r, int, const outcome& o) {
                    if (r == 0) return thrower_ok(o, "first failure");
                    return want(o, "aborted", {label(0), "first failure", "barrier"}, bound_s);
                  }});
  rows.push_back({"two participants throw at once: everyone sees one root cause",
                  [](Comm& c) {
                    if (c.rank() == 0 || c.rank() == 1) throw std::runtime_error("simultaneous " + std::to_string(c.rank()));
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                  },
                  [=](int r, int, const outcome& o) {
                    if (r <= 1) return thrower_ok(o, "simultaneous " + std::to_string(r));
                    if (!has(o.what, "simultaneous 0") && !has(o.what, "simultaneous 1"))
                      return "message '" + o.what + "' names neither thrower";
                    return want(o, "aborted", {}, bound_s);
                  }});
  return rows;
}

/// Destruction while blocked: a participant's handle is destroyed (moved out and dropped) while its
/// peers wait for it in a collective; they must be released with comm_aborted naming it, not at
/// the timeout. For backends whose handles are per participant (thread, hybrid within a process).
template <class Comm, class Buffers = host_buffers>
std::vector<fault_row<Comm>> departure_rows(double bound_s, std::string_view backend) {
  const auto label = participant_label(backend);
  std::vector<fault_row<Comm>> rows;
  rows.push_back({"destruction while blocked: a handle dropped while its peers wait for it",
                  [](Comm& c) {
                    if (c.rank() == 1) {
                      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the peers block first
                      Comm gone = std::move(c);
                      return;
                    }
                    auto x = Buffers::make(c, std::vector<float>(4, 1.0f));
                    c.all_reduce(x.span(), reduce_op::sum);
                  },
                  [=](int r, int, const outcome& o) {
                    if (r == 1) return o.type.empty() ? std::string() : "the departing rank got " + o.type;
                    return want(o, "aborted", {label(1), "left the communicator"}, bound_s);
                  }});
  return rows;
}

}  // namespace conformance
