// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// What the flagships' command lines share (train_fashion_mnist, train_resnet_fashion_mnist,
// train_gpt_chars): the usage error (argparse's exit status 2), the parsers of numbers and mesh
// shapes, and the defaults chosen for the machine (mesh, threads per device), written once so that
// all of them accept and refuse the same spellings with the same messages.

#include <cmath>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

#include "meshlib/exec/available_cores.hpp"
#include "meshlib/nn/number_text.hpp"

namespace flagship {

/// A number as the user wrote it (`--lr 1e-5` prints `lr 1e-5`, not `1e-05` or `0.000010`): the
/// library's formatter, so the flagships' lines and the library's names (`adamw(weight decay 0.01)`)
/// read alike.
using meshlib::nn::detail::number_text;

/// A mistake in the options: main prints the usage line and the message before anything is
/// loaded, and exits with status 2.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// `v` as a whole non-negative integer (no sign, no trailing characters, no overflow), else nothing.
inline std::optional<std::size_t> whole_number(const std::string& v) {
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  return n;
}

/// The value of `option` as a positive integer.
inline std::size_t positive_integer(const std::string& option, const std::string& v) {
  const auto n = whole_number(v);
  if (!n || *n == 0) throw usage_error(option + " wants a positive integer, not '" + v + "'");
  return *n;
}

/// The value of `option` as a finite positive number (`--lr`).
inline float positive_number(const std::string& option, const std::string& v) {
  float r = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), r);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || !std::isfinite(r) || r <= 0)
    throw usage_error(option + " wants a positive number, not '" + v + "'");
  return r;
}

/// The value of `option` as a non-negative 64-bit integer (`--seed`).
inline std::uint64_t seed_number(const std::string& option, const std::string& v) {
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size())
    throw usage_error(option + " wants a non-negative integer, not '" + v + "'");
  return n;
}

/// "DxM": two positive integers around one 'x' ("4x", "2x2x2" and "x4" are refused); `example`
/// is the shape the message suggests (the program's default), `second` the name of the second
/// axis as the program's mesh names it ("model", or "tensor" in train_gpt_chars).
inline std::pair<std::size_t, std::size_t> mesh_shape(const std::string& v, const char* example,
                                                      const char* second = "model") {
  const auto x = v.find('x');
  const auto d = x == std::string::npos ? std::nullopt : whole_number(v.substr(0, x));
  const auto m = x == std::string::npos ? std::nullopt : whole_number(v.substr(x + 1));
  if (!d || !m || *d == 0 || *m == 0)
    throw usage_error("--mesh wants DxM, two positive integers (data x " + std::string(second) + " devices) such as " +
                      std::string(example) + ", not '" + v + "'");
  if (*d > std::numeric_limits<std::size_t>::max() / *m) throw usage_error("--mesh " + v + " has too many devices");
  return {*d, *m};
}

/// A (data, model) mesh the flagship chose itself, and the header line's note saying so.
struct mesh_choice {
  std::size_t data = 1, model = 1;
  std::string why;  ///< "--mesh 2x1: chosen for 2 cores; pass --mesh to choose"
};

/// The (data, model) mesh a flagship runs on when --mesh is not given, on a machine of `cores` cores
/// (0: unknown, taken as 1): its full shape (`data` x `model`, powers of two) where every thread
/// device has a core; else the model axis halved first, then the data axis, until they fit, so the
/// data axis still divides the default batch. train_fashion_mnist's (4, 2): 8 cores or more 4x2,
/// 4 to 7 4x1, 2 or 3 2x1, 1 1x1; train_resnet_fashion_mnist's (4, 1) and train_gpt_chars' (2, 2)
/// the same way. Host logic only: a given --mesh is never replaced.
inline mesh_choice default_mesh(std::size_t cores, std::size_t data = 4, std::size_t model = 2) {
  if (cores == 0) cores = 1;
  mesh_choice c{data, model, {}};
  while (c.data * c.model > cores) {
    if (c.model > 1)
      c.model /= 2;
    else
      c.data /= 2;
  }
  c.why = "--mesh " + std::to_string(c.data) + "x" + std::to_string(c.model) + ": chosen for " + std::to_string(cores) +
          (cores == 1 ? " core" : " cores") + "; pass --mesh to choose";
  return c;
}

/// The cores this process may run on (meshlib::available_cores: its CPU affinity mask, as `nproc`).
using meshlib::available_cores;

/// The BLAS threads each device's matrix products run on (`--threads-per-device`), and the header
/// line's note saying why.
struct threads_choice {
  std::size_t threads = 1;
  std::string why;  ///< "--threads-per-device 4: chosen for 16 cores / 4 devices; pass --threads-per-device to choose"
};

/// `--threads-per-device`: `given` (already a positive integer: positive_integer), or when it is not
/// given cores / devices where that is more than 1, else 1, so that a mesh smaller than the machine
/// still multiplies on every core (issue 39: 16 one-core replicas all-reduce 7.4 MB a step where one
/// 16-thread device reduces nothing). `cores`: available_cores() (0: unknown, taken as 1);
/// `shared`: the cores are shared with other processes of the run (mpirun), whose devices this
/// process cannot count, so the default stays 1. A given value above the cores is refused: threads
/// beyond the cores only take turns on them, and a typo (`--threads-per-device 40` for 4) would
/// slow every product down rather than fail. A given value whose devices x threads exceed the cores
/// is run as asked (the note says so): the cores are the user's to share.
inline threads_choice threads_per_device(std::optional<std::size_t> given, std::size_t cores, std::size_t devices,
                                         bool shared = false) {
  if (cores == 0) cores = 1;
  if (devices == 0) devices = 1;
  const std::string on = std::to_string(cores) + (cores == 1 ? " core" : " cores");
  if (given) {
    if (*given > cores)
      throw usage_error("--threads-per-device " + std::to_string(*given) + " is more than the " + on +
                        " this process may run on; use at most " + std::to_string(cores));
    threads_choice c{*given, "--threads-per-device " + std::to_string(*given) + ": as given"};
    if (!shared && *given > 1 && devices > cores / *given)
      c.why += " (" + std::to_string(devices) + " devices x " + std::to_string(*given) + " threads on " + on +
               ": oversubscribed)";
    return c;
  }
  if (shared) return {1, "--threads-per-device 1: the default under a launcher; pass --threads-per-device to choose"};
  const std::size_t n = cores / devices > 1 ? cores / devices : 1;
  return {n, "--threads-per-device " + std::to_string(n) + ": chosen for " + on + " / " + std::to_string(devices) +
                 (devices == 1 ? " device" : " devices") + "; pass --threads-per-device to choose"};
}

}  // namespace flagship
