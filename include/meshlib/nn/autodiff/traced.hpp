// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `traced<L>`: a `local_tensor` being differentiated by `value_and_grad`, and the per-device
/// tape (define-by-run) that records, for every operation on traced values, how its cotangent flows
/// back to its operands.
///
/// Why a tape per call and a pointer in each traced value: every device runs the loss function on
/// its own thread, so the tape is a local of that call (no thread-local state, no locking), and two
/// traced operands always name the tape they were recorded on.
///
/// Cotangents. A traced value's type is its primal's type, so a misuse fails to compile exactly as
/// it does untraced. The cotangent of a value of type `L` has type `cotangent_t<L>`: `L` with no
/// pending-sum axes. The cotangent of a part of a pending sum (`partial` over `a`) is the cotangent
/// of the completed sum, the same on every device of `a` (each part moves the sum one for one), so
/// it is invariant over `a`; for every other value the cotangent has the value's own type (JAX's
/// `check_vma` rule: the cotangent of an invariant value is invariant).

#include <any>
#include <cstddef>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/elementwise.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::nn {

/// @brief The type of the cotangent of a local value of type `L`: `L` without pending-sum axes
/// (see the file comment).
template <local_tensor_type L>
using cotangent_t = with_vary_partial_t<L, L::vary, 0>;

namespace detail {

/// The tape of one `value_and_grad` call on one device: per node, its cotangent (once one has
/// arrived) and the closure that sends it back to the node's operands.
class tape {
 public:
  /// A node with no backward (an input being differentiated); returns its id.
  std::size_t leaf() {
    cts_.emplace_back();
    backward_.emplace_back();
    return cts_.size() - 1;
  }

  /// A node whose cotangent has type `C`; `back(t, ct)` sends `ct` to the operands. Returns its id.
  template <class C, class F>
  std::size_t node(F back) {
    const std::size_t id = cts_.size();
    cts_.emplace_back();
    backward_.emplace_back([back = std::move(back), id](tape& t) {
      const C ct = std::any_cast<const C&>(t.cts_[id]);
      back(t, ct);
    });
    return id;
  }

  /// Adds `ct` into node `id`'s cotangent (the sum over every use of the node).
  template <class C>
  void accumulate(std::size_t id, const C& ct) {
    std::any& slot = cts_[id];
    if (!slot.has_value()) slot = ct;
    else slot = C(std::any_cast<const C&>(slot) + ct);
  }

  /// Node `id`'s cotangent, or nothing when none reached it.
  template <class C>
  [[nodiscard]] const C* cotangent(std::size_t id) const {
    return std::any_cast<C>(&cts_[id]);
  }

  /// Runs the backward of every node that has a cotangent, the last recorded first. Every device
  /// records the same program, so all of them issue the backward collectives in the same order.
  void run_backward() {
    for (std::size_t i = cts_.size(); i-- > 0;)
      if (backward_[i] && cts_[i].has_value()) backward_[i](*this);
  }

 private:
  std::vector<std::any> cts_;
  std::vector<std::function<void(tape&)>> backward_;
};

/// `x`'s block as a value of type `To` (same element type, rank and memory space): the
/// cotangent rules move axes between invariant and varying where the data are already right.
template <local_tensor_type To, local_tensor_type From>
To retype(const From& x) {
  static_assert(std::is_same_v<typename To::view_type, typename From::view_type>,
                "meshlib::nn: autodiff: a cotangent retyped to another element type, rank or memory space");
  return To(x.view(), x.mesh(), x.device());
}

}  // namespace detail

/// @brief A `local_tensor` of type `L` being differentiated inside `value_and_grad`: its value (the
/// primal) and its node on the device's tape. Operations on traced values (`+`, `*`, `matmul`,
/// `sum`, `psum`, `all_gather`, ...; see docs/autodiff.md) compute the primal with meshlib's own
/// operation, so they have its sharding rules and diagnostics, and record the backward.
template <local_tensor_type L>
class traced {
 public:
  /// Tag that opts the type into the `traced_type` concept.
  using is_traced = void;
  /// The type of the value (and of every operation's result on it, untraced).
  using primal_type = L;
  /// The element type.
  using value_type = typename L::value_type;
  /// The mesh type.
  using mesh_type = typename L::mesh_type;
  /// The number of dimensions.
  static constexpr std::size_t rank = L::rank;
  /// The mesh axes the value varies over (the primal's).
  static constexpr axis_mask vary = L::vary;
  /// The mesh axes the value is a pending sum over (the primal's).
  static constexpr axis_mask partial = L::partial;

  /// The value `primal` recorded as node `id` of tape `t`.
  traced(L primal, detail::tape* t, std::size_t id) : primal_(std::move(primal)), tape_(t), id_(id) {}

  /// The value (a `local_tensor`; reading it records nothing).
  [[nodiscard]] const L& primal() const noexcept { return primal_; }
  /// The tape the value was recorded on.
  [[nodiscard]] detail::tape* tape() const noexcept { return tape_; }
  /// The value's node on its tape.
  [[nodiscard]] std::size_t id() const noexcept { return id_; }
  /// The block's shape.
  [[nodiscard]] auto shape() const { return primal_.shape(); }
  /// The block's extent in dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return primal_.extent(d); }
  /// The number of elements of the block.
  [[nodiscard]] std::size_t size() const noexcept { return primal_.size(); }
  /// The mesh the block belongs to.
  [[nodiscard]] const mesh_type& mesh() const noexcept { return primal_.mesh(); }
  /// The device whose block this is.
  [[nodiscard]] std::size_t device() const noexcept { return primal_.device(); }

 private:
  L primal_;
  detail::tape* tape_;
  std::size_t id_;
};

/// @brief A `traced<...>` value.
template <class T>
concept traced_type = requires { typename std::remove_cvref_t<T>::is_traced; };

/// @brief An operand of a differentiable operation: a traced value or a plain `local_tensor` (a constant).
template <class T>
concept ad_operand = traced_type<T> || local_tensor_type<T>;

namespace detail {

/// The value of an operand: the primal of a traced one, a plain local tensor itself.
template <ad_operand X>
const auto& primal_of(const X& x) {
  if constexpr (traced_type<X>) return x.primal();
  else return x;
}

/// Two operands of which at least one is traced (the other a constant `local_tensor`).
template <class A, class B>
concept ad_binary = ad_operand<A> && ad_operand<B> && (traced_type<A> || traced_type<B>);

/// The tape of the first traced operand.
template <class A, class B>
tape* tape_of(const A& a, const B& b) {
  if constexpr (traced_type<A>) return a.tape();
  else return b.tape();
}

/// Records `value` as a node of `t` whose backward is `back(t, ct)`; returns the traced result.
template <local_tensor_type L, class F>
traced<L> record(tape* t, L value, F back) {
  const std::size_t id = t->template node<cotangent_t<L>>(std::move(back));
  return traced<L>(std::move(value), t, id);
}

/// Sends `ct` to operand `x` when it is traced (a constant takes no cotangent).
template <ad_operand X, local_tensor_type C>
void send(tape& t, const X& x, const C& ct) {
  if constexpr (traced_type<X>) {
    using to_t = cotangent_t<typename X::primal_type>;
    t.accumulate<to_t>(x.id(), retype<to_t>(ct));
  }
}

}  // namespace detail

/// @brief `jax.lax.stop_gradient`: `x`'s value as a traced value whose cotangent goes nowhere (a
/// new leaf of `x`'s tape), so no gradient flows back through it; a plain `local_tensor` (already
/// a constant) is returned as it is. The shift of a numerically safe softmax:
/// @code
/// auto z = x - meshlib::nn::broadcast_in_dim<1>(meshlib::nn::stop_gradient(meshlib::nn::max<1>(x)), x);
/// @endcode
template <ad_operand X>
auto stop_gradient(const X& x) {
  if constexpr (traced_type<X>) return X(x.primal(), x.tape(), x.tape()->leaf());
  else return x;
}

}  // namespace meshlib::nn
