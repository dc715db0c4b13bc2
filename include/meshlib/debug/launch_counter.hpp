// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `launch_counter`: how many kernels a piece of the program launches, by name, as Kokkos
/// tools see them, plus the matrix products the BLAS makes (which Kokkos does not see).
///
/// Why count launches: on a GPU every launch costs a few microseconds whatever its size, so a
/// training step of small layers is bound by how many kernels it launches, not by their work
/// (issue 38: at most 30 per step of the flagship's MLP). The count does not depend on the backend,
/// so it is measured and tested on the CPU: a change that adds a kernel to the step shows here.
///
/// How: while a counter lives it installs Kokkos Tools callbacks (`begin_parallel_for`,
/// `begin_parallel_reduce`, `begin_parallel_scan`, and `push_region` for the products: each product
/// the BLAS makes is the profiling region `meshlib::blas_product_region`, see tensor/matmul_into.hpp)
/// and puts the previous ones back when it ends. A tool loaded through `KOKKOS_TOOLS_LIBS` keeps
/// receiving every event: the counter forwards to it. Counters nest (each counts what happens while
/// it lives); they must end in the reverse order of their start, as scopes do.
///
/// Counting takes a lock per launch: measure times without a counter, and counts with one.
/// @code
/// nn::train_step(state, x, y);                // warm-up: buffers allocated on the first steps
/// meshlib::launch_counter count;
/// nn::train_step(state, x, y);
/// std::cout << count.kernels() << " kernels + " << count.products() << " products\n" << count;
/// @endcode

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <ostream>
#include <string>

#include <Kokkos_Core.hpp>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#endif

#include "meshlib/tensor/matmul_into.hpp"

namespace meshlib {

/// @brief Counts the kernel launches (Kokkos `parallel_for`, `parallel_reduce`, `parallel_scan`) and
/// the BLAS's matrix products of every device while it lives (see the file comment).
class launch_counter {
 public:
  /// Starts counting: installs the Kokkos Tools callbacks (after `Kokkos::initialize`).
  launch_counter() : previous_(Kokkos::Tools::Experimental::get_callbacks()), outer_(active()) {
    active() = this;
    auto events = previous_;
    using events_t = Kokkos::Tools::Experimental::EventSet;
    events.begin_parallel_for = &on_begin<&events_t::begin_parallel_for>;
    events.begin_parallel_reduce = &on_begin<&events_t::begin_parallel_reduce>;
    events.begin_parallel_scan = &on_begin<&events_t::begin_parallel_scan>;
    events.push_region = &on_push;
    Kokkos::Tools::Experimental::set_callbacks(events);
  }
  /// Stops counting: puts the callbacks that were installed at the start back.
  ~launch_counter() {
    Kokkos::Tools::Experimental::set_callbacks(previous_);
    active() = outer_;
  }
  launch_counter(const launch_counter&) = delete;
  launch_counter& operator=(const launch_counter&) = delete;

  /// @returns the Kokkos kernels launched so far, on every device (a product run as meshlib's own
  /// kernel, when no BLAS is used, is one of them).
  [[nodiscard]] std::size_t kernels() const noexcept { return kernels_.load(); }
  /// @returns the matrix products the BLAS made so far, on every device (not Kokkos kernels).
  [[nodiscard]] std::size_t products() const noexcept { return products_.load(); }
  /// @returns `kernels() + products()`: what a GPU would launch (a product is one cuBLAS call).
  [[nodiscard]] std::size_t launches() const noexcept { return kernels() + products(); }
  /// @returns the count of each kernel name (Kokkos' label, or the functor's type name where the
  /// launch gave none, demangled where the compiler can) and of `blas_product_region`, in name order.
  [[nodiscard]] std::map<std::string, std::size_t> by_name() const {
    std::map<std::string, std::size_t> raw;
    {
      std::lock_guard lock(mutex_);
      raw = names_;
    }
    std::map<std::string, std::size_t> out;
    for (const auto& [name, n] : raw) out[demangled(name)] += n;
    return out;
  }
  /// Starts again from zero.
  void reset() {
    std::lock_guard lock(mutex_);
    names_.clear();
    kernels_ = 0;
    products_ = 0;
  }
  /// Prints the totals, then one line per name: `count  name`.
  friend std::ostream& operator<<(std::ostream& os, const launch_counter& c) {
    os << c.launches() << " launches: " << c.kernels() << " Kokkos kernels, " << c.products() << " BLAS products\n";
    for (const auto& [name, n] : c.by_name()) os << "  " << n << "  " << name << '\n';
    return os;
  }

 private:
  /// Kokkos names an unlabelled launch by `typeid(functor).name()`: mangled on GCC and Clang, and
  /// without the `_Z` a demangler wants for a lambda's local name. Demangled when read, not per launch.
  static std::string demangled(const std::string& name) {
#if __has_include(<cxxabi.h>)
    if (name.find_first_of(" :<[") != std::string::npos) return name;  // a label, not a mangled name
    for (const std::string& candidate : {"_Z" + name, name}) {
      int status = 0;
      char* d = abi::__cxa_demangle(candidate.c_str(), nullptr, nullptr, &status);
      if (status == 0 && d != nullptr) {
        std::string out(d);
        std::free(d);
        return out;
      }
      std::free(d);
    }
#endif
    return name;
  }
  static launch_counter*& active() noexcept {
    static launch_counter* a = nullptr;
    return a;
  }
  /// The callbacks of the tool under every counter (the outermost counter's `previous_`).
  static const Kokkos::Tools::Experimental::EventSet& tool() noexcept {
    const launch_counter* c = active();
    while (c->outer_ != nullptr) c = c->outer_;
    return c->previous_;
  }
  void count(const char* name, bool product) {
    (product ? products_ : kernels_).fetch_add(1);
    std::lock_guard lock(mutex_);
    ++names_[name];
  }
  /// The callback for one kind of launch (`Begin`: its field of the event set), so that a tool
  /// under the counter gets each launch as the kind it was.
  template <auto Begin>
  static void on_begin(const char* name, std::uint32_t device, std::uint64_t* id) {
    for (launch_counter* c = active(); c != nullptr; c = c->outer_) c->count(name, false);
    if (auto f = tool().*Begin) f(name, device, id);
  }
  static void on_push(const char* name) {
    if (std::strcmp(name, blas_product_region) == 0)
      for (launch_counter* c = active(); c != nullptr; c = c->outer_) c->count(name, true);
    if (auto f = tool().push_region) f(name);
  }

  Kokkos::Tools::Experimental::EventSet previous_;
  launch_counter* outer_;
  std::atomic<std::size_t> kernels_{0};
  std::atomic<std::size_t> products_{0};
  mutable std::mutex mutex_;
  std::map<std::string, std::size_t> names_;
};

}  // namespace meshlib
