// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// The main of a single-process flagship (train_resnet_fashion_mnist, train_gpt_chars), written once
// so that both order their start the same way and report failures with the same exit statuses:
// the options are checked before anything starts (a mistake: the usage line and the message,
// status 2, as argparse does), then Kokkos starts, the data loads (a data_error: its message,
// status 1), and the training runs (any exception: its message, status 1).

#include <Kokkos_Core.hpp>
#include <meshlib/nn/data/errors.hpp>

#include <exception>
#include <iostream>

#include "flagship_options.hpp"

namespace flagship {

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
