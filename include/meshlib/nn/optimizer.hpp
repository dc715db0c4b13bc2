// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `optimizer`: any gradient transform (nn/optim/transform.hpp), held by value with its type
/// erased, as the train state keeps it; and the named chains `sgd`, `adam`, `adamw` and `lion`
/// and `adafactor` (optax's). Every transform updates one element from that element's gradient and state only
/// (clipping aside, which reads one norm over the mesh; Adafactor aside, which reads whole
/// parameters, summing its statistics over the pieces of a tensor-parallel, FSDP or ZeRO-1
/// parameter), which is what lets the same chain run on a replicated state or on a ZeRO-1 / FSDP
/// shard of it with identical numbers (Adafactor's: up to the order of those sums).
/// @code
/// namespace nn = meshlib::nn;
/// nn::optimizer opt = nn::adamw(nn::warmup_cosine(1e-3f, 100, 2000), 1e-4f);
/// nn::optimizer simple = nn::adam(1e-3f);   // a number is a constant schedule
/// nn::optimizer mine = nn::chain(nn::clip_by_global_norm(1.0f), nn::scale_by_adam(),
///                                nn::add_decayed_weights(1e-4f), nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <array>
#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "meshlib/nn/number_text.hpp"
#include "meshlib/nn/optim/adam.hpp"
#include "meshlib/nn/optim/block_rms.hpp"
#include "meshlib/nn/optim/chain.hpp"
#include "meshlib/nn/optim/clip.hpp"
#include "meshlib/nn/optim/detail/fusion.hpp"
#include "meshlib/nn/optim/factored_rms.hpp"
#include "meshlib/nn/optim/lion.hpp"
#include "meshlib/nn/optim/masked.hpp"
#include "meshlib/nn/optim/scale.hpp"
#include "meshlib/nn/optim/trace.hpp"
#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/nn/optim/weight_decay.hpp"
#include "meshlib/nn/schedule.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

namespace detail {
/// A transform behind a virtual interface: `optimizer`'s erased holder (one virtual call per run
/// of elements, each of which launches kernels: the call is nothing beside them).
struct erased_transform {
  virtual ~erased_transform() = default;
  [[nodiscard]] virtual std::size_t slots() const = 0;
  [[nodiscard]] virtual std::size_t stages() const = 0;
  [[nodiscard]] virtual bool reads_global_norm(std::size_t stage) const = 0;
  [[nodiscard]] virtual bool whole_parameters() const = 0;
  [[nodiscard]] virtual std::size_t param_state_size(const param_info& p) const = 0;
  [[nodiscard]] virtual std::string name() const = 0;
  [[nodiscard]] virtual std::string kind() const = 0;
  virtual void update(const update_run& r) const = 0;
  virtual void update_and_apply(const update_run& r, float* params) const = 0;
  virtual void update_and_apply_all(const update_batch& b) const = 0;
};
template <class T>
struct erased_model final : erased_transform {
  explicit erased_model(T x) : t(std::move(x)) {}
  [[nodiscard]] std::size_t slots() const override { return t.slots(); }
  [[nodiscard]] std::size_t stages() const override { return stages_of(t); }
  [[nodiscard]] bool reads_global_norm(std::size_t stage) const override { return reads_global_norm_of(t, stage); }
  [[nodiscard]] bool whole_parameters() const override { return whole_parameters_of(t); }
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const override { return param_state_size_of(t, p); }
  [[nodiscard]] std::string name() const override { return name_of(t); }
  [[nodiscard]] std::string kind() const override { return kind_of(t); }
  void update(const update_run& r) const override { t.update(r); }
  void update_and_apply(const update_run& r, float* params) const override { update_and_apply_of(t, r, params); }
  void update_and_apply_all(const update_batch& b) const override { update_and_apply_all_of(t, b); }
  T t;
};

}  // namespace detail

/// @brief A gradient transform with its type erased (see the file comment); itself a
/// `gradient_transform`, so optimizers chain: `chain(clip_by_global_norm(1.0f), adamw(3e-4f))`.
class optimizer {
 public:
  /// `adam(1e-3f)`.
  optimizer();
  /// Holds `t` (a `chain`, or any `gradient_transform`), named and recorded in checkpoints by its
  /// own `name()` and `kind()`.
  template <class T>
    requires(!std::same_as<std::remove_cvref_t<T>, optimizer> && gradient_transform<std::remove_cvref_t<T>>)
  optimizer(T t)  // NOLINT(google-explicit-constructor): a chain is an optimizer
      : impl_(std::make_shared<const detail::erased_model<T>>(std::move(t))),
        name_(impl_->name()),
        kind_(impl_->kind()) {}
  /// Holds `t` under the name `name` (logs) and the kind `kind` (checkpoints; no spaces): how
  /// `adamw(...)` names its chain.
  template <class T>  // the first test keeps the copy constructor's own check from asking itself
    requires(!std::same_as<std::remove_cvref_t<T>, optimizer> && gradient_transform<T>)
  optimizer(T t, std::string name, std::string kind)
      : impl_(std::make_shared<const detail::erased_model<T>>(std::move(t))),
        name_(std::move(name)),
        kind_(std::move(kind)) {}

  /// State slots per element (0 for a stateless chain).
  [[nodiscard]] std::size_t slots() const { return impl_->slots(); }
  /// The stages the train state runs one after the other over every run (see nn/optim/chain.hpp).
  [[nodiscard]] std::size_t stages() const { return impl_->stages(); }
  /// Whether stage `k` reads the global norm of the updates entering it.
  [[nodiscard]] bool reads_global_norm(std::size_t k) const { return impl_->reads_global_norm(k); }
  /// Whether a transform in it reads statistics of whole parameters (`adafactor`): the train state
  /// then passes where each run lies and the sum over the parameter's other pieces
  /// (`update_run::blocks`: tensor-parallel blocks, FSDP shards, ZeRO-1 runs), and under ZeRO-1 a
  /// run of every parameter on every device, empty where its slice holds none.
  [[nodiscard]] bool whole_parameters() const { return impl_->whole_parameters(); }
  /// Floats of per-parameter state the transforms keep for `p` (`adafactor`'s factored second
  /// moment), beside the `slots()` per element.
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const { return impl_->param_state_size(p); }
  /// The optimizer for logs, its numbers as a user writes them: `sgd(momentum 0.9)`, `adam`,
  /// `adamw(weight decay 1e-4)`, `chain(clip_by_global_norm(1), adamw(weight decay 1e-4))`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// What a checkpoint records and a restore compares: the transforms without their numbers
  /// (`adamw`, `chain(clip_by_global_norm,adamw)`), so a run may resume with another rate.
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  /// Transforms the run's updates in place (see `gradient_transform`).
  void update(const update_run& r) const { impl_->update(r); }
  /// `update(r)`, then `params += updates` (optax's `apply_updates`): one pass for a chain of
  /// built-in transforms. What the train state calls for the last stage.
  void update_and_apply(const update_run& r, float* params) const { impl_->update_and_apply(r, params); }
  /// `update_and_apply` over every run of a device's last stage: one multi-tensor kernel for a
  /// chain of built-in transforms (`adam`, `adamw`, `sgd`); run by run for others. What the train
  /// state calls.
  void update_and_apply_all(const detail::update_batch& b) const { impl_->update_and_apply_all(b); }

 private:
  std::shared_ptr<const detail::erased_transform> impl_;
  std::string name_, kind_;
};

/// @brief SGD with (heavy-ball) momentum (`optax.sgd(lr, momentum)`): `chain(trace(momentum),
/// scale_by_learning_rate(lr))`.
inline optimizer sgd(schedule lr, float momentum = 0.9f) {
  return {chain(trace{momentum}, scale_by_learning_rate(lr)), "sgd(momentum " + detail::number_text(momentum) + ")",
          "sgd"};
}
/// @brief Adam (`optax.adam`): `chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))`.
inline optimizer adam(schedule lr, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f) {
  return {chain(scale_by_adam{b1, b2, eps}, scale_by_learning_rate(lr)), "adam", "adam"};
}
/// @brief AdamW, decoupled weight decay (`optax.adamw`): `chain(scale_by_adam(b1, b2, eps),
/// add_decayed_weights(weight_decay, mask), scale_by_learning_rate(lr))`; the mask defaults to the
/// parameters their layer marks for decay (weights, not biases or norms).
inline optimizer adamw(schedule lr, float weight_decay = 1e-4f, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f,
                       param_mask mask = decay_mask()) {
  return {chain(scale_by_adam{b1, b2, eps}, add_decayed_weights(weight_decay, std::move(mask)),
                scale_by_learning_rate(lr)),
          "adamw(weight decay " + detail::number_text(weight_decay) + ")", "adamw"};
}
/// @brief Lion (`optax.lion`): `chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay,
/// mask), scale_by_learning_rate(lr))`. Its updates are signs (norm sqrt(n)): it wants a learning
/// rate 3-10x smaller than AdamW's and a weight decay as much larger.
inline optimizer lion(schedule lr, float b1 = 0.9f, float b2 = 0.99f, float weight_decay = 1e-3f,
                      param_mask mask = decay_mask()) {
  return {chain(scale_by_lion{b1, b2}, add_decayed_weights(weight_decay, std::move(mask)), scale_by_learning_rate(lr)),
          "lion(weight decay " + detail::number_text(weight_decay) + ")", "lion"};
}

/// @brief `adafactor`'s options other than the learning rate: optax's arguments and defaults
/// (`optax.adafactor`), for designated initialisers: `adafactor(1e-2f, {.momentum = 0.9f})`.
struct adafactor_options {
  std::size_t min_dim_size_to_factor = 128;  ///< a parameter is factored when its two largest dimensions are at least this
  float decay_rate = 0.8f;                   ///< the second moment's decay: `beta_t = 1 - (t + 1)^-decay_rate`
  std::size_t decay_offset = 0;              ///< steps subtracted from `t` (for fine-tuning)
  bool multiply_by_parameter_scale = true;   ///< scale each update by its parameter's RMS (at least 1e-3)
  std::optional<float> clipping_threshold = 1.0f;  ///< clip each parameter's update to this RMS; none: no clip
  std::optional<float> momentum = std::nullopt;    ///< an exponential moving average of the updates (no debias); none: none
  std::optional<float> weight_decay_rate = std::nullopt;  ///< `update += rate * param` after the learning rate
  float eps = 1e-30f;     ///< added to the squared gradient
  bool factored = true;   ///< false: an unfactored (per-element) second moment for every parameter
  param_mask weight_decay_mask = decay_mask();  ///< the parameters weight decay applies to
};

/// @brief Adafactor (`optax.adafactor`): `chain(scale_by_factored_rms(factored, decay_rate,
/// decay_offset, min_dim_size_to_factor, eps), clip_by_block_rms(clipping_threshold),
/// scale_by_schedule(lr), scale_by_param_block_rms(), momentum as chain(scale(1 - momentum),
/// trace(momentum)), add_decayed_weights(weight_decay_rate, mask), scale(-1))`, each optional piece
/// present as `o` asks. As in optax the weight decay comes after the learning rate (it is not
/// scaled by it). Its second moment is per parameter (rows + cols floats for a factored
/// matrix). Runs replicated, data-parallel (with ZeRO-1 or not), on FSDP shards and on
/// tensor-parallel parameters (see nn/optim/factored_rms.hpp).
inline optimizer adafactor(schedule lr, adafactor_options o = {}) {
  optimizer tx = scale_by_factored_rms(o.factored, o.decay_rate, o.decay_offset, o.min_dim_size_to_factor, o.eps);
  if (o.clipping_threshold) tx = chain(std::move(tx), clip_by_block_rms(*o.clipping_threshold));
  tx = chain(std::move(tx), scale_by_schedule(lr, "scale_by_learning_rate"));
  if (o.multiply_by_parameter_scale) tx = chain(std::move(tx), scale_by_param_block_rms());
  // optax's ema(momentum, debias=False): m = (1 - momentum) u + momentum m, the update m.
  if (o.momentum) tx = chain(std::move(tx), scale(1.0f - *o.momentum), trace{*o.momentum});
  if (o.weight_decay_rate)
    tx = chain(std::move(tx), add_decayed_weights(*o.weight_decay_rate, std::move(o.weight_decay_mask)));
  std::string options;
  const auto add = [&](const std::string& part) { options += (options.empty() ? "" : ", ") + part; };
  if (!o.factored) add("unfactored");
  if (o.momentum) add("momentum " + detail::number_text(*o.momentum));
  if (o.weight_decay_rate) add("weight decay " + detail::number_text(*o.weight_decay_rate));
  return {chain(std::move(tx), scale(-1.0f)), options.empty() ? "adafactor" : "adafactor(" + options + ")", "adafactor"};
}

inline optimizer::optimizer() : optimizer(adam(constant(1e-3f))) {}

}  // namespace meshlib::nn
