// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Reverse-mode automatic differentiation of programs on local values: `value_and_grad`,
/// `grad`, `traced`, and the differentiable operations. See docs/autodiff.md.

#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/nn/autodiff/elementwise.hpp"
#include "meshlib/nn/autodiff/linalg.hpp"
#include "meshlib/nn/autodiff/shape.hpp"
#include "meshlib/nn/autodiff/collectives.hpp"
#include "meshlib/nn/autodiff/layer.hpp"
#include "meshlib/nn/autodiff/value_and_grad.hpp"
#include "meshlib/nn/autodiff/function_layer.hpp"
#include "meshlib/nn/autodiff/function_loss.hpp"
