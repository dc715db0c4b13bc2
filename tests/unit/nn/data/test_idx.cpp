// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The IDX reader and the Fashion-MNIST loader: values read back from hand-written files, and every
// defect of a file gives a data_error whose message names the file and what was expected and found.
#include <array>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "idx_files.hpp"
#include "meshlib/nn/data.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using meshlib_test::bytes;
using meshlib_test::idx_images;
using meshlib_test::idx_labels;
using meshlib_test::message_of;
using meshlib_test::temp_dir;
using meshlib_test::write_file;

namespace {

/// Checks `ds` holds the test images of `rows` x `cols` (pixel / 255) and `labels`.
void check_dataset(const meshlib::nn::dataset& ds, std::size_t rows, std::size_t cols,
                   const std::vector<std::uint8_t>& labels) {
  REQUIRE(ds.count == labels.size());
  REQUIRE(ds.features == rows * cols);
  REQUIRE(ds.x.size() == ds.count * ds.features);
  REQUIRE(ds.y.size() == ds.count);
  for (std::size_t i = 0; i < ds.count; ++i) {
    CHECK(ds.y[i] == static_cast<std::int32_t>(labels[i]));
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) {
        const float expected = static_cast<float>(meshlib_test::test_pixel(i, r, c, rows, cols)) / 255.0f;
        REQUIRE(ds.row(i)[r * cols + c] == expected);
      }
  }
}

std::string q(const std::filesystem::path& p) { return "'" + p.string() + "'"; }

}  // namespace

TEST_CASE("read_idx reads images scaled to [0, 1] and labels", "[nn][data][idx]") {
  temp_dir dir("idx_good");
  const std::vector<std::uint8_t> labels{3, 0, 9, 4, 4, 1, 7};
  write_file(dir / "images", idx_images(labels.size(), 5, 3));
  write_file(dir / "labels", idx_labels(labels));

  const auto inferred = meshlib::nn::read_idx(dir / "images", dir / "labels");
  check_dataset(inferred, 5, 3, labels);
  CHECK(inferred.classes == 10);  // largest label 9, + 1

  const auto given = meshlib::nn::read_idx(dir / "images", dir / "labels", 12);
  check_dataset(given, 5, 3, labels);
  CHECK(given.classes == 12);

  // 105 pixels include 0 and 255 (position 73), read as 0 and 1 exactly.
  float lo = 1, hi = 0;
  for (float v : inferred.x) lo = std::min(lo, v), hi = std::max(hi, v);
  CHECK(lo == 0.0f);
  CHECK(hi == 1.0f);

  // An empty but well-formed pair is an empty data set.
  write_file(dir / "no_images", idx_images(0, 28, 28));
  write_file(dir / "no_labels", idx_labels({}));
  const auto empty = meshlib::nn::read_idx(dir / "no_images", dir / "no_labels", 10);
  CHECK(empty.count == 0);
  CHECK(empty.features == 784);
  CHECK(empty.x.empty());
}

#if defined(MESHLIB_ENABLE_ZLIB)
TEST_CASE("read_idx reads gzip-compressed files as the plain ones", "[nn][data][idx]") {
  temp_dir dir("idx_gz");
  const std::vector<std::uint8_t> labels{1, 2, 0, 2};
  write_file(dir / "images.gz", meshlib_test::gzip(idx_images(labels.size(), 4, 6), dir / "scratch"));
  write_file(dir / "labels.gz", meshlib_test::gzip(idx_labels(labels), dir / "scratch"));
  check_dataset(meshlib::nn::read_idx(dir / "images.gz", dir / "labels.gz", 3), 4, 6, labels);

  // A compressed stream cut short is a truncated gzip file, not a short IDX file.
  bytes gz = meshlib_test::gzip(idx_images(labels.size(), 4, 6), dir / "scratch");
  gz.resize(gz.size() / 2);
  write_file(dir / "cut.gz", gz);
  const std::string msg = message_of<meshlib::data_error>(
      [&] { (void)meshlib::nn::read_idx(dir / "cut.gz", dir / "labels.gz"); });
  CHECK(msg.rfind("meshlib: IDX file " + q(dir / "cut.gz") + " is a truncated gzip file (the compressed stream ends early after ", 0) == 0);
}
#else
TEST_CASE("without zlib, a gzip-compressed file says how to read it", "[nn][data][idx]") {
  temp_dir dir("idx_gz");
  write_file(dir / "images.gz", bytes{0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00});
  write_file(dir / "labels", idx_labels({1}));
  CHECK(message_of<meshlib::data_error>([&] { (void)meshlib::nn::read_idx(dir / "images.gz", dir / "labels"); }) ==
        "meshlib: IDX file " + q(dir / "images.gz") +
            " is gzip-compressed, but this meshlib was built without zlib; decompress it (gunzip) "
            "or rebuild with zlib (Debian: zlib1g-dev)");
}
#endif

TEST_CASE("read_idx names the file and the defect of every malformed input", "[nn][data][idx][errors]") {
  temp_dir dir("idx_bad");
  const std::vector<std::uint8_t> labels{0, 1, 2, 3};
  const auto good_images = dir / "images";
  const auto good_labels = dir / "labels";
  write_file(good_images, idx_images(4, 2, 2));
  write_file(good_labels, idx_labels(labels));
  auto error_of = [](const std::filesystem::path& images, const std::filesystem::path& labels,
                     std::optional<std::size_t> classes = std::nullopt) {
    return message_of<meshlib::data_error>([&] { (void)meshlib::nn::read_idx(images, labels, classes); });
  };
  auto written = [&](const std::string& name, const bytes& b) {
    write_file(dir / name, b);
    return dir / name;
  };

  SECTION("a missing file") {
    CHECK(error_of(dir / "nope", good_labels) == "meshlib: IDX file " + q(dir / "nope") + " does not exist");
    CHECK(error_of(good_images, dir / "nope") == "meshlib: IDX file " + q(dir / "nope") + " does not exist");
  }
  SECTION("a directory instead of a file") {
    CHECK(error_of(dir.path(), good_labels) ==
          "meshlib: IDX file " + q(dir.path()) + " is a directory, expected a file");
  }
  SECTION("too short for the magic number") {
    const auto f = written("short", bytes{0x00, 0x00});
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) + " is 2 bytes long, too short for the 4-byte magic number 0x00000803");
  }
  SECTION("not an IDX file") {
    const auto f = written("text", bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd', '!', '!', '!', '!', '!'});
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) +
              " has magic number 0x68656C6C, expected 0x00000803 (unsigned bytes, 3 dimensions: count, rows, columns)");
  }
  SECTION("labels and images swapped: the wrong number of dimensions") {
    CHECK(error_of(good_labels, good_images) ==
          "meshlib: IDX file " + q(good_labels) +
              " has magic number 0x00000801, expected 0x00000803 (unsigned bytes, 3 dimensions: count, rows, columns)");
    bytes b = idx_images(4, 2, 2);
    const auto f = written("labels3d", b);
    CHECK(error_of(good_images, f) ==
          "meshlib: IDX file " + q(f) + " has magic number 0x00000803, expected 0x00000801 (unsigned bytes, 1 dimensions: count)");
  }
  SECTION("elements that are not unsigned bytes") {
    bytes b = idx_images(4, 2, 2);
    b[2] = 0x0D;  // float
    const auto f = written("floats", b);
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) +
              " has magic number 0x00000D03, expected 0x00000803 (unsigned bytes, 3 dimensions: count, rows, columns)");
  }
  SECTION("a header cut short") {
    bytes b = idx_images(4, 2, 2);
    b.resize(10);
    const auto f = written("header", b);
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) + " is truncated: 10 bytes, shorter than its 16-byte header");
  }
  SECTION("pixels cut short") {
    bytes b = idx_images(4, 2, 2);
    b.pop_back();
    const auto f = written("pixels", b);
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) +
              " is truncated: its header promises 4 x 2 x 2 bytes (count, rows, columns), so 32 bytes in all, but it has 31");
  }
  SECTION("dimensions whose product overflows 64 bits (2^22 x 2^21 x 2^21 wraps to 0)") {
    bytes b;
    meshlib_test::put32(b, 0x00000803);
    meshlib_test::put32(b, 1u << 22);
    meshlib_test::put32(b, 1u << 21);
    meshlib_test::put32(b, 1u << 21);
    REQUIRE(b.size() == 16);  // header only: the wrapped count 0 would match the file's size
    const auto f = written("overflow", b);
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) +
              " has a corrupted header: it promises 4194304 x 2097152 x 2097152 bytes (count, rows, columns), a count "
              "that does not fit in 64 bits, but the file has 16 bytes; it is not an IDX file or its header is damaged");
    // Every split of the same overflowing product over the three dimensions, and the largest header.
    for (const auto& dims : {std::array<std::uint32_t, 3>{1u << 21, 1u << 22, 1u << 21},
                             std::array<std::uint32_t, 3>{1u << 21, 1u << 21, 1u << 22},
                             std::array<std::uint32_t, 3>{0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}}) {
      bytes h;
      meshlib_test::put32(h, 0x00000803);
      for (auto d : dims) meshlib_test::put32(h, d);
      const auto g = written("overflow2", h);
      CHECK(error_of(g, good_labels).find("has a corrupted header: it promises " + std::to_string(dims[0]) + " x " +
                                          std::to_string(dims[1]) + " x " + std::to_string(dims[2]) + " bytes") !=
            std::string::npos);
    }
  }
  SECTION("a count that fits in 64 bits but exceeds the file, refused before anything is allocated") {
    bytes b;
    meshlib_test::put32(b, 0x00000803);
    meshlib_test::put32(b, 1u << 31);
    meshlib_test::put32(b, 1u << 16);
    meshlib_test::put32(b, 1u << 15);  // 2^62 pixels: std::bad_alloc if anything were sized by it
    b.push_back(7);
    const auto f = written("huge", b);
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) +
              " is truncated: its header promises 2147483648 x 65536 x 32768 bytes (count, rows, columns), so "
              "4611686018427387920 bytes in all, but it has 17");
  }
  SECTION("bytes after the data") {
    bytes b = idx_labels(labels);
    b.push_back(0);
    b.push_back(0);
    const auto f = written("long", b);
    CHECK(error_of(good_images, f) ==
          "meshlib: IDX file " + q(f) +
              " is too long: its header promises 4 bytes (count), so 12 bytes in all, but it has 14");
  }
  SECTION("label and image counts that disagree") {
    const auto f = written("three", idx_labels({0, 1, 2}));
    CHECK(error_of(good_images, f) == "meshlib: IDX files disagree: " + q(good_images) +
                                          " holds 4 images but " + q(f) + " holds 3 labels");
  }
  SECTION("a label outside the classes") {
    const auto f = written("big", idx_labels({0, 1, 10, 3}));
    CHECK(error_of(good_images, f, 10) ==
          "meshlib: IDX file " + q(f) + ": label 10 at index 2 is out of range, expected 0..9 (10 classes)");
    CHECK(meshlib::nn::read_idx(good_images, f).classes == 11);  // without a bound it is a class
  }
  SECTION("images of no pixels") {
    const auto f = written("flat", idx_images(4, 0, 5));
    CHECK(error_of(f, good_labels) ==
          "meshlib: IDX file " + q(f) + " has images of 0 x 5 pixels, expected at least 1 x 1");
  }
  SECTION("zero classes") {
    CHECK(error_of(good_images, good_labels, 0) == "meshlib: read_idx: classes is 0, expected at least 1");
  }
  SECTION("data_error is a meshlib::error") {
    CHECK_THROWS_AS(meshlib::nn::read_idx(dir / "nope", good_labels), meshlib::error);
  }
}

TEST_CASE("load_fashion_mnist finds plain or .gz files and says which package provides them", "[nn][data][fashion_mnist]") {
  temp_dir dir("fmnist");
  SECTION("an empty directory names the file and the package") {
    const auto plain = dir / "train-images-idx3-ubyte";
    CHECK(message_of<meshlib::data_error>([&] { (void)meshlib::nn::load_fashion_mnist(dir.path()); }) ==
          "meshlib: Fashion-MNIST: neither " + q(plain) + " nor " + q(dir / "train-images-idx3-ubyte.gz") +
              " exists; install Debian's package dataset-fashion-mnist (apt-get install dataset-fashion-mnist, "
              "files under /usr/share/datasets/fashion-mnist) or give the directory that holds the four IDX files");
  }
  SECTION("uncompressed files of 28 x 28 images load, labels checked against 10 classes") {
    write_file(dir / "train-images-idx3-ubyte", idx_images(3, 28, 28));
    write_file(dir / "train-labels-idx1-ubyte", idx_labels({9, 0, 5}));
    write_file(dir / "t10k-images-idx3-ubyte", idx_images(2, 28, 28));
    write_file(dir / "t10k-labels-idx1-ubyte", idx_labels({1, 2}));
    const auto data = meshlib::nn::load_fashion_mnist(dir.path());
    check_dataset(data.train, 28, 28, {9, 0, 5});
    check_dataset(data.test, 28, 28, {1, 2});
    CHECK(data.train.classes == 10);
    CHECK(data.test.classes == 10);

    write_file(dir / "t10k-labels-idx1-ubyte", idx_labels({1, 12}));
    CHECK(message_of<meshlib::data_error>([&] { (void)meshlib::nn::load_fashion_mnist(dir.path()); }) ==
          "meshlib: IDX file " + q(dir / "t10k-labels-idx1-ubyte") +
              ": label 12 at index 1 is out of range, expected 0..9 (10 classes)");
  }
  SECTION("images of another size are not Fashion-MNIST") {
    write_file(dir / "train-images-idx3-ubyte", idx_images(2, 4, 4));
    write_file(dir / "train-labels-idx1-ubyte", idx_labels({1, 2}));
    CHECK(message_of<meshlib::data_error>([&] { (void)meshlib::nn::load_fashion_mnist(dir.path()); }) ==
          "meshlib: IDX file " + q(dir / "train-images-idx3-ubyte") +
              " holds images of 16 pixels, expected Fashion-MNIST's 28 x 28 = 784");
  }
}

TEST_CASE("the installed Fashion-MNIST: 60000 + 10000 images of 784 pixels, 10 balanced classes", "[nn][data][fashion_mnist]") {
  const auto dir = meshlib::nn::default_fashion_mnist_dir();
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte.gz") &&
      !std::filesystem::exists(dir / "train-images-idx3-ubyte")) {
    std::cout << "SKIPPED: Fashion-MNIST is not installed under " << dir.string()
              << " (Debian package dataset-fashion-mnist; scripts/install_deps.sh installs it)\n";
    WARN("Fashion-MNIST not installed under " << dir.string() << ": real-data checks skipped");
    return;
  }
#if !defined(MESHLIB_ENABLE_ZLIB)
  if (!std::filesystem::exists(dir / "train-images-idx3-ubyte")) {
    std::cout << "SKIPPED: Fashion-MNIST under " << dir.string() << " is gzip-compressed and this build has no zlib\n";
    WARN("no zlib: real-data checks skipped");
    return;
  }
#endif
  const auto data = meshlib::nn::load_fashion_mnist(dir);
  CHECK(data.train.count == 60000);
  CHECK(data.test.count == 10000);
  CHECK(data.train.features == 784);
  CHECK(data.test.features == 784);
  CHECK(data.train.classes == 10);
  std::array<std::size_t, 10> train_hist{}, test_hist{};
  for (auto y : data.train.y) ++train_hist.at(static_cast<std::size_t>(y));
  for (auto y : data.test.y) ++test_hist.at(static_cast<std::size_t>(y));
  for (std::size_t c = 0; c < 10; ++c) {
    CHECK(train_hist[c] == 6000);
    CHECK(test_hist[c] == 1000);
  }
  // Zalando's published first labels: 9 (ankle boot), 0 (T-shirt/top), 0, 3 (dress), 0.
  CHECK(data.train.y[0] == 9);
  CHECK(data.train.y[1] == 0);
  CHECK(data.train.y[3] == 3);
  CHECK(data.test.y[0] == 9);
  // Pixel sums computed from the .gz files with Python's gzip module: 3431114169 over the training
  // images, 76247 in the first one.
  std::uint64_t total = 0, first = 0, outside = 0;
  for (std::size_t i = 0; i < data.train.x.size(); ++i) {
    const float v = data.train.x[i];
    outside += (v < 0.0f || v > 1.0f);
    const auto byte = static_cast<std::uint64_t>(v * 255.0f + 0.5f);
    total += byte;
    if (i < 784) first += byte;
  }
  CHECK(outside == 0);
  CHECK(total == 3431114169u);
  CHECK(first == 76247u);
}

}  // namespace MESHLIB_TEST_UNIT
