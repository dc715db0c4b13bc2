// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Per-device scratch buffers of the training layers, so a training step allocates nothing
/// after its first iteration.
///
/// A layer owns one buffer slot per device; only that device's thread grows or reads its slot (the
/// reference-count rule of docs/tensors.md: a device copies and drops only its own handles). The
/// tensors a layer returns wrap these buffers (unmanaged views): they stay valid until the layer's
/// next forward / backward on that device.
///
/// Two hooks let `remat` (nn/remat.hpp) and the activation measure of `train_step` see these
/// buffers without every layer reporting its own: a thread-local `buffer_meter` counts the bytes of
/// the slots allocated while it is active (each slot remembers the meter that counted it, so a
/// slot released or regrown later is taken off that meter and no count goes negative), and a
/// thread-local `release_scope` records every slot used while it is active, so `remat` can free
/// the buffers of the block it wraps after forward and let backward reallocate them.

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/permutes.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/pointer_check.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// The bytes of layer buffers one device holds (see the file comment): `live` now, `peak` the
/// most since `reset_peak`. Only that device's thread touches it.
struct buffer_meter {
  std::size_t live = 0;  ///< bytes allocated now in the slots this meter counted
  std::size_t peak = 0;  ///< the most `live` reached since the last `reset_peak`
  void add(std::size_t n) noexcept {
    live += n;
    peak = std::max(peak, live);
  }
  void remove(std::size_t n) noexcept { live -= std::min(n, live); }
  void reset_peak() noexcept { peak = live; }
};
/// The meter that counts the slots the calling thread allocates (null: none).
inline buffer_meter*& active_meter() noexcept {
  thread_local buffer_meter* m = nullptr;
  return m;
}
/// Makes `m` the calling thread's meter until the end of the scope (then the previous one again).
class meter_scope {
 public:
  explicit meter_scope(buffer_meter* m) noexcept : prev_(active_meter()) { active_meter() = m; }
  ~meter_scope() { active_meter() = prev_; }
  meter_scope(const meter_scope&) = delete;
  meter_scope& operator=(const meter_scope&) = delete;

 private:
  buffer_meter* prev_;
};

/// A slot of some `device_buffers<T>`, with the function that frees it (type-erased so one scope
/// records buffers of every element type).
struct buffer_slot_ref {
  void* slot = nullptr;
  void (*release)(void*) noexcept = nullptr;
  bool (*holds)(const void*, const void*) noexcept = nullptr;  ///< whether the slot's block holds an address
  friend bool operator==(const buffer_slot_ref&, const buffer_slot_ref&) = default;
};
/// The slots used on the calling thread while it is active (see the file comment). Scopes nest:
/// only the innermost records. A copy starts empty (its slots would be another object's).
class release_scope {
 public:
  release_scope() = default;
  release_scope(const release_scope&) noexcept {}
  release_scope& operator=(const release_scope&) noexcept {
    slots_.clear();
    return *this;
  }
  release_scope(release_scope&&) noexcept = default;  // the slots' vectors move with their owners
  release_scope& operator=(release_scope&&) noexcept = default;
  ~release_scope() = default;

  /// Frees every recorded slot but the one whose block holds `keep` (the memory goes back to
  /// Kokkos; the next `get` allocates again). The kept slot stays recorded: the next call frees it
  /// unless it holds that call's `keep`.
  void release_except(const void* keep) noexcept {
    dedupe();
    std::size_t kept = 0;
    for (const auto& s : slots_) {
      if (keep != nullptr && s.holds(s.slot, keep)) slots_[kept++] = s;
      else s.release(s.slot);
    }
    slots_.resize(kept);
  }
  void record(buffer_slot_ref s) {
    if (slots_.empty() || !(slots_.back() == s)) slots_.push_back(s);
    if (slots_.size() > 2 * unique_) dedupe();
  }
  /// Makes this scope the calling thread's recorder until `leave` (restoring the previous one).
  void enter() noexcept {
    prev_ = current();
    current() = this;
  }
  void leave() noexcept { current() = prev_; }
  static release_scope*& current() noexcept {
    thread_local release_scope* s = nullptr;
    return s;
  }

 private:
  void dedupe() {
    if (slots_.empty()) return;
    std::sort(slots_.begin(), slots_.end(),
              [](const buffer_slot_ref& a, const buffer_slot_ref& b) { return a.slot < b.slot; });
    slots_.erase(std::unique(slots_.begin(), slots_.end()), slots_.end());
    unique_ = std::max<std::size_t>(slots_.size(), 16);
  }
  std::vector<buffer_slot_ref> slots_;
  std::size_t unique_ = 16;
  release_scope* prev_ = nullptr;
};

/// One growable buffer per device (see the file comment).
template <class T>
class device_buffers {
 public:
  device_buffers() = default;
  explicit device_buffers(std::size_t devices) : bufs_(devices) {}
  void resize_devices(std::size_t devices) { bufs_.resize(devices); }
  /// Device `dev`'s buffer of at least `n` elements (contents unspecified when it grew).
  T* get(std::size_t dev, std::size_t n) {
    auto& s = bufs_.at(dev);
    if (s.view.extent(0) < n) {
      if (s.meter != nullptr) s.meter->remove(s.bytes);
      s.view = view_t();  // the old block goes before the new one comes: the meter's peak is real
      s.view = meshlib::allocate<T, 1>({n}, "meshlib::nn::buffer", false);
      s.bytes = n * sizeof(T);
      s.meter = active_meter();
      if (s.meter != nullptr) s.meter->add(s.bytes);
    }
    if (release_scope* r = release_scope::current()) r->record(slot_ref(dev));
    return s.view.data();
  }
  /// Device `dev`'s buffer of `n` elements, zero-filled (a Kokkos kernel on the running device's instance).
  T* zeros(std::size_t dev, std::size_t n) {
    T* p = get(dev, n);
    meshlib::launch<default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
    return p;
  }
  /// `n` values of the caller's host memory at `src`, readable by kernels in the buffers' memory
  /// space: `src` itself where the host's memory is that space's, else a copy in device `dev`'s buffer.
  const T* readable(std::size_t dev, const T* src, std::size_t n) {
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      return src;
    } else {
      T* p = get(dev, n);
      meshlib::copy_from_host<default_memory_space>(p, src, n);
      return p;
    }
  }
  /// `n` values at `src`, which may be host or device memory (a caller's span), readable by the
  /// running device's kernels: `src` itself where they can read it (any pointer on a host space;
  /// device memory of the running GPU, asked with `is_readable_by_running_device`), else a copy in device
  /// `dev`'s buffer (`readable`).
  const T* staged(std::size_t dev, const T* src, std::size_t n) {
    if (meshlib::is_readable_by_running_device<default_memory_space>(src)) return src;
    return readable(dev, src, n);
  }
  /// Frees device `dev`'s buffer (the next `get` allocates again).
  void release(std::size_t dev) noexcept { release_slot(&bufs_.at(dev)); }
  /// Device `dev`'s buffer as a slot a `release_scope` can free.
  buffer_slot_ref slot_ref(std::size_t dev) { return {&bufs_.at(dev), &release_slot, &slot_holds}; }

 private:
  using view_t = meshlib::block_view<T, 1, default_memory_space>;
  struct slot {
    view_t view;
    buffer_meter* meter = nullptr;  // the meter that counted `bytes` (not owned)
    std::size_t bytes = 0;
  };
  static void release_slot(void* p) noexcept {
    auto& s = *static_cast<slot*>(p);
    if (s.meter != nullptr) s.meter->remove(s.bytes);
    s.view = view_t();
    s.meter = nullptr;
    s.bytes = 0;
  }
  static bool slot_holds(const void* p, const void* address) noexcept {
    const auto& s = *static_cast<const slot*>(p);
    const auto* a = static_cast<const unsigned char*>(address);
    const auto* b = reinterpret_cast<const unsigned char*>(s.view.data());
    return b != nullptr && a >= b && a < b + s.bytes;
  }
  std::vector<slot> bufs_;
};

/// A rank-1 local tensor of type `L` over `n` elements at `data` (not owned: a caller's buffer,
/// which the donated collectives reduce in place).
template <local_tensor_type L>
L wrap1(typename L::value_type* data, std::size_t n, const typename L::mesh_type& mesh, std::size_t dev) {
  return L(typename L::view_type(data, n), mesh, dev);
}

/// A local tensor of type `L` over `data` (not owned), `rows x cols`.
template <local_tensor_type L>
L wrap2(typename L::value_type* data, std::size_t rows, std::size_t cols, const typename L::mesh_type& mesh,
        std::size_t dev) {
  return L(typename L::view_type(data, rows, cols), mesh, dev);
}

/// The type `psum<Names...>` gives `L` (the compiler checks the rule; nothing runs).
template <class L, fixed_string... Names>
using psum_t = decltype(meshlib::psum<Names...>(std::declval<const L&>()));
/// The type `pvary<Names...>` gives `L`.
template <class L, fixed_string... Names>
using pvary_t = decltype(meshlib::pvary<Names...>(std::declval<const L&>()));

template <class L, fixed_string... Names>
struct psum_of {
  using type = psum_t<L, Names...>;
};
template <class L, fixed_string... Names>
struct pvary_of {
  using type = pvary_t<L, Names...>;
};

/// `psum_t<L, Names...>` when `B`, else `L`, without naming the psum otherwise (its axes may not
/// exist on this mesh). A conditional, not a specialisation on `<true, L, Names...>`: nvcc's front
/// end matches no partial specialisation over a pack of `fixed_string`s (collectives/axis_group.hpp).
template <bool B, class L, fixed_string... Names>
struct psum_if {
  using type = typename std::conditional_t<B, psum_of<L, Names...>, std::type_identity<L>>::type;
};
/// `pvary_t<L, Names...>` when `B`, else `L`.
template <bool B, class L, fixed_string... Names>
struct pvary_if {
  using type = typename std::conditional_t<B, pvary_of<L, Names...>, std::type_identity<L>>::type;
};

/// `pvary<Names...>(x)` without a copy (pvary moves no data; only the type changes).
template <fixed_string... Names, local_tensor_type L>
pvary_t<L, Names...> pvary_view(const L& x) {
  using R = pvary_t<L, Names...>;
  return R(x.view(), x.mesh(), x.device());
}

/// Global offset of this device's block along dimension `d` of `L` (its rank in the group of the
/// axes that shard `d`, times the block extent).
template <local_tensor_type L>
std::size_t global_offset(const L& x, std::size_t d) {
  return x.mesh().group_rank(x.device(), L::dims_type::at(d)) * x.extent(d);
}

/// Per-device run tables of multi-tensor kernels (nn/detail/simd.hpp, `run_table`) in the kernels'
/// memory. A step's runs are the same every step (the same parameters, gradients and state), so a
/// table is copied to the device only when it differs from the one there: once, not per step (on a
/// GPU each copy is a transfer the step would wait for). Only device `dev`'s thread uses slot `dev`.
class run_table_buffers {
 public:
  run_table_buffers() = default;
  explicit run_table_buffers(std::size_t devices) : tables_(devices), last_(devices) {}
  /// Device `dev`'s copy of `words` in the kernels' memory, valid until the next call for `dev`.
  const std::size_t* upload(std::size_t dev, const std::vector<std::size_t>& words) {
    auto& last = last_.at(dev);
    std::size_t* p = tables_.get(dev, words.size());
    if (p != last.at || last.words != words) {
      meshlib::copy_from_host<default_memory_space>(p, words.data(), words.size());
      last.at = p;
      last.words = words;
    }
    return p;
  }

 private:
  struct uploaded {
    const std::size_t* at = nullptr;  ///< where the table was copied to
    std::vector<std::size_t> words;   ///< what was copied there
  };
  device_buffers<std::size_t> tables_;
  std::vector<uploaded> last_;
};

}  // namespace meshlib::nn::detail
