// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Putting a batch where the model's kernels run: `device_put` of a `batch` (JAX's
/// `jax.device_put(batch)`, PyTorch's `batch.to(device, non_blocking=True)`) and
/// `device_prefetcher`, which copies the next batch while the current step computes (flax's
/// `prefetch_to_device`, a DataLoader with `pin_memory=True`).
///
/// Why: the data loader assembles batches in host memory. On a host backend the model reads them
/// in place; on a GPU a kernel handed a host address fails at some later fence with an illegal
/// address, or reads garbage. `train_step` and `evaluate` therefore never hand a kernel a pointer it
/// cannot read: they ask where the input is (tensor/pointer_check.hpp) and stage host rows into each
/// device's buffer themselves, synchronously. A `device_batch` from `device_put` or a
/// `device_prefetcher` is already in device memory: the step reads it in place, and with the
/// prefetcher the copy of step k+1 ran on a copy stream of its own while step k computed.
///
/// How the copy is made: the rows are written into pinned (page-locked) host memory, then copied to
/// the device asynchronously on the prefetcher's own execution-space instance (its own CUDA stream),
/// which is fenced only when the batch is handed out. On a host backend there is nothing to copy:
/// `device_put` of an rvalue batch moves its rows in, and the prefetcher hands the loader's batches
/// through.
///
/// The labels stay in host memory as well (`device_batch::y`): the loss checks every label against
/// the class count on the host before a kernel reads it, and copies the 4 bytes a row itself.
/// @code
/// nn::data_loader loader(data.train, {.global_batch = 256, .seed = 0});
/// nn::device_prefetcher batches(loader);              // flax: prefetch_to_device(iterator, 2)
/// batches.start_epoch(epoch);
/// while (auto b = batches.next()) nn::train_step(state, *b, runner);
/// auto one = nn::device_put(*loader.next());           // jax.device_put(batch)
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "meshlib/nn/data/errors.hpp"
#include "meshlib/nn/data/loader.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

/// @brief This process's rows of one global batch with its features in the memory the model's
/// kernels read (`default_memory_space`): a `batch` after `device_put`. The labels stay on the host.
/// Copies share the features (a Kokkos view's reference semantics).
struct device_batch {
  /// `rows * features` values, row-major, in `default_memory_space`
  Kokkos::View<float*, default_memory_space> x{};
  std::vector<std::int32_t> y{};  ///< `rows` labels, in host memory
  std::size_t rows = 0;           ///< this process's rows
  std::size_t features = 0;       ///< values per row
  std::size_t global_offset = 0;  ///< row of the global batch where this process's rows start
  std::size_t global_rows = 0;    ///< rows of the whole global batch
  std::size_t step = 0;           ///< index of the global batch in its epoch
  std::size_t epoch = 0;          ///< the epoch this batch belongs to
  /// On a host space, the rows `x` views (moved in from the batch, not copied); empty otherwise.
  std::shared_ptr<const std::vector<float>> host_rows{};
};

namespace detail {

/// The batch's fields but the features.
inline device_batch device_batch_header(const batch& b) {
  device_batch d;
  d.y = b.y;
  d.rows = b.rows;
  d.features = b.features;
  d.global_offset = b.global_offset;
  d.global_rows = b.global_rows;
  d.step = b.step;
  d.epoch = b.epoch;
  return d;
}

}  // namespace detail

/// @brief `jax.device_put(batch)`: the batch's features copied into `default_memory_space`, and
/// waited for (`device_prefetcher` overlaps the copy with the step instead). On a host space
/// nothing is copied: the rows move into the result (pass the batch as an rvalue; an lvalue is
/// copied first).
[[nodiscard]] inline device_batch device_put(batch b) {
  device_batch d = detail::device_batch_header(b);
  if constexpr (meshlib::host_accessible_v<default_memory_space>) {
    d.host_rows = std::make_shared<const std::vector<float>>(std::move(b.x));
    d.x = Kokkos::View<float*, default_memory_space>(const_cast<float*>(d.host_rows->data()), d.host_rows->size());
  } else {
    d.x = Kokkos::View<float*, default_memory_space>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::device_batch"), b.x.size());
    Kokkos::deep_copy(d.x, Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
                               b.x.data(), b.x.size()));
  }
  return d;
}

/// @brief Copies the next batches of a `data_loader` into device memory while the current step
/// computes: flax's `prefetch_to_device(iterator, 2)` (see the file comment). On a device space one
/// batch is in flight ahead of the one handed out; on a host space, with no copy to overlap, each
/// batch is taken from the loader when asked for (its rows then still in the cache for the step).
/// Not thread-safe; the loader must outlive it, and only the prefetcher calls the loader's
/// `start_epoch` / `next` while it is in use.
class device_prefetcher {
 public:
  /// @brief A prefetcher over `loader` (read in place; it must outlive the prefetcher).
  explicit device_prefetcher(data_loader& loader) : loader_(loader) {}
  device_prefetcher(const device_prefetcher&) = delete;
  device_prefetcher& operator=(const device_prefetcher&) = delete;
  ~device_prefetcher() { wait(); }

  /// @brief Starts epoch `epoch` of the loader and the copy of its first batch.
  void start_epoch(std::size_t epoch) {
    wait();
    loader_.start_epoch(epoch);
    started_ = true;
    if constexpr (!meshlib::host_accessible_v<default_memory_space>) ahead_ = issue(loader_.next());
  }

  /// @brief The next batch of the epoch in device memory (nullopt after the last), and starts the
  /// copy of the one after it. @throws meshlib::data_error before the first `start_epoch`.
  [[nodiscard]] std::optional<device_batch> next() {
    if (!started_) throw data_error("meshlib: device_prefetcher: next() called before start_epoch(epoch)");
    if constexpr (meshlib::host_accessible_v<default_memory_space>) {
      // On a host space there is no copy to overlap, so nothing runs ahead: the batch is assembled
      // when asked for and its rows are still in the cache when the step's first layer reads them
      // (assembled a step ahead, the step in between may have evicted them), and one batch is
      // held, not two.
      return issue(loader_.next());
    }
    wait();
    std::optional<device_batch> out = std::move(ahead_);
    ahead_.reset();
    if (out) ahead_ = issue(loader_.next());
    return out;
  }

  /// @brief Whether batches are copied (a device memory space) or handed through (host).
  [[nodiscard]] static constexpr bool copies() noexcept {
    return !meshlib::host_accessible_v<default_memory_space>;
  }

  /// The loader it reads.
  [[nodiscard]] data_loader& loader() noexcept { return loader_; }

 private:
  using device_view = Kokkos::View<float*, default_memory_space>;

  /// The features of `b` into a device view: moved in on a host space; on a device space written
  /// into the pinned stage and copied asynchronously on the copy instance.
  std::optional<device_batch> issue(std::optional<batch> b) {
    started_ = true;
    if (!b) return std::nullopt;
    if constexpr (!copies()) {
      return device_put(std::move(*b));
    } else {
      device_batch d = detail::device_batch_header(*b);
      stage(*b, d);
      return d;
    }
  }

  /// The device path: one pinned stage (the last copy was waited for before this one is written),
  /// and a ring of device buffers reused when nobody else holds them.
  void stage(const batch& b, device_batch& d) {
#if KOKKOS_VERSION >= 40000
    const std::size_t n = b.x.size();
    if (pinned_.extent(0) < n)
      pinned_ = pinned_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::pinned_batch"), n);
    std::memcpy(pinned_.data(), b.x.data(), n * sizeof(float));
    device_view& slot = ring_[next_slot_];
    next_slot_ = (next_slot_ + 1) % ring_.size();
    if (slot.extent(0) != n || slot.use_count() > 1)  // a batch the caller still holds is not overwritten
      slot = device_view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshlib::nn::device_batch"), n);
    if (!copy_) copy_.emplace(Kokkos::Experimental::partition_space(Kokkos::DefaultExecutionSpace(), 1)[0]);
    Kokkos::deep_copy(*copy_, slot, Kokkos::subview(pinned_, std::make_pair(std::size_t{0}, n)));
    in_flight_ = true;
    d.x = slot;
#else
    (void)b;
    (void)d;
    static_assert(!copies(), "meshlib: device_prefetcher: a device memory space needs Kokkos 4");
#endif
  }

  /// Waits for the copy in flight, if any.
  void wait() {
#if KOKKOS_VERSION >= 40000
    if (in_flight_ && copy_) copy_->fence("meshlib::nn::device_prefetcher");
#endif
    in_flight_ = false;
  }

#if KOKKOS_VERSION >= 40000
  using pinned_view = Kokkos::View<float*, Kokkos::SharedHostPinnedSpace>;
  pinned_view pinned_{};
  std::optional<Kokkos::DefaultExecutionSpace> copy_{};
#endif
  data_loader& loader_;
  std::optional<device_batch> ahead_{};
  std::array<device_view, 3> ring_{};
  std::size_t next_slot_ = 0;
  bool in_flight_ = false;
  bool started_ = false;
};

}  // namespace meshlib::nn
