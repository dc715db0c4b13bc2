// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// The main of a single-process flagship (train_resnet_fashion_mnist, train_gpt_chars), written once
// so that both order their start the same way and report failures with the same exit statuses:
// the options are checked before anything starts (a mistake: the usage line and the message,
// status 2, as argparse does), then Kokkos starts, the data loads (a data_error: its message,
// status 1), and the training runs (any exception: its message, status 1).

#include <Kokkos_Core.hpp>
#include <meshlib/exec/default_runner.hpp>
#include <meshlib/exec/gpu_runner.hpp>
#include <meshlib/nn/data/errors.hpp>
#include <meshlib/tensor/matmul_into.hpp>

#include <cstdio>
#include <exception>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "flagship_options.hpp"

namespace flagship {

/// `--gpu` in a build without the GPU runner: the usage error that says how to get one.
inline void check_gpu_flag(bool gpu) {
#if !MESHLIB_HAS_GPU_RUNNER
  if (gpu)
    throw usage_error("--gpu: this build has no GPU runner; build the example with Kokkos CUDA and NCCL "
                      "(Kokkos_ENABLE_CUDA, MESHLIB_ENABLE_NCCL), or leave out --gpu to train on CPU thread devices");
#else
  (void)gpu;
#endif
}

/// `f(runner)` with the runner the flagship trains on: one `gpu_runner` for the whole run with
/// `--gpu` (it keeps its NCCL communicators between steps), else `default_runner`.
template <class F>
int with_runner(bool gpu, F&& f) {
#if MESHLIB_HAS_GPU_RUNNER
  if (gpu) {
    if (meshlib::visible_gpu_count() == 0) throw std::runtime_error("--gpu: no CUDA device is visible");
    const meshlib::gpu_runner runner;
    return f(runner);
  }
#else
  (void)gpu;
#endif
  return f(meshlib::default_runner{});
}

/// Applies `--threads-per-device` (threads_per_device): every device's matrix products on
/// `c.threads` BLAS threads, through meshlib::set_blas_threads_per_device (OpenBLAS has one
/// process-wide setting, so it is set once, before any device thread multiplies). Without an
/// OpenBLAS in the process the products run on one thread whatever was asked, and the note says so
/// rather than let the header line claim threads that do not run.
inline void use_threads_per_device(threads_choice& c) {
  if (!meshlib::set_blas_threads_per_device(static_cast<int>(c.threads)) && c.threads > 1)
    c.why += " (no OpenBLAS in this process: products run on one thread)";
}

/// `--loss-log FILE`: one "step loss" line per step, to compare runs (scripts/gpu-check.sh).
class loss_log {
 public:
  explicit loss_log(const std::string& path) {
    if (path.empty()) return;
    file_.reset(std::fopen(path.c_str(), "w"));
    if (!file_) throw std::runtime_error("--loss-log " + path + ": cannot open the file for writing");
  }
  void write(std::size_t step, double loss) {
    if (file_) {
      std::fprintf(file_.get(), "%zu %.9g\n", step, loss);
      std::fflush(file_.get());  // a run stopped by a timeout still leaves its steps
    }
  }

 private:
  struct closer {
    void operator()(std::FILE* f) const noexcept { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, closer> file_;
};

/// `parse(argc, argv)` -> options, `load(options)` -> data, `train(options, data)` -> exit status.
template <class Parse, class Load, class Train>
int run_main(const char* name, const char* usage_line, int argc, char** argv, Parse parse, Load load, Train train) {
  decltype(parse(argc, argv)) o;
  try {
    o = parse(argc, argv);
  } catch (const usage_error& e) {
    std::cerr << usage_line << name << ": error: " << e.what() << "\n";
    return 2;
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  decltype(load(o)) data;
  try {
    data = load(o);
  } catch (const meshlib::data_error& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
  try {
    return train(o, data);
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace flagship
