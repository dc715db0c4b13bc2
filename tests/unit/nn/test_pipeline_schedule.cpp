// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Pipeline schedules (nn/parallel/pipeline_schedule.hpp): the timelines, the bubble against the closed form
// (p - 1) / (m + p - 1), activations in flight, and every dependency checked step by step.
#include <catch2/catch.hpp>

#include <cstddef>
#include <string>
#include <vector>

#include "meshlib/nn/parallel/pipeline_schedule.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using meshlib::nn::pipeline_costs;
using meshlib::nn::pipeline_pass;
using meshlib::nn::pipeline_schedule;

namespace {
// Each stage runs every micro-batch's forward and backward once, one step at a time, and no step
// starts before its input can have arrived.
void check_dependencies(const pipeline_schedule& s, const pipeline_costs& c) {
  const std::size_t p = s.stages(), m = s.microbatches();
  std::vector<std::vector<const meshlib::nn::pipeline_step*>> f(p, std::vector<const meshlib::nn::pipeline_step*>(m)), b = f;
  for (std::size_t st = 0; st < p; ++st) {
    REQUIRE(s.steps(st).size() == 2 * m);
    std::size_t free_at = 0;
    for (const auto& x : s.steps(st)) {
      REQUIRE(x.start >= free_at);
      REQUIRE(x.end - x.start == (x.pass == pipeline_pass::forward ? c.forward : c.backward));
      free_at = x.end;
      auto& slot = (x.pass == pipeline_pass::forward ? f : b)[st][x.microbatch];
      REQUIRE(slot == nullptr);
      slot = &x;
    }
  }
  for (std::size_t st = 0; st < p; ++st)
    for (std::size_t i = 0; i < m; ++i) {
      if (st > 0) REQUIRE(f[st][i]->start >= f[st - 1][i]->end + c.send);
      if (st + 1 < p) REQUIRE(b[st][i]->start >= b[st + 1][i]->end + c.send);
      REQUIRE(b[st][i]->start >= f[st][i]->end);
    }
}
}  // namespace

TEST_CASE("pipeline schedules print as timelines", "[pipeline]") {
  const pipeline_costs unit{.forward = 1, .backward = 1};
  CHECK(pipeline_schedule::gpipe(2, 2, unit).timeline() ==
        "GPipe, 2 stages x 2 micro-batches (forward 1, backward 1, send 0), bubble 33.3%\n"
        "stage 0 | F0 F1 .. .. B0 B1\n"
        "stage 1 | .. F0 F1 B0 B1 ..\n");
  CHECK(pipeline_schedule::one_f_one_b(3, 4, unit).timeline() ==
        "1F1B, 3 stages x 4 micro-batches (forward 1, backward 1, send 0), bubble 33.3%\n"
        "stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3\n"
        "stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..\n"
        "stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..\n");
  // A backward of two units fills two columns; two-digit micro-batches widen every column.
  const std::string t = pipeline_schedule::gpipe(1, 11).timeline();
  CHECK(t.find("stage 0 | F0  F1  F2  F3  F4  F5  F6  F7  F8  F9  F10 B0  B0  B1  B1  B2 ") != std::string::npos);
}

TEST_CASE("the bubble of both schedules is (p - 1) / (m + p - 1) with uniform costs", "[pipeline]") {
  for (const pipeline_costs c : {pipeline_costs{1, 1}, pipeline_costs{1, 2}, pipeline_costs{2, 3}})
    for (std::size_t p = 1; p <= 6; ++p)
      for (std::size_t m = 1; m <= 12; ++m) {
        CAPTURE(p, m, c.forward, c.backward);
        for (const auto& s : {pipeline_schedule::gpipe(p, m, c), pipeline_schedule::one_f_one_b(p, m, c)}) {
          CAPTURE(s.name());
          check_dependencies(s, c);
          CHECK(s.makespan() == (m + p - 1) * (c.forward + c.backward));
          CHECK(s.bubble_fraction() == Approx(pipeline_schedule::ideal_bubble(p, m)).margin(1e-12));
        }
      }
}

TEST_CASE("1F1B holds at most stages - stage micro-batches, GPipe all of them", "[pipeline]") {
  const std::size_t p = 4, m = 8;
  const auto g = pipeline_schedule::gpipe(p, m), f = pipeline_schedule::one_f_one_b(p, m);
  for (std::size_t s = 0; s < p; ++s) {
    CHECK(g.peak_in_flight(s) == m);
    CHECK(f.peak_in_flight(s) == p - s);
  }
  CHECK(pipeline_schedule::one_f_one_b(4, 2).peak_in_flight(0) == 2);  // fewer micro-batches than stages
}

TEST_CASE("a send between stages delays each hop", "[pipeline]") {
  const pipeline_costs c{.forward = 1, .backward = 1, .send = 1};
  const auto s = pipeline_schedule::gpipe(2, 1, c);
  check_dependencies(s, c);
  // stage 0 F0 [0, 1), send, stage 1 F0 [2, 3), B0 [3, 4), send, stage 0 B0 [5, 6)
  CHECK(s.steps(1)[0].start == 2);
  CHECK(s.steps(0)[1].start == 5);
  CHECK(s.makespan() == 6);
  CHECK(s.bubble_fraction() > pipeline_schedule::ideal_bubble(2, 1));
}

TEST_CASE("pipeline schedules refuse empty pipelines and free steps", "[pipeline]") {
  CHECK_THROWS_MATCHES(pipeline_schedule::gpipe(0, 4), meshlib::sharding_error,
                       Catch::Matchers::Message("meshlib::nn::pipeline_schedule::gpipe: 0 stages x 4 micro-batches; a "
                                                "pipeline needs at least one of each"));
  CHECK_THROWS_MATCHES(pipeline_schedule::one_f_one_b(2, 2, {.forward = 1, .backward = 0}), meshlib::sharding_error,
                       Catch::Matchers::Message("meshlib::nn::pipeline_schedule::one_f_one_b: forward and backward costs "
                                                "must be at least 1 time unit (forward 1, backward 0)"));
}

}  // namespace MESHLIB_TEST_UNIT
