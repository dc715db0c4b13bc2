// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The MPI communicator under mpirun (2 and 4 ranks): every operation of the communicator concept,
// out-of-place and in-place, for every element type and reduce op, checked twice:
// - against expectations computed here from the inputs, and
// - against the thread backend run in-process with as many threads as there are ranks: the same
//   program on both backends must give the same bits (inputs are small integers, exact in every
//   type, so float sums are exact whatever the order and bitwise equality holds for floats too;
//   a random-float case checks the documented tolerance).
#include <meshlib/mpi.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using meshlib::bfloat16;
using meshlib::mpi_communicator;
using meshlib::permute_pair;
using meshlib::reduce_op;

namespace {

mpi_communicator& world() {
  static mpi_communicator w(MPI_COMM_WORLD);
  return w;
}

/// Small integer inputs, different on every rank and element, exact in every element type.
/// Products stay small: values in {-2..2} for prod.
template <class T>
T input(int rank, std::size_t i, reduce_op op = reduce_op::sum) {
  const long v = op == reduce_op::prod ? static_cast<long>((rank + i) % 5) - 2
                                       : static_cast<long>((rank * 7 + i * 3) % 23) - 11;
  if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(static_cast<float>(v));
  else return static_cast<T>(v);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<std::conditional_t<std::is_same_v<T, bfloat16>, float, T>>(x));
}

/// Runs `op(comm)` on the MPI world and on a thread world of the same size; returns
/// {this rank's MPI result, the same rank's thread result}.
template <class T, class Op>
std::pair<std::vector<T>, std::vector<T>> on_both(Op op) {
  auto& w = world();
  std::vector<T> got = op(w);
  std::vector<T> expected;
  meshlib::run_on_threads(w.size(), [&](meshlib::thread_communicator& c) {
    auto r = op(c);
    if (c.rank() == w.rank()) expected = std::move(r);
  });
  return {std::move(got), std::move(expected)};
}

/// Expected element-wise reduction over ranks of input<T>(r, i, op), combined in rank order in the
/// accumulator type, as the communicator contract says.
template <class T>
T expected_reduce(reduce_op op, int n, std::size_t i) {
  using A = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;
  A acc = static_cast<A>(input<T>(0, i, op));
  for (int r = 1; r < n; ++r) {
    const A x = static_cast<A>(input<T>(r, i, op));
    switch (op) {
      case reduce_op::sum:
      case reduce_op::mean: acc = static_cast<A>(acc + x); break;
      case reduce_op::prod: acc = static_cast<A>(acc * x); break;
      case reduce_op::min: acc = x < acc ? x : acc; break;
      case reduce_op::max: acc = acc < x ? x : acc; break;
    }
  }
  if (op == reduce_op::mean) acc = static_cast<A>(acc / static_cast<A>(n));
  return static_cast<T>(acc);
}

template <class T>
void check_reductions(std::size_t count) {
  const int n = world().size();
  const int me = world().rank();
  for (reduce_op op : meshlib::all_reduce_ops) {
    INFO("type " << meshlib::datatype_of<T> << ", op " << op << ", count " << count);
    std::vector<T> expected(count);
    for (std::size_t i = 0; i < count; ++i) expected[i] = expected_reduce<T>(op, n, i);

    // all_reduce, out of place and in place.
    auto [a, ta] = on_both<T>([&](auto& c) {
      std::vector<T> s(count), r(count);
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i, op);
      c.all_reduce(std::span<const T>(s), std::span(r), op).wait();
      return r;
    });
    CHECK(same_bits(a, expected));
    CHECK(same_bits(a, ta));
    auto [b, tb] = on_both<T>([&](auto& c) {
      std::vector<T> s(count);
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i, op);
      c.all_reduce(std::span(s), op);
      return s;
    });
    CHECK(same_bits(b, expected));
    CHECK(same_bits(b, tb));

    // reduce to the last rank, out of place and in place; other ranks' buffers are untouched.
    const int root = n - 1;
    auto [c1, tc1] = on_both<T>([&](auto& c) {
      std::vector<T> s(count), r(count, T(7));
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i, op);
      c.reduce(std::span<const T>(s), std::span(r), op, root);
      return r;
    });
    CHECK(same_bits(c1, me == root ? expected : std::vector<T>(count, T(7))));
    CHECK(same_bits(c1, tc1));
    auto [c2, tc2] = on_both<T>([&](auto& c) {
      std::vector<T> s(count);
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i, op);
      c.reduce(std::span(s), op, root);
      return s;
    });
    if (me == root) CHECK(same_bits(c2, expected));
    CHECK(same_bits(c2, tc2));

    // reduce_scatter: send of n*count, block rank() of the reduction; in place at block rank().
    auto [d1, td1] = on_both<T>([&](auto& c) {
      std::vector<T> s(count * static_cast<std::size_t>(n)), r(count);
      for (std::size_t i = 0; i < s.size(); ++i) s[i] = input<T>(c.rank(), i, op);
      c.reduce_scatter(std::span<const T>(s), std::span(r), op);
      return r;
    });
    std::vector<T> block(count);
    for (std::size_t i = 0; i < count; ++i) block[i] = expected_reduce<T>(op, n, static_cast<std::size_t>(me) * count + i);
    CHECK(same_bits(d1, block));
    CHECK(same_bits(d1, td1));
    auto [d2, td2] = on_both<T>([&](auto& c) {
      std::vector<T> s(count * static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < s.size(); ++i) s[i] = input<T>(c.rank(), i, op);
      c.reduce_scatter(std::span(s), op);
      return s;
    });
    CHECK(same_bits(std::vector<T>(d2.begin() + static_cast<long>(me * count), d2.begin() + static_cast<long>((me + 1) * count)), block));
    CHECK(same_bits(d2, td2));  // the other blocks are left as they were, as on threads
  }
}

template <class T>
void check_movement(std::size_t count) {
  const int n = world().size();
  const int me = world().rank();
  const auto un = static_cast<std::size_t>(n);
  INFO("type " << meshlib::datatype_of<T> << ", count " << count);

  // broadcast from every root, out of place and in place.
  for (int root = 0; root < n; ++root) {
    auto [a, ta] = on_both<T>([&](auto& c) {
      std::vector<T> s(count), r(count, T(3));
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i);
      c.broadcast(std::span<const T>(s), std::span(r), root);
      return r;
    });
    std::vector<T> expected(count);
    for (std::size_t i = 0; i < count; ++i) expected[i] = input<T>(root, i);
    CHECK(same_bits(a, expected));
    CHECK(same_bits(a, ta));
    auto [b, tb] = on_both<T>([&](auto& c) {
      std::vector<T> s(count);
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i);
      c.broadcast(std::span(s), root);
      return s;
    });
    CHECK(same_bits(b, expected));
    CHECK(same_bits(b, tb));
  }

  // all_gather.
  std::vector<T> gathered(count * un);
  for (std::size_t r = 0; r < un; ++r)
    for (std::size_t i = 0; i < count; ++i) gathered[r * count + i] = input<T>(static_cast<int>(r), i);
  auto [g1, tg1] = on_both<T>([&](auto& c) {
    std::vector<T> s(count), r(count * un);
    for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i);
    c.all_gather(std::span<const T>(s), std::span(r));
    return r;
  });
  CHECK(same_bits(g1, gathered));
  CHECK(same_bits(g1, tg1));
  auto [g2, tg2] = on_both<T>([&](auto& c) {
    std::vector<T> b(count * un, T(0));
    for (std::size_t i = 0; i < count; ++i) b[static_cast<std::size_t>(c.rank()) * count + i] = input<T>(c.rank(), i);
    c.all_gather(std::span(b));
    return b;
  });
  CHECK(same_bits(g2, gathered));
  CHECK(same_bits(g2, tg2));

  // all_to_all: block j of rank r's send is input(r, j*count + i); rank me receives block me of every rank.
  std::vector<T> transposed(count * un);
  for (std::size_t r = 0; r < un; ++r)
    for (std::size_t i = 0; i < count; ++i)
      transposed[r * count + i] = input<T>(static_cast<int>(r), static_cast<std::size_t>(me) * count + i);
  auto [t1, tt1] = on_both<T>([&](auto& c) {
    std::vector<T> s(count * un), r(count * un);
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = input<T>(c.rank(), i);
    c.all_to_all(std::span<const T>(s), std::span(r));
    return r;
  });
  CHECK(same_bits(t1, transposed));
  CHECK(same_bits(t1, tt1));
  auto [t2, tt2] = on_both<T>([&](auto& c) {
    std::vector<T> s(count * un);
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = input<T>(c.rank(), i);
    c.all_to_all(std::span(s));
    return s;
  });
  CHECK(same_bits(t2, transposed));
  CHECK(same_bits(t2, tt2));

  // all_to_all_v: rank r sends (r + j) % 3 + count elements to rank j, packed in order.
  auto cnt = [&](int r, int j) { return static_cast<std::int64_t>((r + j) % 3) + static_cast<std::int64_t>(count); };
  auto [v1, tv1] = on_both<T>([&](auto& c) {
    const int r = c.rank();
    std::vector<std::int64_t> sc(un), sd(un), rc(un), rd(un);
    std::int64_t so = 0, ro = 0;
    for (int j = 0; j < n; ++j) {
      sc[static_cast<std::size_t>(j)] = cnt(r, j);
      sd[static_cast<std::size_t>(j)] = so;
      so += cnt(r, j);
      rc[static_cast<std::size_t>(j)] = cnt(j, r);
      rd[static_cast<std::size_t>(j)] = ro;
      ro += cnt(j, r);
    }
    std::vector<T> s(static_cast<std::size_t>(so)), out(static_cast<std::size_t>(ro));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = input<T>(r, i);
    c.all_to_all_v(std::span<const T>(s), std::span<const std::int64_t>(sc), std::span<const std::int64_t>(sd),
                   std::span(out), std::span<const std::int64_t>(rc), std::span<const std::int64_t>(rd));
    return out;
  });
  std::vector<T> vexp;
  for (int j = 0; j < n; ++j) {
    std::int64_t off = 0;
    for (int k = 0; k < me; ++k) off += cnt(j, k);
    for (std::int64_t i = 0; i < cnt(j, me); ++i) vexp.push_back(input<T>(j, static_cast<std::size_t>(off + i)));
  }
  CHECK(same_bits(v1, vexp));
  CHECK(same_bits(v1, tv1));

  // ppermute: a ring shift, and a partial permutation where some ranks receive zeros.
  std::vector<permute_pair> ring, partial;
  for (int r = 0; r < n; ++r) ring.push_back({r, (r + 1) % n});
  partial.push_back({0, n - 1});
  for (const auto& pairs : {ring, partial}) {
    auto [p1, tp1] = on_both<T>([&](auto& c) {
      std::vector<T> s(count), r(count, T(5));
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i);
      c.ppermute(std::span<const T>(s), std::span(r), std::span<const permute_pair>(pairs));
      return r;
    });
    std::vector<T> pexp(count, T(0));
    for (const auto& p : pairs)
      if (p.dest == me)
        for (std::size_t i = 0; i < count; ++i) pexp[i] = input<T>(p.source, i);
    CHECK(same_bits(p1, pexp));
    CHECK(same_bits(p1, tp1));
    auto [p2, tp2] = on_both<T>([&](auto& c) {
      std::vector<T> s(count);
      for (std::size_t i = 0; i < count; ++i) s[i] = input<T>(c.rank(), i);
      c.ppermute(std::span(s), std::span<const permute_pair>(pairs));
      return s;
    });
    CHECK(same_bits(p2, pexp));
    CHECK(same_bits(p2, tp2));
  }
}

}  // namespace

TEST_CASE("mpi_communicator satisfies the concept and adopts MPI_COMM_WORLD", "[mpi]") {
  static_assert(meshlib::communicator<mpi_communicator>);
  int r = -1, n = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  CHECK(world().rank() == r);
  CHECK(world().size() == n);
  CHECK(world().native() == MPI_COMM_WORLD);
}

TEST_CASE("reductions match the expectations and the thread backend bit for bit", "[mpi][reduce]") {
  for (std::size_t count : {std::size_t{1}, std::size_t{37}, std::size_t{20000}}) {
    check_reductions<std::int32_t>(count);
    check_reductions<std::int64_t>(count);
    check_reductions<float>(count);
    check_reductions<double>(count);
    check_reductions<bfloat16>(count);
  }
}

TEST_CASE("data movement matches the expectations and the thread backend bit for bit", "[mpi][move]") {
  for (std::size_t count : {std::size_t{1}, std::size_t{13}, std::size_t{40000}}) {
    check_movement<std::int32_t>(count);
    check_movement<std::int64_t>(count);
    check_movement<float>(count);
    check_movement<double>(count);
    check_movement<bfloat16>(count);
  }
}

TEST_CASE("integer sums wrap as on the thread backend", "[mpi][reduce]") {
  auto [a, ta] = on_both<std::int32_t>([](auto& c) {
    std::vector<std::int32_t> x{std::numeric_limits<std::int32_t>::max(), std::numeric_limits<std::int32_t>::min() + c.rank(),
                                -7 * (c.rank() + 1)};
    c.all_reduce(std::span(x), reduce_op::sum);
    return x;
  });
  CHECK(same_bits(a, ta));
  const auto n = static_cast<std::uint32_t>(world().size());
  CHECK(static_cast<std::uint32_t>(a[0]) == static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()) * n);
}

TEST_CASE("random floats give the thread backend's bits", "[mpi][reduce]") {
  const std::size_t count = 5000;
  auto make = [&](int rank) {
    std::mt19937 g(static_cast<unsigned>(rank) * 7919u + 1u);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> x(count);
    for (auto& v : x) v = d(g);
    return x;
  };
  for (reduce_op op : {reduce_op::sum, reduce_op::mean, reduce_op::max}) {
    auto [a, ta] = on_both<float>([&](auto& c) {
      auto x = make(c.rank());
      c.all_reduce(std::span(x), op);
      return x;
    });
    // The same bits: float reductions run in rank order on every backend.
    CHECK(same_bits(a, ta));
    // bfloat16 (widened to float by default, rounded once): the same bits too.
    auto [b, tb] = on_both<bfloat16>([&](auto& c) {
      auto x = make(c.rank());
      std::vector<bfloat16> y(x.begin(), x.end());
      c.all_reduce(std::span(y), op);
      return y;
    });
    CHECK(same_bits(b, tb));
  }
}

namespace {

/// Inputs whose float sum depends on the order: 1e8 on rank 0, 1 on rank 1, -1e8 on rank 2, 0.5
/// on rank 3 (rank order: ((1e8 + 1) - 1e8) + 0.5 = 0.5, as 1e8 + 1 rounds to 1e8; MPI's own
/// orders give 1.5 or 1), then small values; element i scales them by (i % 3 + 1).
template <class T>
T order_input(int rank, std::size_t i) {
  const double base[4] = {1e8, 1.0, -1e8, 0.5};
  const double v = rank < 4 ? base[rank] : 0.25 * rank;
  return static_cast<T>(static_cast<float>(v * static_cast<double>(i % 3 + 1)));
}

/// The reduction of `order_input` over `n` ranks, written out here in rank order in the
/// accumulator type (float for bfloat16), as the communicator contract says.
template <class T>
T rank_order(reduce_op op, int n, std::size_t i) {
  using A = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;
  A acc = static_cast<A>(order_input<T>(0, i));
  for (int r = 1; r < n; ++r) {
    const A x = static_cast<A>(order_input<T>(r, i));
    acc = op == reduce_op::prod ? acc * x : acc + x;
  }
  if (op == reduce_op::mean) acc = acc / static_cast<A>(n);
  return static_cast<T>(acc);
}

template <class T>
void check_rank_order() {
  const int n = world().size();
  const int me = world().rank();
  const std::size_t count = 7;  // not a multiple of the ranks: the blocks are padded
  for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::mean}) {
    INFO(meshlib::to_string(meshlib::datatype_of<T>) << " " << meshlib::to_string(op) << " on " << n << " ranks");
    std::vector<T> want(count);
    for (std::size_t i = 0; i < count; ++i) want[i] = rank_order<T>(op, n, i);
    auto mine = [&](int r, std::size_t len, std::size_t offset = 0) {
      std::vector<T> v(len);
      for (std::size_t i = 0; i < len; ++i) v[i] = order_input<T>(r, offset + i);
      return v;
    };
    auto [a, ta] = on_both<T>([&](auto& c) {
      auto x = mine(c.rank(), count);
      c.all_reduce(std::span(x), op);
      return x;
    });
    CHECK(same_bits(a, want));
    CHECK(same_bits(a, ta));
    auto [b, tb] = on_both<T>([&](auto& c) {
      auto x = mine(c.rank(), count);
      std::vector<T> r(count, T{});
      c.reduce(std::span<const T>(x), std::span(r), op, c.size() - 1);
      return r;
    });
    if (me == n - 1) CHECK(same_bits(b, want));
    CHECK(same_bits(b, tb));
    // reduce_scatter: rank r's block is elements [r * count, (r + 1) * count) of every input.
    auto [d, td] = on_both<T>([&](auto& c) {
      auto x = mine(c.rank(), count * static_cast<std::size_t>(c.size()));
      std::vector<T> r(count, T{});
      c.reduce_scatter(std::span<const T>(x), std::span(r), op);
      return r;
    });
    std::vector<T> block(count);
    for (std::size_t i = 0; i < count; ++i) block[i] = rank_order<T>(op, n, static_cast<std::size_t>(me) * count + i);
    CHECK(same_bits(d, block));
    CHECK(same_bits(d, td));
  }
}

}  // namespace

// Issue 10: MPI_Allreduce combines the ranks in an order of its own; float sums, products and
// means must be the thread backend's rank-order bits on every backend (detail/ordered_reduce.hpp).
TEST_CASE("float reductions run in rank order: the thread backend's bits, not MPI's order", "[mpi][reduce]") {
  check_rank_order<float>();
  check_rank_order<double>();
  check_rank_order<bfloat16>();
  if (world().size() >= 4) {
    // The case MPI's order gets wrong: ((1e8 + 1) - 1e8) + 0.5 = 0.5 in rank order.
    float x = order_input<float>(world().rank(), 0);
    world().all_reduce(std::span(&x, 1), reduce_op::sum);
    CHECK(x == (world().size() == 4 ? 0.5f : rank_order<float>(reduce_op::sum, world().size(), 0)));
  }
}

TEST_CASE("bfloat16 on the wire: a user-defined MPI op that combines in float", "[mpi][bf16]") {
  meshlib::mpi_comm_options o;
  o.bfloat16_on_wire = true;
  mpi_communicator c(MPI_COMM_WORLD, o);
  const int n = c.size();
  for (reduce_op op : meshlib::all_reduce_ops) {
    std::vector<bfloat16> x(64);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = input<bfloat16>(c.rank(), i, op);
    c.all_reduce(std::span(x), op);
    // Small integers: exact in bfloat16 at every step, so the result is exact.
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(same_bits(x[i], expected_reduce<bfloat16>(op, n, i)));
  }
}

TEST_CASE("send and recv: buffered, matched by source and tag, lengths checked", "[mpi][p2p]") {
  auto& w = world();
  const int n = w.size();
  const int me = w.rank();
  // Everyone sends first, then receives: must not deadlock (sends are buffered).
  std::vector<std::int64_t> out(50000, me);
  for (int tag : {3, 1}) {
    out[0] = me * 100 + tag;
    w.send(std::span(out), (me + 1) % n, tag);
  }
  for (int tag : {1, 3}) {  // received in another order than sent: matched by tag
    std::vector<std::int64_t> in(50000);
    const int from = (me + n - 1) % n;
    w.recv(std::span(in), from, tag);
    CHECK(in[0] == from * 100 + tag);
    CHECK(in[1] == from);
  }
  // A message of another length is a collective_mismatch on the receiver.
  std::vector<float> two(2), three(3);
  w.send(std::span(two), (me + 1) % n, 9);
  REQUIRE_THROWS_AS(w.recv(std::span(three), (me + n - 1) % n, 9), meshlib::collective_mismatch);
  REQUIRE_THROWS_AS(w.send(std::span(two), n, 0), meshlib::comm_argument_error);
  REQUIRE_THROWS_AS(w.recv(std::span(two), 0, -1), meshlib::comm_argument_error);
  w.barrier();
}

TEST_CASE("argument errors are thrown before any data moves", "[mpi][errors]") {
  auto& w = world();
  std::vector<float> a(8), b(4);
  REQUIRE_THROWS_AS(w.all_reduce(std::span<const float>(a), std::span(b), reduce_op::sum), meshlib::comm_argument_error);
  REQUIRE_THROWS_AS(w.all_reduce(std::span<const float>(a).first(4), std::span(a).subspan(2, 4), reduce_op::sum),
                    meshlib::comm_argument_error);
  REQUIRE_THROWS_AS(w.broadcast(std::span(a), w.size()), meshlib::comm_argument_error);
  REQUIRE_THROWS_AS(w.reduce(std::span(a), reduce_op::sum, -1), meshlib::comm_argument_error);
  std::vector<float> odd(static_cast<std::size_t>(w.size()) * 3 + 1);
  REQUIRE_THROWS_AS(w.all_to_all(std::span(odd)), meshlib::comm_argument_error);
  const permute_pair dup[] = {{0, 1}, {0, 0}};
  REQUIRE_THROWS_AS(w.ppermute(std::span(a), std::span<const permute_pair>(dup)), meshlib::comm_argument_error);
  REQUIRE_THROWS_AS(w.split(-1, 0), meshlib::comm_argument_error);
  try {
    w.all_gather(std::span<const float>(a), std::span(b));
  } catch (const meshlib::comm_argument_error& e) {
    CHECK(std::string(e.what()).find("meshlib: invalid argument to all_gather on MPI rank") != std::string::npos);
  }
  w.barrier();  // every rank made the same mistakes: still in step
}

TEST_CASE("an adopted MPI_Comm is never freed; split results are meshlib's", "[mpi][ownership]") {
  MPI_Comm mine = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &mine);
  MPI_Comm_set_errhandler(mine, MPI_ERRORS_RETURN);
  MPI_Comm sub_native = MPI_COMM_NULL;
  {
    mpi_communicator c(mine);
    CHECK(c.native() == mine);
    auto copy = c;  // handles share the communicator
    auto sub = copy.split(c.rank() % 2, -c.rank());
    sub_native = sub.native();
    CHECK(sub_native != mine);
    // key = -rank: the order within each color is reversed.
    const int members = (c.size() - c.rank() % 2 + 1) / 2;
    CHECK(sub.size() == members);
    CHECK(sub.rank() == members - 1 - c.rank() / 2);
    int x = c.rank();
    sub.all_reduce(std::span(&x, 1), reduce_op::sum);
    int expect = 0;
    for (int r = c.rank() % 2; r < c.size(); r += 2) expect += r;
    CHECK(x == expect);
  }
  // The application's communicator still works after every handle is gone.
  CHECK(MPI_Barrier(mine) == MPI_SUCCESS);
  int x = 1, y = 0;
  CHECK(MPI_Allreduce(&x, &y, 1, MPI_INT, MPI_SUM, mine) == MPI_SUCCESS);
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  CHECK(y == n);
  MPI_Comm_free(&mine);
}

// Regression: a rank that waits more than 10 ms in a collective sends "I wait in call c" notes to
// its peers on a side communicator; the peers finish without reading them. Freeing that side
// communicator with the notes still in flight let OpenMPI 4.1 hand them to the next communicator
// that reused its context id, and creating a smaller one (a split) then crashed in
// mca_pml_ob1_add_comm (about 1 run in 8 of the 4-rank tests). Here every round leaves notes
// behind on purpose, then builds smaller communicators, many times.
TEST_CASE("arrival notes left unread do not reach later communicators", "[mpi][ownership]") {
  auto world = mpi_communicator(MPI_COMM_WORLD);
  for (int round = 0; round < 40; ++round) {
    {
      auto c = world.split(0, world.rank());
      // Every rank but the last arrives at once and waits for it; after 10 ms they send notes,
      // which the last rank, arriving at about that time, never needs to read: some reach it
      // after it has freed the communicator.
      if (c.rank() == c.size() - 1) std::this_thread::sleep_for(std::chrono::microseconds(9000 + 100 * (round % 20)));
      int x = 1;
      c.all_reduce(std::span(&x, 1), reduce_op::sum);
      REQUIRE(x == c.size());
    }
    // Smaller communicators than the one just freed: each rank alone, then pairs.
    auto alone = world.split(world.rank(), 0);
    auto pairs = world.split(world.rank() / 2, world.rank());
    int y = world.rank();
    pairs.all_reduce(std::span(&y, 1), reduce_op::sum);
    const int first = world.rank() / 2 * 2;
    CHECK(y == (first + 1 < world.size() ? 2 * first + 1 : first));
    CHECK(alone.size() == 1);
  }
}

TEST_CASE("per-axis sub-communicators of a mesh come from MPI_Comm_split", "[mpi][mesh]") {
  auto& w = world();
  const int n = w.size();
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const mesh_t m{static_cast<std::size_t>(n / 2), std::size_t{2}};
  meshlib::axis_communicators<mpi_communicator, mesh_t> axes(w, m);
  const auto dev = static_cast<std::size_t>(w.rank());
  for (auto mask : {mesh_t::mask_of<"data">(), mesh_t::mask_of<"model">(), mesh_t::all_axes}) {
    auto& c = axes.over(mask);
    const auto group = m.group(dev, mask);
    CHECK(static_cast<std::size_t>(c.size()) == group.size());
    CHECK(static_cast<std::size_t>(c.rank()) == m.group_rank(dev, mask));
    // Each member contributes its device id; the group sum is the sum of the group's ids.
    std::int64_t x = static_cast<std::int64_t>(dev);
    c.all_reduce(std::span(&x, 1), reduce_op::sum);
    CHECK(x == std::accumulate(group.begin(), group.end(), std::int64_t{0}));
    std::vector<std::int64_t> ids(group.size());
    const std::int64_t mine = static_cast<std::int64_t>(dev);
    c.all_gather(std::span<const std::int64_t>(&mine, 1), std::span(ids));
    CHECK(std::equal(ids.begin(), ids.end(), group.begin()));  // group-rank order
  }
}

TEST_CASE("mismatch detection is always on: ranks that disagree all see collective_mismatch", "[mpi][errors]") {
  mpi_communicator c(MPI_COMM_WORLD);  // default options: the fingerprint check is not optional
  std::vector<float> x(c.rank() == 0 ? 4 : 5, 1.0f);
  try {
    c.all_reduce(std::span(x), reduce_op::sum);
    FAIL("different counts must be a collective_mismatch");
  } catch (const meshlib::collective_mismatch& e) {
    const std::string w = e.what();
    CHECK(w.find("rank 0 called all_reduce(float32, count 4, op sum) as call #0") != std::string::npos);
    CHECK(w.find("rank 1 called all_reduce(float32, count 5, op sum) as call #0") != std::string::npos);
  }
  // Like the thread backend, a failed communicator refuses further calls with the root cause.
  std::vector<float> y(3, 1.0f);
  try {
    c.all_reduce(std::span(y), reduce_op::sum);
    FAIL("a failed communicator must refuse");
  } catch (const meshlib::collective_mismatch& e) {
    CHECK(std::string(e.what()).find("refused all_reduce") != std::string::npos);
  }
  // A fresh communicator over the same ranks works: nothing is left pending.
  mpi_communicator d(MPI_COMM_WORLD);
  d.all_reduce(std::span(y), reduce_op::sum);
  CHECK(y[0] == static_cast<float>(c.size()));
}

TEST_CASE("all_to_all_v counts that disagree: every rank sees collective_mismatch, the receiver names both counts",
          "[mpi][errors]") {
  mpi_communicator c(MPI_COMM_WORLD);
  const auto n = static_cast<std::size_t>(c.size());
  // One element to every rank, except that rank 1 expects two from rank 0.
  std::vector<std::int64_t> sc(n, 1), sd(n), rc(n, 1), rd(n);
  if (c.rank() == 1) rc[0] = 2;
  std::int64_t at = 0;
  for (std::size_t j = 0; j < n; ++j) {
    sd[j] = static_cast<std::int64_t>(j);
    rd[j] = at;
    at += rc[j];
  }
  std::vector<float> s(n, 1.0f), out(static_cast<std::size_t>(at));
  try {
    c.all_to_all_v(std::span<const float>(s), std::span<const std::int64_t>(sc), std::span<const std::int64_t>(sd),
                   std::span(out), std::span<const std::int64_t>(rc), std::span<const std::int64_t>(rd));
    FAIL("counts that disagree must be a collective_mismatch");
  } catch (const meshlib::collective_mismatch& e) {
    const std::string w = e.what();
    CHECK(w.find("collective mismatch in all_to_all_v on an MPI communicator of " + std::to_string(n) +
                 " ranks: the counts disagree") != std::string::npos);
    if (c.rank() == 1) CHECK(w.find(": rank 0 sends 1 elements to rank 1, which expects 2") != std::string::npos);
    else CHECK(w.find("(rank 1 saw it)") != std::string::npos);
  }
}

TEST_CASE("a rank that never arrives is a comm_timeout, and the communicator stays failed", "[mpi][timeout]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::milliseconds(300);
  mpi_communicator c(MPI_COMM_WORLD, o);
  std::vector<float> x(16, 1.0f);
  if (c.rank() == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.all_reduce(std::span(x), reduce_op::sum);
      FAIL("must time out");
    } catch (const meshlib::comm_timeout& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // Timing margins (issue 40 §5): a timeout never fires early, and a loaded machine only makes it
      // later; 10 s is a backstop against a wait that ignores its 300 ms timeout.
      CHECK(s >= 0.29);
      CHECK(s < 10.0);
      CHECK(std::string(e.what()).find("all_reduce on MPI rank 0") != std::string::npos);
      std::string missing = "rank(s) 1";
      for (int r = 2; r < c.size(); ++r) missing += ", " + std::to_string(r);
      CHECK(std::string(e.what()).find(missing + " never arrived") != std::string::npos);
    }
    REQUIRE_THROWS_AS(c.barrier(), meshlib::comm_timeout);  // refused: failed
  }
  // The others never make the call: rank 0's fingerprint exchange stays pending in its failed
  // communicator (never freed), which MPI tolerates until MPI_Finalize. (Had they made it late,
  // their data collective would wait for rank 0 forever: MPI cannot cancel either side.)
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("an exception that unwinds a rank's communicator releases its peers at once", "[mpi][faults]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::seconds(20);
  const int thrower = world().size() - 1;
  if (world().rank() == thrower) {
    // No fail(): the exception leaves the communicator's scope, which is the rank's signal.
    try {
      mpi_communicator c(MPI_COMM_WORLD, o);
      mpi_communicator copy = c;  // a second handle is unwound too; the last one fails it
      (void)copy;
      throw std::runtime_error("bad input on the last rank");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "bad input on the last rank");
    }
  } else {
    mpi_communicator c(MPI_COMM_WORLD, o);
    std::vector<float> x(8, 1.0f);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      c.all_reduce(std::span(x), reduce_op::sum);
      FAIL("the peers of a rank whose exception unwound its communicator must be released");
    } catch (const meshlib::comm_aborted& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      CHECK(s < 10.0);  // not the 20 s timeout (generous: a loaded machine is slow)
      CHECK(std::string(e.what()) ==
            "meshlib: communicator aborted: MPI rank " + std::to_string(thrower) + " of " +
                std::to_string(world().size()) +
                " failed: an exception left the scope of its communicator there (that rank's handler has its "
                "message)");
      CHECK(c.root_cause_rank() == thrower);
    }
  }
  // A handle that is destroyed normally after a caught exception fails nothing.
  {
    mpi_communicator c(MPI_COMM_WORLD, o);
    try {
      throw std::runtime_error("caught within the scope");
    } catch (const std::runtime_error&) {
    }
    std::vector<int> y(3, 1);
    c.all_reduce(std::span(y), reduce_op::sum);
    CHECK(y[0] == c.size());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Issue 40 §4: a plain MPI program (no runner, no fail_guard) on the handle most programs use, a
// copy of mpi::world() (whose last handle the runtime keeps): the rank's exception unwinds its
// copy, which fails the communicator, and every other rank's wait ends within 1 s (not the 20 s
// timeout) in comm_aborted naming the rank, with root_cause_rank() set on every rank and handle.
TEST_CASE("plain MPI: an exception that unwinds a copy of the program's handle releases the peers within 1 s",
          "[mpi][faults]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::seconds(20);                 // never reached
  const mpi_communicator program(MPI_COMM_WORLD, o);  // outlives the step, as the runtime's copy of world()
  const int n = program.size();
  const int thrower = n - 1;
  MPI_Barrier(MPI_COMM_WORLD);  // the clocks below start together
  const auto t0 = std::chrono::steady_clock::now();
  try {
    mpi_communicator comm = program;  // `auto comm = meshlib::mpi::world();`
    CHECK(comm.fails_on_unwind());
    std::vector<float> x(8, 1.0f);
    if (comm.rank() == thrower) throw std::runtime_error("bad input on the last rank");
    comm.all_reduce(std::span(x), reduce_op::sum);
    FAIL("rank " + std::to_string(thrower) + " never arrives: the others must be released");
  } catch (const meshlib::comm_aborted& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Timing margin (issue 40 §5): the verdict is the type and the message, which only the abort
    // notice carries (the 20 s timeout would be comm_timeout); the release takes milliseconds
    // (issue 40 §4 promises at most 1 s), and 10 s leaves a loaded machine room for polling ranks.
    CHECK(s < 10.0);
    CHECK(std::string(e.what()) ==
          "meshlib: communicator aborted: MPI rank " + std::to_string(thrower) + " of " + std::to_string(n) +
              " failed: an exception left the scope of its communicator there (that rank's handler has its message)");
  } catch (const std::runtime_error& e) {  // comm_aborted derives from it: second
    CHECK(program.rank() == thrower);
    CHECK(std::string(e.what()) == "bad input on the last rank");
  }
  CHECK(program.root_cause_rank() == thrower);  // on every rank, the thrower's too
  CHECK_THROWS_AS(mpi_communicator(program).barrier(), meshlib::comm_aborted);  // sticky
  MPI_Barrier(MPI_COMM_WORLD);
}

// What still needs the timeout (issue 27 §4): a rank that catches its exception within the scope
// of its handle unwinds nothing, so meshlib never learns of it: its peers wait for the timeout,
// after which root_cause_rank() names the rank that never arrived (the lowest when several did).
namespace {
std::string timeout_text(const mpi_communicator& c, const std::string& missing) {
  return "meshlib: all_reduce on MPI rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size()) +
         " did not complete within 2.000000 s: rank(s) " + missing +
         " never arrived (it failed, is still busy, or called another operation); MPI cannot cancel a collective, so "
         "this communicator refuses further operations; end the run";
}
}  // namespace

TEST_CASE("after a timeout root_cause_rank names the rank that never arrived", "[mpi][timeout][faults]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::seconds(2);  // generous: the peers that do arrive send their notes after 10 ms
  const mpi_communicator program(MPI_COMM_WORLD, o);  // outlives the step, as the runtime's copy of world()
  const int n = program.size();
  const int thrower = n - 1;
  {
    mpi_communicator c = program;
    CHECK(c.root_cause_rank() == -1);
    std::vector<float> x(4, 1.0f);
    try {
      if (c.rank() == thrower) throw std::runtime_error("bad input");  // before the collective
      c.all_reduce(std::span(x), reduce_op::sum);
      FAIL("rank " + std::to_string(thrower) + " never arrives: the others must time out");
    } catch (const meshlib::comm_timeout& e) {
      CHECK(std::string(e.what()) == timeout_text(c, std::to_string(thrower)));
      CHECK(c.root_cause_rank() == thrower);
      // The failure is sticky, and so is the blame.
      CHECK_THROWS_AS(c.barrier(), meshlib::comm_timeout);
      CHECK(c.root_cause_rank() == thrower);
      CHECK(program.root_cause_rank() == thrower);  // every handle on the communicator
    } catch (const std::runtime_error& e) {  // comm_timeout derives from it: second
      CHECK(std::string(e.what()) == "bad input");
      CHECK(c.rank() == thrower);
      CHECK(c.root_cause_rank() == -1);  // nothing failed the communicator: the thrower knows of no failure
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("after a timeout that several ranks missed, root_cause_rank is the lowest of them", "[mpi][timeout][faults]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::seconds(2);
  mpi_communicator c(MPI_COMM_WORLD, o);
  const int n = c.size();
  if (n < 3) {
    MPI_Barrier(MPI_COMM_WORLD);
    return;  // needs two ranks that arrive and two that do not (np 4)
  }
  if (c.rank() < 2) {
    std::vector<int> x(2, 1);
    try {
      c.all_reduce(std::span(x), reduce_op::sum);
      FAIL("ranks 2.. never arrive: must time out");
    } catch (const meshlib::comm_timeout& e) {
      std::string missing = "2";
      for (int r = 3; r < n; ++r) missing += ", " + std::to_string(r);
      CHECK(std::string(e.what()) == timeout_text(c, missing));
      CHECK(c.root_cause_rank() == 2);
    }
  } else {
    CHECK(c.root_cause_rank() == -1);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("fail_guard: a rank that throws releases its peers on the program's handle at once, naming it",
          "[mpi][faults]") {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::seconds(20);  // never reached: the guard releases the peers
  const mpi_communicator program(MPI_COMM_WORLD, o);  // outlives the step, as the runtime's copy of world()
  const int n = program.size();
  const int thrower = n - 1;
  const std::string text = "meshlib: communicator aborted: MPI rank " + std::to_string(thrower) + " of " +
                           std::to_string(n) +
                           " failed: an exception left the scope of a fail_guard there (that rank's handler has its "
                           "message)";
  // A guard whose scope ends normally, or whose exception is caught within it, fails nothing.
  {
    meshlib::fail_guard on_throw(program);
    try {
      throw std::runtime_error("caught within the guard's scope");
    } catch (const std::runtime_error&) {
    }
  }
  {
    std::vector<int> y(3, 1);
    mpi_communicator(program).all_reduce(std::span(y), reduce_op::sum);
    CHECK(y[0] == n);
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    meshlib::fail_guard on_throw(program);
    if (program.rank() == thrower) throw std::runtime_error("bad input on the last rank");
    std::vector<float> x(8, 1.0f);
    mpi_communicator(program).all_reduce(std::span(x), reduce_op::sum);
    FAIL("the peers of a rank that threw under a fail_guard must be released");
  } catch (const meshlib::comm_aborted& e) {
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);  // not the 20 s
    CHECK(std::string(e.what()) == text);
  } catch (const std::runtime_error& e) {
    CHECK(program.rank() == thrower);
    CHECK(std::string(e.what()) == "bad input on the last rank");
  }
  // Every rank, the thrower included, names the thrower; the communicator refuses further calls.
  CHECK(program.root_cause_rank() == thrower);
  if (program.rank() != thrower) {
    // The peer's own guard saw a failure that is not its own: it did not blame its own rank.
    try {
      mpi_communicator(program).barrier();
      FAIL("a failed communicator must refuse");
    } catch (const meshlib::comm_aborted& e) {
      CHECK(std::string(e.what()).find(text) == 0);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("large payloads: barrier then blocking, or polled non-blocking, give the same result", "[mpi][large]") {
  using mode = meshlib::mpi_comm_options::large_payload_mode;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int on_node = 0;
  MPI_Comm_size(node, &on_node);
  MPI_Comm_free(&node);
  CHECK(world().oversubscribed() == (static_cast<unsigned>(on_node) > std::thread::hardware_concurrency()));
  const std::size_t count = 100000;  // 400 KB: above blocking_min_bytes
  for (mode m : {mode::automatic, mode::barrier_then_blocking, mode::nonblocking}) {
    meshlib::mpi_comm_options o;
    o.large_payloads = m;
    mpi_communicator c(MPI_COMM_WORLD, o);
    std::vector<std::int64_t> x(count);
    for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<std::int64_t>(i) * (c.rank() + 1);
    c.all_reduce(std::span(x), reduce_op::sum);
    const std::int64_t ranks_sum = static_cast<std::int64_t>(c.size()) * (c.size() + 1) / 2;
    bool ok = true;
    for (std::size_t i = 0; i < count; ++i) ok = ok && x[i] == static_cast<std::int64_t>(i) * ranks_sum;
    CHECK(ok);
  }
}

}  // namespace MESHLIB_TEST_UNIT
