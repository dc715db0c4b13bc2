// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Every collective of the thread communicator, for every element type and reduce op, in-place and
// out-of-place, through both algorithms, for 1 to 64 participants, against independently computed
// expectations, compared bit for bit.
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "comm_test_support.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace comm_test;
using meshlib::permute_pair;
using meshlib::thread_communicator;

namespace {

template <class T>
struct coll_case {
  std::string name;
  std::function<std::vector<T>(thread_communicator&)> run;  // on every rank; returns what it received
  std::function<std::vector<T>(int rank, int n)> expect;
};

template <class T>
std::vector<coll_case<T>> make_cases(int n, std::size_t c) {
  std::vector<coll_case<T>> cases;
  const std::string sc = " count " + std::to_string(c);
  for (reduce_op op : meshlib::all_reduce_ops) {
    const std::string so = std::string(" ") + std::string(to_string(op)) + sc;
    cases.push_back({"all_reduce" + so,
                     [=](thread_communicator& k) {
                       auto in = inputs<T>(k.rank(), c, 1);
                       std::vector<T> out(c + 3, T(7));  // longer than needed: the tail stays untouched
                       k.all_reduce(std::span<const T>(in), std::span<T>(out), op);
                       return out;
                     },
                     [=](int, int nn) {
                       std::vector<T> e(c + 3, T(7));
                       for (std::size_t i = 0; i < c; ++i) e[i] = reference<T>(op, nn, i, 1);
                       return e;
                     }});
    cases.push_back({"all_reduce in place" + so,
                     [=](thread_communicator& k) {
                       auto buf = inputs<T>(k.rank(), c, 2);
                       k.all_reduce(std::span<T>(buf), op);
                       return buf;
                     },
                     [=](int, int nn) {
                       std::vector<T> e(c);
                       for (std::size_t i = 0; i < c; ++i) e[i] = reference<T>(op, nn, i, 2);
                       return e;
                     }});
    const int root = n - 1;
    cases.push_back({"reduce" + so,
                     [=](thread_communicator& k) {
                       auto in = inputs<T>(k.rank(), c, 3);
                       std::vector<T> out(k.rank() == root ? c : 0);
                       k.reduce(std::span<const T>(in), std::span<T>(out), op, root);
                       return out;
                     },
                     [=](int r, int nn) {
                       std::vector<T> e(r == root ? c : 0);
                       for (std::size_t i = 0; i < e.size(); ++i) e[i] = reference<T>(op, nn, i, 3);
                       return e;
                     }});
    cases.push_back({"reduce in place" + so,
                     [=](thread_communicator& k) {
                       auto buf = inputs<T>(k.rank(), c, 4);
                       k.reduce(std::span<T>(buf), op, 0);
                       return buf;
                     },
                     [=](int r, int nn) {
                       if (r != 0) return inputs<T>(r, c, 4);  // only read on the others
                       std::vector<T> e(c);
                       for (std::size_t i = 0; i < c; ++i) e[i] = reference<T>(op, nn, i, 4);
                       return e;
                     }});
    cases.push_back({"reduce in place to the last rank" + so,  // the root's buffer is input n-1 and the output
                     [=](thread_communicator& k) {
                       auto buf = inputs<T>(k.rank(), c, 18);
                       k.reduce(std::span<T>(buf), op, root);
                       return buf;
                     },
                     [=](int r, int nn) {
                       if (r != root) return inputs<T>(r, c, 18);
                       std::vector<T> e(c);
                       for (std::size_t i = 0; i < c; ++i) e[i] = reference<T>(op, nn, i, 18);
                       return e;
                     }});
    cases.push_back({"reduce_scatter" + so,
                     [=](thread_communicator& k) {
                       auto in = inputs<T>(k.rank(), c * static_cast<std::size_t>(k.size()), 5);
                       std::vector<T> out(c);
                       k.reduce_scatter(std::span<const T>(in), std::span<T>(out), op);
                       return out;
                     },
                     [=](int r, int nn) {
                       std::vector<T> e(c);
                       for (std::size_t i = 0; i < c; ++i) e[i] = reference<T>(op, nn, i, 5, r * static_cast<int>(c));
                       return e;
                     }});
    cases.push_back({"reduce_scatter in place" + so,
                     [=](thread_communicator& k) {
                       auto buf = inputs<T>(k.rank(), c * static_cast<std::size_t>(k.size()), 6);
                       k.reduce_scatter(std::span<T>(buf), op);
                       return buf;
                     },
                     [=](int r, int nn) {
                       auto e = inputs<T>(r, c * static_cast<std::size_t>(nn), 6);
                       for (std::size_t i = 0; i < c; ++i)
                         e[static_cast<std::size_t>(r) * c + i] = reference<T>(op, nn, i, 6, r * static_cast<int>(c));
                       return e;
                     }});
  }
  const int broot = n / 2;
  cases.push_back({"broadcast" + sc,
                   [=](thread_communicator& k) {
                     auto in = inputs<T>(k.rank(), k.rank() == broot ? c : 0, 7);
                     std::vector<T> out(c, T(3));
                     k.broadcast(std::span<const T>(in), std::span<T>(out), broot);
                     return out;
                   },
                   [=](int, int) { return inputs<T>(broot, c, 7); }});
  cases.push_back({"broadcast in place" + sc,
                   [=](thread_communicator& k) {
                     auto buf = inputs<T>(k.rank(), c, 8);
                     k.broadcast(std::span<T>(buf), 0);
                     return buf;
                   },
                   [=](int, int) { return inputs<T>(0, c, 8); }});
  cases.push_back({"all_gather" + sc,
                   [=](thread_communicator& k) {
                     auto in = inputs<T>(k.rank(), c, 9);
                     std::vector<T> out(c * static_cast<std::size_t>(k.size()));
                     k.all_gather(std::span<const T>(in), std::span<T>(out));
                     return out;
                   },
                   [=](int, int nn) {
                     std::vector<T> e;
                     for (int r = 0; r < nn; ++r) {
                       auto b = inputs<T>(r, c, 9);
                       e.insert(e.end(), b.begin(), b.end());
                     }
                     return e;
                   }});
  cases.push_back({"all_gather in place" + sc,
                   [=](thread_communicator& k) {
                     std::vector<T> buf(c * static_cast<std::size_t>(k.size()), T(1));
                     auto own = inputs<T>(k.rank(), c, 10);
                     std::copy(own.begin(), own.end(), buf.begin() + static_cast<std::ptrdiff_t>(c) * k.rank());
                     k.all_gather(std::span<T>(buf));
                     return buf;
                   },
                   [=](int, int nn) {
                     std::vector<T> e;
                     for (int r = 0; r < nn; ++r) {
                       auto b = inputs<T>(r, c, 10);
                       e.insert(e.end(), b.begin(), b.end());
                     }
                     return e;
                   }});
  // all_to_all: block j of rank r's input is inputs(r * n + j); rank r receives block r of each.
  auto a2a_block = [=](int from, int to, int nn, int salt) { return inputs<T>(from * nn + to, c, salt); };
  cases.push_back({"all_to_all" + sc,
                   [=](thread_communicator& k) {
                     std::vector<T> in;
                     for (int j = 0; j < k.size(); ++j) {
                       auto b = a2a_block(k.rank(), j, k.size(), 11);
                       in.insert(in.end(), b.begin(), b.end());
                     }
                     std::vector<T> out(in.size());
                     k.all_to_all(std::span<const T>(in), std::span<T>(out));
                     return out;
                   },
                   [=](int r, int nn) {
                     std::vector<T> e;
                     for (int j = 0; j < nn; ++j) {
                       auto b = a2a_block(j, r, nn, 11);
                       e.insert(e.end(), b.begin(), b.end());
                     }
                     return e;
                   }});
  cases.push_back({"all_to_all in place" + sc,
                   [=](thread_communicator& k) {
                     std::vector<T> buf;
                     for (int j = 0; j < k.size(); ++j) {
                       auto b = a2a_block(k.rank(), j, k.size(), 12);
                       buf.insert(buf.end(), b.begin(), b.end());
                     }
                     k.all_to_all(std::span<T>(buf));
                     return buf;
                   },
                   [=](int r, int nn) {
                     std::vector<T> e;
                     for (int j = 0; j < nn; ++j) {
                       auto b = a2a_block(j, r, nn, 12);
                       e.insert(e.end(), b.begin(), b.end());
                     }
                     return e;
                   }});
  // all_to_all_v: rank r sends (r + j) % 3 * c / 2 + 1 elements to rank j, blocks packed with a gap of 1.
  auto vcount = [=](int from, int to) { return static_cast<std::int64_t>((from + to) % 3 * (c / 2) + (c ? 1 : 0)); };
  cases.push_back({"all_to_all_v" + sc,
                   [=](thread_communicator& k) {
                     const int nn = k.size();
                     std::vector<std::int64_t> scnt(nn), sdsp(nn), rcnt(nn), rdsp(nn);
                     std::int64_t so = 0, ro = 0;
                     for (int j = 0; j < nn; ++j) {
                       scnt[j] = vcount(k.rank(), j);
                       sdsp[j] = so;
                       so += scnt[j] + 1;
                       rcnt[j] = vcount(j, k.rank());
                       rdsp[j] = ro;
                       ro += rcnt[j] + 1;
                     }
                     auto in = inputs<T>(k.rank(), static_cast<std::size_t>(so), 13);
                     std::vector<T> out(static_cast<std::size_t>(ro), T(2));
                     k.all_to_all_v(std::span<const T>(in), scnt, sdsp, std::span<T>(out), rcnt, rdsp);
                     return out;
                   },
                   [=](int r, int nn) {
                     std::vector<T> e;
                     for (int j = 0; j < nn; ++j) {
                       std::int64_t off = 0;  // where rank j's block for r starts in j's input
                       for (int t = 0; t < r; ++t) off += vcount(j, t) + 1;
                       for (std::int64_t i = 0; i < vcount(j, r); ++i)
                         e.push_back(input<T>(j, static_cast<std::size_t>(off + i), 13));
                       e.push_back(T(2));
                     }
                     return e;
                   }});
  // ppermute: r -> r + 1 for every r but the last, so rank 0 receives nothing (zeros).
  auto pairs = std::make_shared<std::vector<permute_pair>>();
  for (int r = 0; r + 1 < n; ++r) pairs->push_back({r, r + 1});
  cases.push_back({"ppermute" + sc,
                   [=](thread_communicator& k) {
                     auto in = inputs<T>(k.rank(), c, 14);
                     std::vector<T> out(c, T(5));
                     k.ppermute(std::span<const T>(in), std::span<T>(out), *pairs);
                     return out;
                   },
                   [=](int r, int) { return r == 0 ? std::vector<T>(c, T(0)) : inputs<T>(r - 1, c, 14); }});
  cases.push_back({"ppermute in place" + sc,
                   [=](thread_communicator& k) {
                     auto buf = inputs<T>(k.rank(), c, 15);
                     k.ppermute(std::span<T>(buf), *pairs);
                     return buf;
                   },
                   [=](int r, int) { return r == 0 ? std::vector<T>(c, T(0)) : inputs<T>(r - 1, c, 15); }});
  cases.push_back({"send/recv ring" + sc,
                   [=](thread_communicator& k) {
                     const int nn = k.size();
                     auto in = inputs<T>(k.rank(), c, 16);
                     std::vector<T> out(c);
                     k.send(std::span<const T>(in), (k.rank() + 1) % nn, 4);  // buffered: cannot deadlock
                     k.recv(std::span<T>(out), (k.rank() + nn - 1) % nn, 4);
                     return out;
                   },
                   [=](int r, int nn) { return inputs<T>((r + nn - 1) % nn, c, 16); }});
  cases.push_back({"split by parity, sum" + sc,
                   [=](thread_communicator& k) {
                     auto sub = k.split(k.rank() % 2, -k.rank());  // reversed order inside each half
                     auto buf = inputs<T>(k.rank(), c, 17);
                     sub.all_reduce(std::span<T>(buf), reduce_op::max);
                     std::vector<T> out = buf;
                     out.push_back(T(sub.rank()));
                     out.push_back(T(sub.size()));
                     return out;
                   },
                   [=](int r, int nn) {
                     std::vector<T> e(c);
                     for (std::size_t i = 0; i < c; ++i) {
                       T best = input<T>(r % 2, i, 17);
                       for (int q = r % 2; q < nn; q += 2) {
                         const T x = input<T>(q, i, 17);
                         if (static_cast<double>(x) > static_cast<double>(best)) best = x;
                       }
                       e[i] = best;
                     }
                     int members = 0, higher = 0;
                     for (int q = r % 2; q < nn; q += 2) {
                       ++members;
                       if (q > r) ++higher;
                     }
                     e.push_back(T(higher));
                     e.push_back(T(members));
                     return e;
                   }});
  return cases;
}

template <class T>
void check_all_cases(int n, std::size_t one_shot_max, std::size_t streaming_min = 0) {
  meshlib::thread_comm_options opts = options_with_timeout(60);
  opts.one_shot_max_bytes = one_shot_max;
  opts.streaming_min_bytes = streaming_min;
  const std::size_t counts[] = {0, 1, 13, 300};
  std::vector<std::vector<coll_case<T>>> all;
  for (std::size_t c : counts) all.push_back(make_cases<T>(n, c));
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(n));
  meshlib::run_on_threads(
      n,
      [&](thread_communicator& k) {
        auto& mine = got[static_cast<std::size_t>(k.rank())];
        for (auto& cases : all)
          for (auto& cs : cases) {
            mine.push_back(cs.run(k));
            k.barrier();
          }
      },
      opts);
  for (int r = 0; r < n; ++r) {
    std::size_t idx = 0;
    for (auto& cases : all)
      for (auto& cs : cases) {
        INFO(cs.name << ", " << n << " participants, rank " << r << ", element " << meshlib::datatype_of<T>
                     << ", one_shot_max_bytes " << one_shot_max << ", streaming_min_bytes " << streaming_min);
        const auto expected = cs.expect(r, n);
        CHECK(same_bits(got[static_cast<std::size_t>(r)][idx], expected));
        ++idx;
      }
  }
}

template <class T>
void check_type() {
  for (int n : {1, 2, 3, 4, 8, 16}) {
    check_all_cases<T>(n, 1);        // zero-copy for every non-empty payload
    check_all_cases<T>(n, 1, 1);     // zero-copy with streaming stores
    check_all_cases<T>(n, 1 << 20);  // one-shot for every payload
  }
}

}  // namespace

TEST_CASE("thread communicator: every collective, float32", "[comm][collectives]") { check_type<float>(); }
TEST_CASE("thread communicator: every collective, float64", "[comm][collectives]") { check_type<double>(); }
TEST_CASE("thread communicator: every collective, int32", "[comm][collectives]") { check_type<std::int32_t>(); }
TEST_CASE("thread communicator: every collective, int64", "[comm][collectives]") { check_type<std::int64_t>(); }
TEST_CASE("thread communicator: every collective, bfloat16", "[comm][collectives]") { check_type<bfloat16>(); }

TEST_CASE("thread communicator: 64 participants", "[comm][collectives][large]") {
  check_all_cases<float>(64, 1);
  check_all_cases<std::int32_t>(64, 1 << 20);
}

TEST_CASE("thread communicator: large payloads through the default thresholds", "[comm][collectives]") {
  // Sizes around and far above the default one-shot threshold, uneven per rank slices included.
  for (int n : {2, 3, 8}) {
    for (std::size_t count : {std::size_t{4095}, std::size_t{4096}, std::size_t{4097}, std::size_t{100'003}}) {
      std::vector<std::vector<float>> got(static_cast<std::size_t>(n));
      meshlib::run_on_threads(n, [&](thread_communicator& k) {
        auto in = inputs<float>(k.rank(), count, 21);
        std::vector<float> out(count);
        k.all_reduce(std::span<const float>(in), std::span<float>(out), reduce_op::sum);
        got[static_cast<std::size_t>(k.rank())] = out;
      });
      std::vector<float> e(count);
      for (std::size_t i = 0; i < count; ++i) e[i] = reference<float>(reduce_op::sum, n, i, 21);
      for (int r = 0; r < n; ++r) {
        INFO(n << " participants, count " << count << ", rank " << r);
        CHECK(same_bits(got[static_cast<std::size_t>(r)], e));
      }
    }
  }
}

TEST_CASE("bfloat16 rounds to nearest even and accumulates in float", "[comm][datatype]") {
  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(static_cast<float>(bfloat16(1.0f)) == 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0); just above rounds up.
  CHECK(bfloat16(1.0f + 1.0f / 256).bits == 0x3f80);
  CHECK(bfloat16(1.0f + 3.0f / 256).bits == 0x3f82);
  CHECK(static_cast<float>(bfloat16(std::numeric_limits<float>::infinity())) == std::numeric_limits<float>::infinity());
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(static_cast<float>(bfloat16(nan)) != static_cast<float>(bfloat16(nan)));
  // 256 ranks adding 1/256 to 1 in bfloat16 would stay at 1; accumulated in float they reach 2.
  std::vector<std::vector<bfloat16>> got(8);
  meshlib::run_on_threads(8, [&](thread_communicator& k) {
    std::vector<bfloat16> x(3, bfloat16(k.rank() == 0 ? 1.0f : 1.0f / 256));
    k.all_reduce(std::span<bfloat16>(x), reduce_op::sum);
    got[static_cast<std::size_t>(k.rank())] = x;
  });
  // 1 + 7/256 in float, rounded once: 1.02734375 -> bfloat16 1.0234375 (0x3f83) .
  for (auto& g : got) CHECK(g[0].bits == bfloat16(1.0f + 7.0f / 256).bits);
  CHECK(bfloat16(1.0f + 7.0f / 256).bits != 0x3f80);
}

TEST_CASE("reduce ops and datatypes print their names", "[comm][datatype]") {
  CHECK(meshlib::to_string(reduce_op::mean) == "mean");
  CHECK(meshlib::to_string(meshlib::datatype::bfloat16) == "bfloat16");
  CHECK(meshlib::datatype_of<long long> == meshlib::datatype::int64);
  CHECK(meshlib::datatype_of<int> == meshlib::datatype::int32);
  STATIC_REQUIRE(!meshlib::comm_element<unsigned>);
  STATIC_REQUIRE(!meshlib::comm_element<char>);
  STATIC_REQUIRE(meshlib::communicator<meshlib::thread_communicator>);
}

}  // namespace MESHLIB_TEST_UNIT
