// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The data pipeline of meshlib's nn layer: datasets, IDX and Fashion-MNIST readers, the
/// seeded epoch permutation and the sharded, prefetching data loader; plain text for byte-level
/// language models (corpus, next-token windows, n-gram baselines).

#include "meshlib/nn/data/errors.hpp"
#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/idx.hpp"
#include "meshlib/nn/data/fashion_mnist.hpp"
#include "meshlib/nn/data/permutation.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/nn/data/text.hpp"
#include "meshlib/nn/data/text_windows.hpp"
#include "meshlib/nn/data/byte_ngram.hpp"
