// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib's training layer: layers with forward and backward, losses, optimizers and
/// schedules, data-parallel gradient synchronisation, ZeRO-1, `train_state` / `train_step`, and the
/// data pipeline. See docs/training.md.

#include "meshlib/nn/random.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/layers/dense.hpp"
#include "meshlib/nn/layers/activation.hpp"
#include "meshlib/nn/layers/layer_norm.hpp"
#include "meshlib/nn/layers/rms_norm.hpp"
#include "meshlib/nn/layers/embedding.hpp"
#include "meshlib/nn/layers/positional_embedding.hpp"
#include "meshlib/nn/layers/tied_head.hpp"
#include "meshlib/nn/layers/attention.hpp"
#include "meshlib/nn/layers/transformer_block.hpp"
#include "meshlib/nn/layers/dropout.hpp"
#include "meshlib/nn/layers/image_shape.hpp"
#include "meshlib/nn/layers/conv2d.hpp"
#include "meshlib/nn/layers/pooling.hpp"
#include "meshlib/nn/layers/batch_norm.hpp"
#include "meshlib/nn/layers/residual.hpp"
#include "meshlib/nn/layers/basic_block.hpp"
#include "meshlib/nn/loss_function.hpp"
#include "meshlib/nn/loss.hpp"
#include "meshlib/nn/mean_squared_error.hpp"
#include "meshlib/nn/sequential.hpp"
#include "meshlib/nn/collective_transpose.hpp"
#include "meshlib/nn/schedule.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/precision.hpp"
#include "meshlib/nn/grad_sync.hpp"
#include "meshlib/nn/data.hpp"
#include "meshlib/nn/train_state.hpp"
#include "meshlib/nn/params.hpp"
#include "meshlib/nn/checkpoint.hpp"
#include "meshlib/nn/pipeline_schedule.hpp"
