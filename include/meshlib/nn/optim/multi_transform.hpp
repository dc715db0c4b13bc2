// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `multi_transform(transforms, label)` (optax's `multi_transform`): parameter groups, each
/// with its own transform; `label(param)` names the group of a parameter. Its state is as many
/// slots as the largest group's transform has (every parameter holds them; a group uses the first
/// ones).
/// @code
/// namespace nn = meshlib::nn;
/// auto label = [](std::string_view name) { return name.starts_with("embed") ? "embed" : "rest"; };
/// nn::optimizer opt = nn::multi_transform({{"embed", nn::sgd(1e-2f)}, {"rest", nn::adamw(1e-3f)}}, label);
/// @endcode

#include <algorithm>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/nn/optim/transform.hpp"
#include "meshlib/nn/optimizer.hpp"

namespace meshlib::nn {

/// @brief A parameter's group name: a callable over its name or its `param_info`, returning a
/// string (or anything a `std::string` is made from).
class param_label {
 public:
  /// The label `f` gives.
  template <class F>
    requires(!std::same_as<std::remove_cvref_t<F>, param_label> &&
             (std::is_invocable_r_v<std::string, const F&, const param_info&> ||
              std::is_invocable_r_v<std::string, const F&, std::string_view>))
  param_label(F f) {  // NOLINT(google-explicit-constructor): a lambda is a label function
    if constexpr (std::is_invocable_r_v<std::string, const F&, const param_info&>)
      f_ = std::move(f);
    else
      f_ = [g = std::move(f)](const param_info& p) { return std::string(g(p.name)); };
  }
  /// The group of `p`.
  [[nodiscard]] std::string operator()(const param_info& p) const { return f_(p); }

 private:
  std::function<std::string(const param_info&)> f_;
};

/// @brief The transform `multi_transform` returns (see the file comment).
class multi_transform_t {
 public:
  /// @throws std::invalid_argument for no groups, a group named twice, or a group transform that
  /// reads the global norm (that norm is over every parameter: clip in a chain around this).
  multi_transform_t(std::vector<std::pair<std::string, optimizer>> groups, param_label label)
      : groups_(std::move(groups)), label_(std::move(label)) {
    if (groups_.empty())
      throw std::invalid_argument("meshlib::nn: multi_transform: no groups; give at least one {label, transform}");
    for (std::size_t i = 0; i < groups_.size(); ++i) {
      const auto& [name, t] = groups_[i];
      for (std::size_t j = 0; j < i; ++j)
        if (groups_[j].first == name)
          throw std::invalid_argument("meshlib::nn: multi_transform: the label '" + name +
                                      "' is given twice; give each group one transform (chain them)");
      for (std::size_t s = 0; s < t.stages(); ++s)
        if (t.reads_global_norm(s))
          throw std::invalid_argument("meshlib::nn: multi_transform: the transform of group '" + name + "' (" +
                                      t.name() + ") reads the global norm of every parameter's updates, which a "
                                      "group cannot restrict; clip in a chain around multi_transform");
      slots_ = std::max(slots_, t.slots());
      stages_ = std::max(stages_, t.stages());
    }
  }
  /// The `gradient_transform` requirement: state floats per element.
  [[nodiscard]] std::size_t slots() const noexcept { return slots_; }
  /// Floats of per-parameter state for `p`: its group's transform's (none for a label of no group;
  /// `update` names that mistake).
  [[nodiscard]] std::size_t param_state_size(const param_info& p) const {
    const std::string label = label_(p);
    for (const auto& [name, t] : groups_)
      if (name == label) return t.param_state_size(p);
    return 0;
  }
  /// How many stages `update` runs in (the train state runs each over every run before the next).
  [[nodiscard]] std::size_t stages() const noexcept { return stages_; }
  /// Whether a group's transform reads statistics of whole parameters (`adafactor`).
  [[nodiscard]] bool whole_parameters() const {
    return std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g.second.whole_parameters(); });
  }
  /// The transform as logs print it.
  [[nodiscard]] std::string name() const { return joined(", ", [](const optimizer& o) { return o.name(); }); }
  /// What checkpoints record (no spaces): a resumed run must match it.
  [[nodiscard]] std::string kind() const { return joined(",", [](const optimizer& o) { return o.kind(); }); }
  /// @throws std::invalid_argument when the label of the run's parameter names no group.
  void update(const update_run& r) const {
    with_group(r, [](const optimizer& t, const update_run& sub) { t.update(sub); });
  }
  /// `update(r)`, then `params += updates`, in one pass where the group's transform can.
  void update_and_apply(const update_run& r, float* params) const {
    if (!with_group(r, [&](const optimizer& t, const update_run& sub) { t.update_and_apply(sub, params); }))
      detail::apply_updates(params, r.updates, r.size);
  }

 private:
  /// `f(the group's transform, r with its slots)` if `r.stage` is one of its stages; false if not.
  template <class F>
  bool with_group(const update_run& r, F&& f) const {
    const std::string label = label_(r.param);
    for (const auto& [name, t] : groups_)
      if (name == label) {
        if (r.stage >= t.stages()) return false;
        update_run sub = r;
        sub.state = r.state.first(t.slots());
        f(t, sub);
        return true;
      }
    std::string names;
    for (const auto& g : groups_) names += (names.empty() ? "'" : ", '") + g.first + "'";
    throw std::invalid_argument("meshlib::nn: multi_transform: parameter '" + std::string(r.param.name) +
                                "' has the label '" + label + "', which names no group (the groups are " + names +
                                "); give it a group or change the label function");
  }
  template <class F>
  std::string joined(const char* sep, F&& f) const {
    std::string out = "multi_transform(";
    for (std::size_t i = 0; i < groups_.size(); ++i)
      out += (i ? std::string(sep) : std::string()) + groups_[i].first + ":" + f(groups_[i].second);
    return out + ")";
  }

  std::vector<std::pair<std::string, optimizer>> groups_;
  param_label label_;
  std::size_t slots_ = 0, stages_ = 1;
};

/// @brief Parameter groups with their own transforms (see the file comment).
inline multi_transform_t multi_transform(std::vector<std::pair<std::string, optimizer>> groups, param_label label) {
  return multi_transform_t(std::move(groups), std::move(label));
}

}  // namespace meshlib::nn
