// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The element-wise and row-wise kernels of the dense, activation, dropout, residual,
/// positional-embedding and embedding layers. Each is one RangePolicy `parallel_for` on the running
/// device's instance over memory `Space` (`meshlib::launch`), or a launch over blocks of
/// columns for sums over rows (`for_column_blocks`, rows added in row order: the same bits on every
/// mesh and backend); the bodies are the loops the layers ran before.
///
/// Why free functions over pointers, templated on the element type and the memory space only, and
/// not lambdas in the layers: nvcc names an extended device lambda's kernel after its enclosing
/// function, and its generated host stub spells a class-type template argument (the mesh's
/// `axis<"data">`, a `fixed_string`) in a form GCC cannot parse, so a kernel written inside code
/// templated on a mesh does not compile for CUDA (docs/design.md). tests/cuda/nn_layers.cpp
/// instantiates the layers for `CudaSpace`.

#include <cstddef>
#include <cstdint>

#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// `y += bias` (`add`) or `y = bias` on every row of `y` (`rows x out`), one work item per row.
template <class Space, class T>
void add_bias(T* y, const T* bias, std::size_t rows, std::size_t out, bool add) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    T* yi = y + i * out;
    const T* bj = bias;
    if (add)
      for_each_lane<T>(0, out, [&](std::size_t j, auto lane) { store_at(yi, j, load_as(yi, j, lane) + load_as(bj, j, lane)); });
    else
      for_each_lane<T>(0, out, [&](std::size_t j, auto lane) { store_at(yi, j, load_as(bj, j, lane)); });
  });
}

/// `gb (+)= the column sums of d` (`rows x out`; `fresh`: write instead of add), each column's rows
/// added in row order.
template <class Space, class T>
void bias_grad(T* gb, const T* d, std::size_t rows, std::size_t out, bool fresh) {
  for_column_blocks<Space>(out, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* s = gb;  // locals: the stores below cannot be taken to change them
    const T* dr = d;
    if (fresh) for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, decltype(lane){}); });
    for (std::size_t i = 0; i < rows; ++i, dr += out)
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, load_as(s, j, lane) + load_as(dr, j, lane)); });
  });
}

/// Whether activation `Fn`'s `f` (and `vjp`) also take native vectors lane by lane (`static constexpr
/// bool on_lanes = true`): then its kernels run on `for_each_lane`'s vectors, else one element at a time.
template <class Fn>
inline constexpr bool has_lanes_v = requires { requires Fn::on_lanes; };

/// `y[i] = Fn::f(x[i])` for `[0, n)`: an activation's forward.
template <class Space, class Fn, class T>
void activation_forward(T* y, const T* x, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T, has_lanes_v<Fn>>(i0, i1, [&](std::size_t i, auto lane) { store_at(y, i, Fn::f(load_as(x, i, lane))); });
  });
}

/// The cotangent an elementwise activation `Fn` hands back for `dy` at its input `x`: `Fn::vjp(dy,
/// x)` where the activation has its own (branch-free) one, else `dy * Fn::df(x)`. One expression for
/// `activation_backward` and `activation_bias_backward`, so the two kernels cannot drift apart.
template <class Fn, class T>
KOKKOS_INLINE_FUNCTION T activation_cotangent(T dy, T x) {
  if constexpr (requires { Fn::vjp(T{}, T{}); }) return Fn::vjp(dy, x);
  else return dy * Fn::df(x);
}

/// An activation's backward at inputs `x`: `dx = Fn::vjp(d, x)` where the activation has its own
/// (branch-free) cotangent, else `dx = d * Fn::df(x)`.
template <class Space, class Fn, class T>
void activation_backward(T* dx, const T* d, const T* x, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T, has_lanes_v<Fn>>(i0, i1, [&](std::size_t i, auto lane) {
      store_at(dx, i, activation_cotangent<Fn>(load_as(d, i, lane), load_as(x, i, lane)));
    });
  });
}

/// An activation's backward fused with the bias gradient of the dense layer below it, in one launch
/// where `activation_backward` then `bias_grad` were two: `d = activation_cotangent<Fn>(dy, x)` over
/// `rows x out`, and `gb (+)= the column sums of d` (`fresh`: write instead of add). Bitwise the two
/// kernels: every element of `d` is the same expression, and every column's sum the same chain of
/// additions in row order (a work item owns a block of columns, as in `bias_grad`). `d` is stored
/// before it is added, so the sum adds the rounded value `bias_grad` read back.
template <class Space, class Fn, class T>
void activation_bias_backward(T* d, T* gb, const T* dy, const T* x, std::size_t rows, std::size_t out, bool fresh) {
  for_column_blocks<Space>(out, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* s = gb;  // locals: the stores below cannot be taken to change them
    T* dr = d;
    const T* dyr = dy;
    const T* xr = x;
    if (fresh) for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(s, j, decltype(lane){}); });
    for (std::size_t i = 0; i < rows; ++i, dr += out, dyr += out, xr += out)
      for_each_lane<T, has_lanes_v<Fn>>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dj = activation_cotangent<Fn>(load_as(dyr, j, lane), load_as(xr, j, lane));
        store_at(dr, j, dj);
        store_at(s, j, load_as(s, j, lane) + dj);
      });
  });
}

/// Dropout's forward on a `rows x cols` block whose first element is `(r0, c0)` of a `gcols`-wide
/// global array: `mask = keep` where the element's counter-based uniform draw is at least `rate`,
/// else 0, and `y = x * mask`. One work item per row (its global index computed once).
template <class Space, class T>
void dropout_forward(T* y, T* mask, const T* xp, std::size_t rows, std::size_t cols, std::size_t r0, std::size_t c0,
                     std::size_t gcols, rng_key key, float rate, T keep) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const std::uint64_t row = static_cast<std::uint64_t>((r0 + i) * gcols + c0);
    for (std::size_t j = 0; j < cols; ++j) {
      mask[i * cols + j] = uniform(key, row + j) >= rate ? keep : T{0};
      y[i * cols + j] = xp[i * cols + j] * mask[i * cols + j];
    }
  });
}

/// `out[i] = a[i] * b[i]` for `[0, n)` (dropout's backward: the cotangent times the mask).
template <class Space, class T>
void multiply_values(T* out, const T* a, const T* b, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T>(i0, i1, [&](std::size_t i, auto lane) { store_at(out, i, load_as(a, i, lane) * load_as(b, i, lane)); });
  });
}

/// `out[i] = a[i] + b[i]` for `[0, n)` (a residual connection and its cotangent).
template <class Space, class T>
void sum_values(T* out, const T* a, const T* b, std::size_t n) {
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t i0, std::size_t i1) {
    for_each_lane<T>(i0, i1, [&](std::size_t i, auto lane) { store_at(out, i, load_as(a, i, lane) + load_as(b, i, lane)); });
  });
}

/// `y = x + w[position]` over `rows` tokens of `d` features, token `i` at position `i % seq`.
template <class Space, class T>
void add_positions(T* y, const T* xp, const T* w, std::size_t rows, std::size_t d, std::size_t seq) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* wr = w + (i % seq) * d;
    for (std::size_t j = 0; j < d; ++j) y[i * d + j] = xp[i * d + j] + wr[j];
  });
}

/// `g[position] += dy` for every token (the positional table's gradient), tokens in order.
template <class Space, class T>
void position_grad(T* g, const T* dyp, std::size_t rows, std::size_t d, std::size_t seq) {
  for_column_blocks<Space>(d, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* gs = g;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = j0; j < j1; ++j) gs[(i % seq) * d + j] += dyp[i * d + j];
  });
}

/// Row `i` of `y` = row `id[i] - v0` of this device's table rows `w` (`vl x d`, vocabulary range
/// `[v0, v0 + vl)`), zeros where the id is another device's.
template <class Space, class T>
void lookup_rows(T* y, const T* w, const std::int32_t* id, std::size_t rows, std::size_t d, std::size_t v0,
                 std::size_t vl) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const std::size_t v = static_cast<std::size_t>(id[i]);
    T* yi = y + i * d;
    if (v >= v0 && v < v0 + vl) {
      const T* wr = w + (v - v0) * d;
      for (std::size_t j = 0; j < d; ++j) yi[j] = wr[j];
    } else {
      for (std::size_t j = 0; j < d; ++j) yi[j] = T{0};
    }
  });
}

/// `g[id[i] - v0] += dy[i]` for the tokens whose id is in this device's range, tokens in order.
template <class Space, class T>
void scatter_add_rows(T* g, const T* dyp, const std::int32_t* id, std::size_t n, std::size_t d, std::size_t v0,
                      std::size_t vl) {
  for_column_blocks<Space>(d, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* gs = g;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t v = static_cast<std::size_t>(id[i]);
      if (v < v0 || v >= v0 + vl) continue;  // another device's row
      for (std::size_t j = j0; j < j1; ++j) gs[(v - v0) * d + j] += dyp[i * d + j];
    }
  });
}

}  // namespace meshlib::nn::detail
