// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The data loader: shuffles a dataset with a seeded permutation per epoch, cuts it into
/// global batches, hands each process only its rows of each global batch (as
/// `ds.shard(num_shards=process_count(), index=process_index())` does), and, where meshlib was
/// built with oneTBB, assembles the next batches on oneTBB worker threads while the caller trains.
///
/// @code
/// meshlib::nn::data_loader loader(data.train, {.global_batch = 256, .seed = 42,
///                                              .process_index = meshlib::distributed::process_index(),
///                                              .process_count = meshlib::distributed::process_count()});
/// for (std::size_t epoch = 0; epoch < 5; ++epoch) {
///   loader.start_epoch(epoch);
///   while (auto b = loader.next()) {
///     train_step(b->x, b->y, b->rows);  // this process's b->rows rows of global batch b->step
///   }
/// }
/// @endcode
///
/// Every process computes the same permutation (it depends only on seed and epoch), so the
/// processes' shares of a step are disjoint and together make the whole global batch. With
/// prefetching or without, the batches are the same, value for value.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#if defined(MESHLIB_ENABLE_TBB)
#include <tbb/task_group.h>
#endif

#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/errors.hpp"
#include "meshlib/nn/data/permutation.hpp"

namespace meshlib::nn {

/// @brief How a data_loader cuts and distributes batches.
struct loader_options {
  std::size_t global_batch = 0;   ///< rows of one global batch, over all processes
  std::uint64_t seed = 0;         ///< the shuffle's seed; the same on every process
  bool shuffle = true;            ///< false: examples in file order
  bool drop_last = true;          ///< drop the last, incomplete global batch of an epoch
  std::size_t process_index = 0;  ///< this process's share: rows [i*B/n, (i+1)*B/n) of each batch
  std::size_t process_count = 1;  ///< must divide global_batch
  std::size_t prefetch = 2;       ///< batches assembled ahead (oneTBB builds); 0: on demand
};

/// @brief This process's rows of one global batch. It owns its data: it stays valid after the
/// loader moves on.
struct batch {
  std::vector<float> x{};         ///< rows * features values, row-major
  std::vector<std::int32_t> y{};  ///< rows labels
  std::size_t rows = 0;           ///< this process's rows
  std::size_t features = 0;
  std::size_t global_offset = 0;  ///< row of the global batch where this process's rows start
  std::size_t global_rows = 0;    ///< rows of the whole global batch (global_batch but for a last,
                                  ///< incomplete batch kept by drop_last = false)
  std::size_t step = 0;           ///< index of the global batch in its epoch
  std::size_t epoch = 0;

  /// @brief The features of row `r` of this share.
  [[nodiscard]] std::span<const float> row(std::size_t r) const noexcept {
    return {x.data() + r * features, features};
  }
};

/// @brief Shuffles, batches and shards a dataset, one epoch at a time. A dataset passed as an
/// lvalue is read in place and must outlive the loader; one passed as an rvalue
/// (`data_loader(load_fashion_mnist().train, ...)`) is moved into the loader. Not thread-safe: one
/// thread calls start_epoch and next.
class data_loader {
 public:
  /// @brief A loader that reads `ds` in place (no copy); `ds` must outlive it.
  /// @throws meshlib::data_error when the options cannot batch the dataset: a global batch of 0,
  /// a process index outside [0, process_count), a global batch not divisible by the process
  /// count, no batch at all in an epoch, or a dataset whose vectors disagree with its counts.
  data_loader(const dataset& ds, loader_options options) : ds_(ds), options_(options) { check(); }

  /// @brief A loader that owns `ds` (a temporary would otherwise dangle).
  data_loader(dataset&& ds, loader_options options)
      : owned_(std::make_unique<const dataset>(std::move(ds))), ds_(*owned_), options_(options) {
    check();
  }

  data_loader(const data_loader&) = delete;
  data_loader& operator=(const data_loader&) = delete;

  /// Waits for batches still being assembled: they read the dataset and this loader.
  ~data_loader() { drain(); }

  /// @brief The dataset the loader reads.
  [[nodiscard]] const dataset& data() const noexcept { return ds_; }

  /// @brief Global batches per epoch: count / global_batch, rounded up when drop_last is false.
  [[nodiscard]] std::size_t steps_per_epoch() const noexcept { return steps_; }

  [[nodiscard]] const loader_options& options() const noexcept { return options_; }

  /// @brief True when batches are assembled ahead on oneTBB threads (a oneTBB build and
  /// prefetch > 0); false when next() assembles each batch itself.
  [[nodiscard]] bool prefetching() const noexcept {
#if defined(MESHLIB_ENABLE_TBB)
    return slots_ != nullptr;
#else
    return false;
#endif
  }

  /// @brief Starts epoch `epoch` (any number, in any order: the order depends only on seed and
  /// epoch), dropping what remains of the current one, and starts prefetching its first batches.
  void start_epoch(std::size_t epoch) {
    drain();
    epoch_ = epoch;
    if (options_.shuffle) {
      order_ = epoch_permutation(ds_.count, options_.seed, epoch);
    } else if (order_.size() != ds_.count) {
      order_.resize(ds_.count);
      for (std::size_t i = 0; i < ds_.count; ++i) order_[i] = i;
    }
    next_step_ = 0;
    started_ = true;
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      for (std::size_t s = 0; s < options_.prefetch && s < steps_; ++s) schedule(s);
    }
#endif
  }

  /// @brief This process's share of the next global batch of the epoch, or nullopt after the last.
  /// @throws meshlib::data_error before the first start_epoch.
  [[nodiscard]] std::optional<batch> next() {
    if (!started_) {
      throw data_error("meshlib: data_loader: next() called before start_epoch(epoch)");
    }
    if (next_step_ >= steps_) return std::nullopt;
    const std::size_t step = next_step_++;
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      slot& s = slots_[step % options_.prefetch];
      s.group.wait();
      std::optional<batch> ready = std::move(s.ready);
      s.ready.reset();
      const std::exception_ptr failure = std::exchange(s.failure, nullptr);
      // The slot is free: start the batch `prefetch` steps ahead before handing this one out.
      if (step + options_.prefetch < steps_) schedule(step + options_.prefetch);
      if (failure) std::rethrow_exception(failure);
      return ready;
    }
#endif
    return assemble(step);
  }

 private:
  /// The options against the dataset, and the steps per epoch; see the constructor.
  void check() {
    const dataset& ds = ds_;
    const loader_options& options = options_;
    const std::string where = "meshlib: data_loader: ";
    if (ds.x.size() != ds.count * ds.features || ds.y.size() != ds.count) {
      throw data_error(where + "the dataset is inconsistent: count " + std::to_string(ds.count) +
                       " and features " + std::to_string(ds.features) + " need " +
                       std::to_string(ds.count * ds.features) + " values and " +
                       std::to_string(ds.count) + " labels, found " + std::to_string(ds.x.size()) +
                       " and " + std::to_string(ds.y.size()));
    }
    if (options.global_batch == 0) {
      throw data_error(where + "global_batch is 0, expected at least 1");
    }
    if (options.process_count == 0) {
      throw data_error(where + "process_count is 0, expected at least 1");
    }
    if (options.process_index >= options.process_count) {
      throw data_error(where + "process_index " + std::to_string(options.process_index) +
                       " is out of range for process_count " +
                       std::to_string(options.process_count));
    }
    if (options.global_batch % options.process_count != 0) {
      throw data_error(where + "global batch " + std::to_string(options.global_batch) +
                       " does not split evenly over " + std::to_string(options.process_count) +
                       " processes (remainder " +
                       std::to_string(options.global_batch % options.process_count) +
                       "); choose a global batch divisible by the process count");
    }
    steps_ = options.drop_last ? ds.count / options.global_batch
                               : (ds.count + options.global_batch - 1) / options.global_batch;
    if (steps_ == 0) {
      throw data_error(where + "an epoch has no batch: the dataset has " +
                       std::to_string(ds.count) + " examples, fewer than the global batch of " +
                       std::to_string(options.global_batch) +
                       (ds.count ? " (with drop_last; set drop_last = false to keep them)" : ""));
    }
#if defined(MESHLIB_ENABLE_TBB)
    if (options.prefetch > 0) slots_ = std::make_unique<slot[]>(options.prefetch);
#endif
  }

  /// Rows [p*g/n, (p+1)*g/n) of the global batch `step`, g its size: the share of process p of n.
  [[nodiscard]] batch assemble(std::size_t step) const {
    const std::size_t start = step * options_.global_batch;
    const std::size_t global_rows = std::min(options_.global_batch, ds_.count - start);
    const std::size_t p = options_.process_index;
    const std::size_t n = options_.process_count;
    const std::size_t begin = p * global_rows / n;
    const std::size_t end = (p + 1) * global_rows / n;
    batch b;
    b.rows = end - begin;
    b.features = ds_.features;
    b.global_offset = begin;
    b.global_rows = global_rows;
    b.step = step;
    b.epoch = epoch_;
    b.x.resize(b.rows * b.features);
    b.y.resize(b.rows);
    for (std::size_t r = 0; r < b.rows; ++r) {
      const std::size_t example = order_[start + begin + r];
      std::memcpy(b.x.data() + r * b.features, ds_.x.data() + example * ds_.features,
                  ds_.features * sizeof(float));
      b.y[r] = ds_.y[example];
    }
    return b;
  }

#if defined(MESHLIB_ENABLE_TBB)
  /// One batch in flight. A task_group per slot lets next() wait for exactly the batch it needs;
  /// waiting in a task_group also runs queued tasks, so the caller helps instead of idling.
  struct slot {
    tbb::task_group group;
    std::optional<batch> ready;
    std::exception_ptr failure;
  };

  void schedule(std::size_t step) {
    slot& s = slots_[step % options_.prefetch];
    s.group.run([this, &s, step] {
      try {
        s.ready = assemble(step);
      } catch (...) {
        s.failure = std::current_exception();
      }
    });
  }
#endif

  void drain() noexcept {
#if defined(MESHLIB_ENABLE_TBB)
    if (slots_) {
      for (std::size_t i = 0; i < options_.prefetch; ++i) {
        slots_[i].group.wait();  // never throws: the tasks catch everything
        slots_[i].ready.reset();
        slots_[i].failure = nullptr;
      }
    }
#endif
  }

  std::unique_ptr<const dataset> owned_;  // set when constructed from an rvalue
  const dataset& ds_;
  loader_options options_;
  std::size_t steps_ = 0;
  std::size_t epoch_ = 0;
  std::size_t next_step_ = 0;
  bool started_ = false;
  std::vector<std::size_t> order_;
#if defined(MESHLIB_ENABLE_TBB)
  std::unique_ptr<slot[]> slots_;
#endif
};

}  // namespace meshlib::nn
