// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The epoch permutation and the data loader: permutation laws, process shares that reassemble the
// global batch, prefetched batches equal to sequential ones, and every bad option.
#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "meshlib/nn/data.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using meshlib::nn::batch;
using meshlib::nn::data_loader;
using meshlib::nn::dataset;
using meshlib::nn::epoch_permutation;
using meshlib::nn::loader_options;
using meshlib_test::message_of;

namespace {

/// Example i has features {i*10, i*10+1, ..., } and label i % 7: a row names its example.
dataset numbered(std::size_t count, std::size_t features = 3) {
  dataset ds;
  ds.count = count;
  ds.features = features;
  ds.classes = 7;
  ds.x.resize(count * features);
  ds.y.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    for (std::size_t k = 0; k < features; ++k) ds.x[i * features + k] = static_cast<float>(i * 10 + k);
    ds.y[i] = static_cast<std::int32_t>(i % 7);
  }
  return ds;
}

/// The examples a batch holds, checking each row is a whole example with its label.
std::vector<std::size_t> examples_of(const batch& b) {
  REQUIRE(b.x.size() == b.rows * b.features);
  REQUIRE(b.y.size() == b.rows);
  std::vector<std::size_t> out;
  for (std::size_t r = 0; r < b.rows; ++r) {
    const auto i = static_cast<std::size_t>(b.row(r)[0]) / 10;
    for (std::size_t k = 0; k < b.features; ++k) REQUIRE(b.row(r)[k] == static_cast<float>(i * 10 + k));
    REQUIRE(b.y[r] == static_cast<std::int32_t>(i % 7));
    out.push_back(i);
  }
  return out;
}

std::vector<batch> drain_epoch(data_loader& loader, std::size_t epoch) {
  loader.start_epoch(epoch);
  std::vector<batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  CHECK_FALSE(loader.next().has_value());  // stays exhausted
  return out;
}

bool same(const batch& a, const batch& b) {
  return a.x == b.x && a.y == b.y && a.rows == b.rows && a.features == b.features &&
         a.global_offset == b.global_offset && a.global_rows == b.global_rows && a.step == b.step &&
         a.epoch == b.epoch;
}

}  // namespace

TEST_CASE("epoch_permutation is a permutation that depends only on (seed, epoch)", "[nn][data][permutation]") {
  for (std::size_t count : {0u, 1u, 2u, 7u, 1000u}) {
    for (std::uint64_t seed : {0ull, 1ull, 0xFFFFFFFFFFFFFFFFull}) {
      for (std::uint64_t epoch : {0ull, 1ull, 37ull}) {
        const auto p = epoch_permutation(count, seed, epoch);
        auto sorted = p;
        std::sort(sorted.begin(), sorted.end());
        std::vector<std::size_t> iota(count);
        std::iota(iota.begin(), iota.end(), std::size_t{0});
        REQUIRE(sorted == iota);
        REQUIRE(epoch_permutation(count, seed, epoch) == p);  // a pure function
      }
    }
  }
  // Other seeds and epochs give other orders.
  const auto base = epoch_permutation(1000, 5, 0);
  CHECK(epoch_permutation(1000, 5, 1) != base);
  CHECK(epoch_permutation(1000, 6, 0) != base);
  CHECK(epoch_permutation(1000, 0, 5) != epoch_permutation(1000, 5, 0));
  std::vector<std::size_t> identity(1000);
  std::iota(identity.begin(), identity.end(), std::size_t{0});
  CHECK(base != identity);
}

TEST_CASE("epoch_permutation draws every order of 3 about equally often", "[nn][data][permutation]") {
  // 6000 epochs of 3 elements: each of the 6 orders ~1000 times (sd ~29). A biased shuffle
  // (swapping with any position, the classic mistake) gives 889 / 1111 and fails.
  std::map<std::vector<std::size_t>, int> seen;
  for (std::uint64_t epoch = 0; epoch < 6000; ++epoch) ++seen[epoch_permutation(3, 11, epoch)];
  REQUIRE(seen.size() == 6);
  for (const auto& [order, n] : seen) {
    INFO("order " << order[0] << order[1] << order[2]);
    CHECK(n > 880);
    CHECK(n < 1120);
  }
  // And the first position is uniform over 10 elements.
  std::vector<int> first(10);
  for (std::uint64_t epoch = 0; epoch < 5000; ++epoch) ++first[epoch_permutation(10, 3, epoch)[0]];
  for (int n : first) {
    CHECK(n > 400);
    CHECK(n < 600);
  }
}

TEST_CASE("a loader cuts each epoch of the seeded order into global batches", "[nn][data][loader]") {
  const dataset ds = numbered(103);
  for (bool drop_last : {true, false}) {
    data_loader loader(ds, {.global_batch = 8, .seed = 42, .drop_last = drop_last});
    CHECK(loader.steps_per_epoch() == (drop_last ? 12u : 13u));
    for (std::size_t epoch : {0u, 3u, 0u}) {
      const auto batches = drain_epoch(loader, epoch);
      REQUIRE(batches.size() == loader.steps_per_epoch());
      const auto order = epoch_permutation(103, 42, epoch);
      std::vector<std::size_t> seen;
      for (std::size_t s = 0; s < batches.size(); ++s) {
        const batch& b = batches[s];
        CHECK(b.step == s);
        CHECK(b.epoch == epoch);
        CHECK(b.global_offset == 0);
        CHECK(b.global_rows == (s < 12 ? 8u : 7u));
        CHECK(b.rows == b.global_rows);
        const auto ex = examples_of(b);
        seen.insert(seen.end(), ex.begin(), ex.end());
      }
      const std::vector<std::size_t> expected(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(seen.size()));
      CHECK(seen == expected);
      CHECK(seen.size() == (drop_last ? 96u : 103u));
    }
  }
  SECTION("shuffle = false keeps file order") {
    data_loader loader(ds, {.global_batch = 10, .shuffle = false});
    const auto batches = drain_epoch(loader, 4);
    std::vector<std::size_t> seen;
    for (const auto& b : batches) {
      const auto ex = examples_of(b);
      seen.insert(seen.end(), ex.begin(), ex.end());
    }
    std::vector<std::size_t> expected(100);
    std::iota(expected.begin(), expected.end(), std::size_t{0});
    CHECK(seen == expected);
  }
}

TEST_CASE("the processes' shares of each global batch reassemble it", "[nn][data][loader]") {
  const dataset ds = numbered(203, 2);
  for (bool drop_last : {true, false}) {
    data_loader whole(ds, {.global_batch = 24, .seed = 7, .drop_last = drop_last, .prefetch = 0});
    const auto global = drain_epoch(whole, 2);
    for (std::size_t n : {1u, 2u, 3u, 4u, 6u, 8u, 24u}) {
      std::vector<std::vector<batch>> shares;
      for (std::size_t p = 0; p < n; ++p) {
        data_loader loader(ds, {.global_batch = 24, .seed = 7, .drop_last = drop_last,
                                .process_index = p, .process_count = n});
        CHECK(loader.steps_per_epoch() == whole.steps_per_epoch());
        shares.push_back(drain_epoch(loader, 2));
      }
      for (std::size_t s = 0; s < global.size(); ++s) {
        INFO("processes " << n << ", step " << s << ", drop_last " << drop_last);
        std::vector<std::size_t> assembled;
        std::size_t offset = 0;
        for (std::size_t p = 0; p < n; ++p) {
          const batch& b = shares[p].at(s);
          CHECK(b.global_offset == offset);
          CHECK(b.global_rows == global[s].global_rows);
          // Full batches split evenly; a last, short one (drop_last = false) in floor(p*g/n) cuts.
          CHECK(b.rows == (p + 1) * b.global_rows / n - p * b.global_rows / n);
          offset += b.rows;
          const auto ex = examples_of(b);
          assembled.insert(assembled.end(), ex.begin(), ex.end());
        }
        CHECK(assembled == examples_of(global[s]));
      }
    }
  }
}

TEST_CASE("prefetched batches are the sequential ones, value for value", "[nn][data][loader]") {
  const dataset ds = numbered(157, 5);
  data_loader sequential(ds, {.global_batch = 12, .seed = 99, .drop_last = false, .process_index = 1,
                              .process_count = 3, .prefetch = 0});
  CHECK_FALSE(sequential.prefetching());
  for (std::size_t prefetch : {1u, 2u, 3u, 20u}) {
    data_loader ahead(ds, {.global_batch = 12, .seed = 99, .drop_last = false, .process_index = 1,
                           .process_count = 3, .prefetch = prefetch});
#if defined(MESHLIB_ENABLE_TBB)
    CHECK(ahead.prefetching());
#else
    CHECK_FALSE(ahead.prefetching());  // without oneTBB every loader is sequential
#endif
    for (std::size_t epoch : {0u, 1u, 1u, 8u}) {
      const auto a = drain_epoch(sequential, epoch);
      const auto b = drain_epoch(ahead, epoch);
      REQUIRE(a.size() == b.size());
      for (std::size_t s = 0; s < a.size(); ++s) REQUIRE(same(a[s], b[s]));
    }
    // Abandoning an epoch half-way and starting another drops the batches prefetched for it.
    ahead.start_epoch(4);
    const auto first = ahead.next();
    REQUIRE(first.has_value());
    (void)ahead.next();
    const auto again = drain_epoch(ahead, 4);
    REQUIRE(same(again.front(), *first));
    const auto reference = drain_epoch(sequential, 5);
    const auto fifth = drain_epoch(ahead, 5);
    for (std::size_t s = 0; s < reference.size(); ++s) REQUIRE(same(reference[s], fifth[s]));
  }
  // A loader destroyed with batches in flight waits for them (nothing reads a dead loader).
  for (int i = 0; i < 20; ++i) {
    data_loader loader(ds, {.global_batch = 4, .seed = static_cast<std::uint64_t>(i), .prefetch = 8});
    loader.start_epoch(0);
  }
}

TEST_CASE("loader options that cannot batch the data set are data_errors", "[nn][data][loader][errors]") {
  const dataset ds = numbered(10);
  auto error_of = [](const dataset& d, loader_options o) {
    return message_of<meshlib::data_error>([&] { data_loader loader(d, o); });
  };
  CHECK(error_of(ds, {.global_batch = 0}) == "meshlib: data_loader: global_batch is 0, expected at least 1");
  CHECK(error_of(ds, {.global_batch = 4, .process_count = 0}) ==
        "meshlib: data_loader: process_count is 0, expected at least 1");
  CHECK(error_of(ds, {.global_batch = 4, .process_index = 2, .process_count = 2}) ==
        "meshlib: data_loader: process_index 2 is out of range for process_count 2");
  CHECK(error_of(ds, {.global_batch = 9, .process_index = 0, .process_count = 2}) ==
        "meshlib: data_loader: global batch 9 does not split evenly over 2 processes (remainder 1); "
        "choose a global batch divisible by the process count");
  CHECK(error_of(ds, {.global_batch = 16}) ==
        "meshlib: data_loader: an epoch has no batch: the dataset has 10 examples, fewer than the global "
        "batch of 16 (with drop_last; set drop_last = false to keep them)");
  CHECK(data_loader(ds, {.global_batch = 16, .drop_last = false}).steps_per_epoch() == 1);
  CHECK(error_of(numbered(0), {.global_batch = 1, .drop_last = false}) ==
        "meshlib: data_loader: an epoch has no batch: the dataset has 0 examples, fewer than the global batch of 1");
  dataset broken = numbered(10);
  broken.y.pop_back();
  CHECK(error_of(broken, {.global_batch = 2}) ==
        "meshlib: data_loader: the dataset is inconsistent: count 10 and features 3 need 30 values and 10 "
        "labels, found 30 and 9");
  data_loader loader(ds, {.global_batch = 2});
  CHECK(message_of<meshlib::data_error>([&] { (void)loader.next(); }) ==
        "meshlib: data_loader: next() called before start_epoch(epoch)");
}

TEST_CASE("a loader built from a temporary dataset owns it", "[nn][data][loader]") {
  const dataset reference = numbered(50, 4);
  data_loader kept(reference, {.global_batch = 10, .seed = 3});
  data_loader owning(numbered(50, 4), {.global_batch = 10, .seed = 3});  // the temporary is moved in
  CHECK(&kept.data() == &reference);
  CHECK(owning.data().count == 50);
  for (std::size_t epoch : {0u, 1u}) {
    const auto a = drain_epoch(kept, epoch);
    const auto b = drain_epoch(owning, epoch);
    REQUIRE(a.size() == b.size());
    for (std::size_t s = 0; s < a.size(); ++s) {
      REQUIRE(same(a[s], b[s]));
      (void)examples_of(b[s]);
    }
  }
}

}  // namespace MESHLIB_TEST_UNIT
