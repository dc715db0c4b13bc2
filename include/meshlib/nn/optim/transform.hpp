// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `gradient_transform`: what an optax-style gradient transformation is here (optax's
/// `GradientTransformation(init, update)`), and `update_run`, the elements one call updates.
///
/// A transform's state is `slots()` floats per element of every parameter, zero at the start
/// (optax's `init` for elementwise state: `adam`'s moments, `trace`'s momentum). The train state
/// stores them in its optimizer state, replicated or ZeRO-1 / FSDP sharded exactly like the
/// parameter, so every transform runs unchanged on any sharding. `update` turns the updates of a
/// run of elements (on entry to the chain, the gradient) into new updates, in place, reading and
/// writing its state slots for those elements; after the whole chain the train state applies
/// `param += update` (optax's `apply_updates`).
///
/// A run is a piece of one parameter's local block: the whole block (replicated state, FSDP's
/// shards) or the part of it in this device's ZeRO-1 slice. An elementwise transform does not care
/// which. A transform that needs the norm of every update over the whole mesh (clipping) says so
/// with `reads_global_norm`: the train state then ends a stage there, sums the squares of the
/// updates over every device, and passes the norm in `update_run::global_norm`.
///
/// A transform whose state is not per element (Adafactor's factored second moment: a row and a
/// column vector per matrix, O(rows + cols) instead of O(rows x cols)) says so with
/// `param_state_size(param)`: the floats it keeps per parameter, zero at the start. The train state
/// holds them whole on every device that holds a block of the parameter (alike on all of them: such
/// a transform makes them so, summing its statistics over the parameter's pieces through
/// `update_run::blocks`: tensor-parallel blocks, FSDP shards, ZeRO-1 runs), checkpoints save them
/// once, and `update_run::param_state` points at them.
/// @code
/// struct scale_by_sign {   // a user-written transform: update = sign(update), no state
///   std::size_t slots() const { return 0; }
///   void update(const meshlib::nn::update_run& r) const {
///     for (std::size_t i = 0; i < r.size; ++i) r.updates[i] = float(r.updates[i] > 0) - float(r.updates[i] < 0);
///   }
/// };
/// auto opt = meshlib::nn::chain(scale_by_sign{}, meshlib::nn::scale_by_learning_rate(1e-3f));
/// @endcode

#include <concepts>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace meshlib::nn {

/// @brief The parameter a run belongs to, as masks and label functions see it.
struct param_info {
  std::string_view name;               ///< the parameter's name, such as `"fc1.w"`
  std::span<const std::size_t> shape;  ///< its global shape
  bool decay = true;                   ///< the layer's own say: weights `true`, biases and norms `false`
};

/// @brief Where a device's block of a parameter lies, for a transform whose statistics are over
/// the whole parameter (`param_state_size`): the block's offset and extent per dimension (the run
/// is elements `[offset, offset + size)` of it, `update_run`), and a sum over the devices that hold
/// the parameter's other pieces (its tensor-parallel and fsdp axes; under ZeRO-1 also the data
/// axes, whose devices each hold a run of the same block), after which every one of them holds the
/// same numbers (the collectives' sums are deterministic).
class param_blocks {
 public:
  /// (Polymorphic: the train state implements it over its mesh.)
  virtual ~param_blocks() = default;
  /// Where the block starts in the parameter, per dimension.
  [[nodiscard]] virtual std::span<const std::size_t> offset() const = 0;
  /// The block's extent per dimension (row-major, as its elements lie in the run).
  [[nodiscard]] virtual std::span<const std::size_t> extent() const = 0;
  /// Whether the parameter is split over several devices (false: the block is all of it, and so is
  /// the run).
  [[nodiscard]] virtual bool split() const = 0;
  /// Sums `x` elementwise, in place, over the devices that hold the parameter's pieces (each calls
  /// it, in the same order; under ZeRO-1 also one whose slice holds none of it, with an empty run).
  /// `x` is in the running device's memory.
  virtual void sum(std::span<float> x) const = 0;
  /// As above, in double (Adafactor's factored sums, the block RMS's sum of squares).
  virtual void sum(std::span<double> x) const = 0;
};

/// @brief The elements one `update` call transforms: `size` consecutive elements of a parameter's
/// local block, in the memory of the running device (`default_memory_space`).
struct update_run {
  float* updates = nullptr;        ///< the updates, transformed in place (on entry to the chain: the gradient)
  const float* params = nullptr;   ///< the parameter's values there (float master weights)
  std::span<float* const> state;   ///< this transform's `slots()` state slots, each `size` floats for these elements
  std::size_t size = 0;            ///< elements in the run
  std::size_t offset = 0;          ///< index of the first element in the parameter's local block
  std::size_t step = 0;            ///< the optimizer step being taken, counted from 0
  std::size_t stage = 0;           ///< which of the transform's `stages()` runs
  double global_norm = 0;          ///< stages that `reads_global_norm`: the updates' norm over every device
  param_info param;                ///< the parameter
  float* param_state = nullptr;    ///< this transform's `param_state_size(param)` floats for the parameter (null: none)
  const param_blocks* blocks = nullptr;  ///< where the run's block lies in the parameter (null: the run is all of it)
};

/// @brief A gradient transformation (see the file comment). Required: `slots()`, the state floats
/// per element, and `update(const update_run&)`, both const. Optional: `name()` (for logs; a
/// string), `kind()` (what checkpoints record; no spaces), `stages()` (default 1),
/// `reads_global_norm(stage)` (default false), `param_state_size(const param_info&)` (default 0:
/// floats of per-parameter state, see the file comment), `whole_parameters()` (default false: true
/// for a transform whose statistics are over every element of a parameter, as Adafactor's: it gets
/// `update_run::blocks`, and under ZeRO-1 a run of every parameter, empty where a device holds none,
/// so that its sums over the pieces match on every device) and `update_and_apply(run, float*
/// params)`, the update and then `params += updates` in one pass (default: `update`, then a pass
/// that adds them).
/// (The members are tested first: a type without them is rejected before its copy constructor is
/// asked for, which for `optimizer`'s converting constructor would ask itself.)
template <class T>
concept gradient_transform = requires(const T& t, const update_run& r) {
  { t.slots() } -> std::convertible_to<std::size_t>;
  { t.update(r) } -> std::same_as<void>;
} && std::copy_constructible<T>;

namespace detail {

/// The diagnostics for a type that is not a `gradient_transform`, one per missing member; the
/// type's name is in theirs (`transform_has_no_update<false, my_transform>`), since the message
/// cannot spell it.
template <bool Ok, class Transform>
struct transform_has_no_slots {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_has_no_slots<ok, Transform>): it has no const member slots() returning the number of "
                    "state floats per element; add std::size_t slots() const { return 0; } for none");
  static constexpr bool value = Ok;
};
template <bool Ok, class Transform>
struct transform_has_no_update {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_has_no_update<ok, Transform>): it has no const member "
                    "void update(const meshlib::nn::update_run&) that transforms the run's updates in place");
  static constexpr bool value = Ok;
};
template <bool Ok, class Transform>
struct transform_is_not_copyable {
  static_assert(Ok, "meshlib::nn: the type is not a meshlib::nn::gradient_transform (the type in "
                    "transform_is_not_copyable<ok, Transform>): it is not copy-constructible (an optimizer copies "
                    "its transforms); keep state in the update_run's slots, not in the object");
  static constexpr bool value = Ok;
};

/// The one diagnostic for a type that is not a `gradient_transform` (STYLE.md: one static_assert,
/// on the first unmet requirement, naming the concept and the member that is missing). True for a
/// transform. Called outside a constant expression (Clang then reports no second error).
template <class T>
bool diagnose_gradient_transform() {
  if constexpr (!requires(const T& t) {
                  { t.slots() } -> std::convertible_to<std::size_t>;
                })
    return transform_has_no_slots<false, T>::value;
  else if constexpr (!requires(const T& t, const update_run& r) {
                       { t.update(r) } -> std::same_as<void>;
                     })
    return transform_has_no_update<false, T>::value;
  else if constexpr (!std::copy_constructible<T>)
    return transform_is_not_copyable<false, T>::value;
  else
    return true;
}

/// What a factory returns after `diagnose_gradient_transform` fired: a transform, so that the
/// caller's code gives no second error.
struct not_a_transform {
  [[nodiscard]] std::size_t slots() const noexcept { return 0; }
  void update(const update_run&) const {}
};

/// `t.stages()`, or 1.
template <class T>
std::size_t stages_of(const T& t) {
  if constexpr (requires { t.stages(); }) return t.stages();
  else return 1;
}
/// `t.reads_global_norm(stage)`, or false.
template <class T>
bool reads_global_norm_of(const T& t, std::size_t stage) {
  if constexpr (requires { t.reads_global_norm(stage); }) return t.reads_global_norm(stage);
  else return false;
}
/// `t.whole_parameters()` (the transform's statistics are over every element of a parameter), or false.
template <class T>
bool whole_parameters_of(const T& t) {
  if constexpr (requires { t.whole_parameters(); }) return t.whole_parameters();
  else return false;
}
/// `t.param_state_size(p)` (floats of per-parameter state), or 0.
template <class T>
std::size_t param_state_size_of(const T& t, const param_info& p) {
  if constexpr (requires { t.param_state_size(p); }) return t.param_state_size(p);
  else return 0;
}
/// `t.name()`, or "custom".
template <class T>
std::string name_of(const T& t) {
  if constexpr (requires { std::string(t.name()); }) return std::string(t.name());
  else return "custom";
}
/// `t.kind()`, or "custom".
template <class T>
std::string kind_of(const T& t) {
  if constexpr (requires { std::string(t.kind()); }) return std::string(t.kind());
  else return "custom";
}

}  // namespace detail

/// @brief Which parameters a transform applies to (optax's `mask`): a callable over the
/// parameter's name (`bool(std::string_view)`) or over its `param_info` (`bool(const param_info&)`).
class param_mask {
 public:
  /// Every parameter.
  param_mask() : f_([](const param_info&) { return true; }) {}
  /// The parameters for which `f` is true.
  template <class F>
    requires(!std::same_as<std::remove_cvref_t<F>, param_mask> &&
             (std::is_invocable_r_v<bool, const F&, const param_info&> ||
              std::is_invocable_r_v<bool, const F&, std::string_view>))
  param_mask(F f) {  // NOLINT(google-explicit-constructor): a lambda is a mask
    if constexpr (std::is_invocable_r_v<bool, const F&, const param_info&>)
      f_ = std::move(f);
    else
      f_ = [g = std::move(f)](const param_info& p) { return static_cast<bool>(g(p.name)); };
  }
  /// Whether the transform applies to `p`.
  [[nodiscard]] bool operator()(const param_info& p) const { return f_(p); }

 private:
  std::function<bool(const param_info&)> f_;
};

/// @brief The mask of the parameters whose layer marks them for weight decay (`param_ref::decay`:
/// weights yes, biases and normalisation scales no): `adamw`'s default.
inline param_mask decay_mask() {
  return param_mask([](const param_info& p) { return p.decay; });
}

}  // namespace meshlib::nn
