// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Plain text for byte-level language models (nn/data/text.hpp, text_windows.hpp, byte_ngram.hpp).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "meshlib/nn/data.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace fs = std::filesystem;
using meshlib::data_error;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;

namespace {
struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& name) : path(fs::temp_directory_path() / ("meshlib_text_" + name)) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path / name, std::ios::binary) << text; }
};

std::string as_string(const std::vector<std::uint8_t>& b) { return {b.begin(), b.end()}; }
}  // namespace

TEST_CASE("load_text: a directory's files without extension, in name order", "[text]") {
  temp_dir d("dir");
  d.write("b", "BBB");
  d.write("a", "AA\n");
  d.write("a.dat", "index, not text");
  d.write(".hidden", "not read");
  fs::create_directory(d.path / "sub");  // a directory is not read
  fs::create_symlink(d.path / "a", d.path / "a.u8");  // fortunes' .u8 links: the same text, read once
  const auto c = meshlib::nn::load_text(d.path);
  CHECK(as_string(c.bytes) == "AA\nBBB");
  REQUIRE(c.files.size() == 2);
  CHECK(c.files[0].filename() == "a");
  CHECK(c.files[1].filename() == "b");
  // A file is read as it is, whatever its name.
  CHECK(as_string(meshlib::nn::load_text(d.path / "a.dat").bytes) == "index, not text");
}

TEST_CASE("load_text: what cannot be read is a data_error naming the path and the fix", "[text]") {
  temp_dir d("errors");
  const fs::path missing = d.path / "nope";
  CHECK_THROWS_MATCHES(meshlib::nn::load_text(missing), data_error,
                       Catch::Matchers::Message("meshlib::nn::load_text: " + missing.string() +
                                                " does not exist; give a text file or a directory of text files "
                                                "(Debian's fortunes: apt-get install fortunes, text under "
                                                "/usr/share/games/fortunes; scripts/install_deps.sh installs it)"));
  d.write("only.dat", "x");
  CHECK_THROWS_MATCHES(meshlib::nn::load_text(d.path), data_error,
                       Catch::Matchers::Message("meshlib::nn::load_text: " + d.path.string() +
                                                " holds no text file (a regular file whose name has no extension); "
                                                "give a file or such a directory"));
  d.write("empty", "");
  CHECK_THROWS_MATCHES(meshlib::nn::load_text(d.path), data_error,
                       Catch::Matchers::Message("meshlib::nn::load_text: " + d.path.string() + " holds no text (0 bytes)"));
}

TEST_CASE("split_text: the last fraction is held out", "[text]") {
  meshlib::nn::text_corpus c;
  for (int i = 0; i < 100; ++i) c.bytes.push_back(static_cast<std::uint8_t>(i));
  const auto s = meshlib::nn::split_text(c, 0.1);
  REQUIRE(s.train.size() == 90);
  REQUIRE(s.validation.size() == 10);
  CHECK(s.train.front() == 0);
  CHECK(s.train.back() == 89);
  CHECK(s.validation.front() == 90);
  CHECK(s.validation.back() == 99);
  CHECK_THROWS_MATCHES(meshlib::nn::split_text(c, 1.0), data_error,
                       Catch::Matchers::Message("meshlib::nn::split_text: holdout 1.000000 is not a fraction in (0, 1); "
                                                "0.1 holds out the last 10%"));
  CHECK_THROWS_MATCHES(meshlib::nn::split_text(c, 0.1, 65), data_error,
                       Catch::Matchers::Message("meshlib::nn::split_text: 100 bytes split 90 / 10 leaves a part shorter "
                                                "than 65 bytes (one window: context + 1); give more text or a shorter context"));
}

TEST_CASE("sample_windows: targets are the inputs shifted by one, starts cover the text, reproducible", "[text]") {
  std::vector<std::uint8_t> text(100);
  for (int i = 0; i < 100; ++i) text[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);  // byte = position
  const std::size_t rows = 2000, context = 10;
  const auto b = meshlib::nn::sample_windows(text, rows, context, meshlib::nn::rng_key{7});
  REQUIRE(b.inputs.size() == rows * context);
  std::set<int> starts;
  for (std::size_t r = 0; r < rows; ++r) {
    const int s = b.inputs[r * context];
    REQUIRE(s >= 0);
    REQUIRE(s + static_cast<int>(context) + 1 <= 100);  // the last target is still in the text
    for (std::size_t t = 0; t < context; ++t) {
      REQUIRE(b.inputs[r * context + t] == s + static_cast<int>(t));
      REQUIRE(b.targets[r * context + t] == s + static_cast<int>(t) + 1);
    }
    starts.insert(s);
  }
  CHECK(starts.size() == 90);  // every start 0 .. 89 drawn at least once in 2000 windows
  const auto again = meshlib::nn::sample_windows(text, rows, context, meshlib::nn::rng_key{7});
  CHECK(again.inputs == b.inputs);
  const auto other = meshlib::nn::sample_windows(text, rows, context, meshlib::nn::rng_key{7}.fold_in(1));
  CHECK(other.inputs != b.inputs);
  CHECK_THROWS_MATCHES(meshlib::nn::sample_windows(std::span(text).first(10), 4, 10, meshlib::nn::rng_key{}), data_error,
                       Catch::Matchers::Message("meshlib::nn::sample_windows: a window needs context + 1 = 11 bytes, the "
                                                "text has 10; give more text or a shorter context"));
}

TEST_CASE("tile_windows: consecutive windows in order", "[text]") {
  std::vector<std::uint8_t> text(25);
  for (int i = 0; i < 25; ++i) text[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
  CHECK(meshlib::nn::count_windows(text, 8) == 3);  // targets 1..24 in three windows of 8
  const auto b = meshlib::nn::tile_windows(text, 8, 1, 2);
  CHECK(b.inputs.front() == 8);
  CHECK(b.targets.back() == 24);
  CHECK_THROWS_MATCHES(meshlib::nn::tile_windows(text, 8, 2, 2), data_error,
                       Catch::Matchers::Message("meshlib::nn::tile_windows: windows 2 .. 3 asked, the text has 3 windows of 8 tokens"));
}

TEST_CASE("n-gram baselines: add-one smoothing over 256 bytes, by hand", "[text]") {
  const std::vector<std::uint8_t> train{'a', 'a', 'b'}, held{'a', 'b'};
  // unigram: count(a) = 2, count(b) = 1, total 3 + 256
  CHECK(meshlib::nn::unigram_nats(train, held) ==
        Approx(-(std::log(3.0 / 259.0) + std::log(2.0 / 259.0)) / 2.0).epsilon(1e-12));
  // bigram: pairs (a,a), (a,b); from(a) = 2: p(b | a) = (1 + 1) / (2 + 256)
  CHECK(meshlib::nn::bigram_nats(train, held) == Approx(-std::log(2.0 / 258.0)).epsilon(1e-12));
  CHECK_THROWS_MATCHES(meshlib::nn::bigram_nats(train, std::span(held).first(1)), data_error,
                       Catch::Matchers::Message("meshlib::nn::bigram_nats: the held-out text has fewer than 2 bytes"));
}

TEST_CASE("fortunes: the corpus and the baselines the language-model flagship prints", "[text]") {
  const fs::path dir = "/usr/share/games/fortunes";
  if (!fs::exists(dir))
    FAIL("Debian's fortunes is not installed (scripts/install_deps.sh installs it: apt-get install fortunes)");
  const auto c = meshlib::nn::load_text(dir);
  CHECK(c.bytes.size() > 2'000'000);
  const auto s = meshlib::nn::split_text(c, 0.1);
  // The baselines issue 25 quotes for this split, to two decimals: unigram 3.37, bigram 2.62 nats per
  // byte (3.3757 and 2.62 here).
  CHECK(meshlib::nn::unigram_nats(s.train, s.validation) == Approx(3.37).margin(0.01));
  CHECK(meshlib::nn::bigram_nats(s.train, s.validation) == Approx(2.62).margin(0.01));
}

}  // namespace MESHLIB_TEST_UNIT
