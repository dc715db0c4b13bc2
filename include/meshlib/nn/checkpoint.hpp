// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Checkpoints of a `train_state`: `save_checkpoint(dir, state)` and
/// `restore_checkpoint(dir, state)`, restorable on a *different* mesh and with or without ZeRO-1
/// (restore reshards). Layout (as Orbax / torch.distributed.checkpoint keep one file per array):
///
///     dir/index            text: format version, step, key, optimizer, then one line per
///                          parameter: name, dtype, global shape, sharding, FNV-1a checksums
///     dir/<name>.bin       the parameter's global array, row-major float32, filled from the
///                          blocks of the devices that own them (a replicated block once)
///     dir/<name>.opt<s>.bin  optimizer state slot s (momentum / Adam moments), same shape
///
/// Everything is written under `dir.tmp` and renamed to `dir` at the end, so an interrupted save
/// leaves the previous checkpoint intact and never a half-written one. A missing, truncated or
/// corrupted file, or a checkpoint of another model or optimizer, throws `checkpoint_error`
/// naming the file and the parameter; the state is not modified then.
///
/// Several processes (a state that holds only this process's devices, as under `mpirun`): every
/// process writes the blocks its devices own straight into the global files, at their places (no
/// gather: the bytes of a block go to disk once, from the process that holds them); process 0
/// sizes the files first and writes the index and renames last. `dir` must be on a file system
/// that every process sees. Restore reads the files on every process and takes its own blocks.
/// Each phase ends with an exchange of outcomes between the processes, so a failure on one of them
/// (a full disk, a missing file) throws `checkpoint_error` on all of them, naming the process,
/// instead of leaving the others waiting or with a different state.
/// @code
/// meshlib::nn::save_checkpoint("ckpt/step_1000", state);        // on a (4, 2) mesh
/// meshlib::nn::restore_checkpoint("ckpt/step_1000", other);     // on (2, 4): same numbers
/// meshlib::nn::save_checkpoint("ckpt/step_1000", part, ex);      // part of a multi-process state
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/process_exchange.hpp"

namespace meshlib::nn {

/// @brief A checkpoint that cannot be written or read (the message names the file and parameter).
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

inline std::uint64_t fnv1a(const char* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 0x100000001b3ull;
  return h;
}

inline std::string shape_text(const std::vector<std::size_t>& s) {
  std::string t;
  for (std::size_t i = 0; i < s.size(); ++i) t += (i ? "x" : "") + std::to_string(s[i]);
  return t.empty() ? "scalar" : t;
}

inline std::size_t product(const std::vector<std::size_t>& s) {
  std::size_t n = 1;
  for (auto e : s) n *= e;
  return n;
}

/// Global row-major index of element `i` of device `dev`'s block of `p`.
template <class T>
std::size_t global_index(const param_ref<T>& p, std::size_t dev, std::size_t i) {
  std::size_t flat = 0, rem = i;
  const std::size_t rank = p.shape.size();
  std::vector<std::size_t> idx(rank);
  for (std::size_t d = rank; d-- > 0;) {
    idx[d] = rem % p.extent[dev][d] + p.offset[dev][d];
    rem /= p.extent[dev][d];
  }
  for (std::size_t d = 0; d < rank; ++d) flat = flat * p.shape[d] + idx[d];
  return flat;
}

/// Calls `f(k, g, n)` for the runs of elements `[first, first + len)` of device `dev`'s block of
/// `p` that are contiguous in the global row-major array: block elements `k .. k + n` are global
/// elements `g .. g + n` (a run never crosses a row of the block's last dimension).
template <class T, class F>
void for_each_global_run(const param_ref<T>& p, std::size_t dev, std::size_t first, std::size_t len, F&& f) {
  const std::size_t row = p.shape.empty() ? len : p.extent[dev].back();
  for (std::size_t k = first, end = first + len; k < end;) {
    const std::size_t n = std::min(row - k % row, end - k);
    f(k, global_index(p, dev, k), n);
    k += n;
  }
}

/// Creates `path` holding `count` zero floats (the processes then write their blocks into it).
inline void create_file(const std::filesystem::path& path, std::size_t count) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + path.string() + "'");
  }
  std::error_code ec;
  std::filesystem::resize_file(path, count * sizeof(float), ec);
  if (ec) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + path.string() + "': " + ec.message());
}

/// A file of a checkpoint being written, open for writing blocks at their places.
class block_writer {
 public:
  explicit block_writer(std::filesystem::path path)
      : path_(std::move(path)), out_(path_, std::ios::in | std::ios::out | std::ios::binary) {
    if (!out_) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot open '" + path_.string() + "' to write");
  }
  /// Writes `n` floats at global element `at`.
  void write(std::size_t at, const float* src, std::size_t n) {
    out_.seekp(static_cast<std::streamoff>(at * sizeof(float)));
    out_.write(reinterpret_cast<const char*>(src), static_cast<std::streamsize>(n * sizeof(float)));
  }
  /// Flushes; throws when anything failed.
  void close() {
    out_.close();
    if (!out_) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + path_.string() + "'");
  }

 private:
  std::filesystem::path path_;
  std::fstream out_;
};

/// The FNV-1a checksum of a whole file (process 0 reads back what every process wrote).
inline std::uint64_t checksum_of(const std::filesystem::path& path, std::size_t count) {
  std::vector<char> data(count * sizeof(float));
  std::ifstream in(path, std::ios::binary);
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  if (!in) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot read back '" + path.string() + "'");
  return fnv1a(data.data(), data.size());
}

/// Runs `phase` on this process, then agrees with the others on the outcome: when any process
/// failed, every process throws (the failing one its own error, the others a `checkpoint_error`
/// naming the first failing process and its message), so no process goes on alone.
template <class F>
void agreed_phase(distributed::process_exchange& ex, const char* what, F&& phase) {
  std::exception_ptr mine;
  std::string text;
  try {
    phase();
  } catch (const std::exception& e) {
    mine = std::current_exception();
    text = e.what();
  } catch (...) {
    mine = std::current_exception();
  }
  if (mine && text.empty()) text = "unknown exception";
  if (ex.size() == 1) {
    if (mine) std::rethrow_exception(mine);
    return;
  }
  const auto all = ex.all_gather(text);
  if (mine) std::rethrow_exception(mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty())
      throw checkpoint_error(std::string("meshlib::nn: ") + what + ": process " + std::to_string(r) + " of " +
                             std::to_string(all.size()) + " failed: " + all[r]);
}

/// The exchange a state's checkpoint runs over: none for a state that holds every device; for a
/// partial one, `ex`, which must cover every device exactly once with its processes' devices.
template <class State>
distributed::process_exchange& exchange_for(const State& state, distributed::process_exchange* ex, const char* what) {
  static distributed::single_process_exchange single;
  const std::size_t n = state.mesh.size();
  if (state.local_devices().size() == n) return single;
  if (ex == nullptr || ex->size() == 1)
    throw checkpoint_error(std::string("meshlib::nn: ") + what + ": this train state holds " +
                           std::to_string(state.local_devices().size()) + " of the mesh's " + std::to_string(n) +
                           " devices, so the other processes take part: pass their process_exchange "
                           "(meshlib::mpi::exchange) or call distributed::initialize with one");
  std::string mine;
  for (std::size_t dev : state.local_devices()) mine += std::to_string(dev) + " ";
  std::vector<int> held(n, 0);
  for (const auto& devices : ex->all_gather(mine)) {
    std::istringstream in(devices);
    for (std::size_t d = 0; in >> d;)
      if (d < n) ++held[d];
  }
  for (std::size_t d = 0; d < n; ++d)
    if (held[d] != 1)
      throw checkpoint_error(std::string("meshlib::nn: ") + what + ": device " + std::to_string(d) + " is held by " +
                             std::to_string(held[d]) + " of the " + std::to_string(ex->size()) +
                             " processes; each device must belong to exactly one");
  return *ex;
}

/// Reads `path` (expected `count` floats with checksum `sum`) for parameter `param`.
inline std::vector<float> read_file(const std::filesystem::path& path, std::size_t count, std::uint64_t sum,
                                    const std::string& param) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (parameter '" + param +
                           "') is missing");
  if (size != count * sizeof(float))
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (parameter '" + param + "') has " +
                           std::to_string(size) + " bytes, expected " + std::to_string(count * sizeof(float)) +
                           " (" + std::to_string(count) + " float32): truncated or not this checkpoint's file");
  std::vector<float> data(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(size));
  if (!in) throw checkpoint_error("meshlib::nn: restore_checkpoint: cannot read '" + path.string() + "'");
  if (fnv1a(reinterpret_cast<const char*>(data.data()), size) != sum)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (parameter '" + param +
                           "') does not match its checksum in the index: the file is corrupted");
  return data;
}

}  // namespace detail

/// @brief Writes `state` (parameters, optimizer state, step, key) to directory `dir` (see the file
/// comment). A state that holds only this process's devices needs every process to call this with
/// the same `dir`; `ex` connects them (ignored for a state that holds every device).
/// @throws checkpoint_error when a file cannot be written, on this or (for a multi-process state)
/// any other process; the previous checkpoint in `dir` is then intact.
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  namespace fs = std::filesystem;
  auto& ex = detail::exchange_for(state, &ex_, "save_checkpoint");
  const bool first = ex.rank() == 0;
  fs::path tmp = dir;
  tmp += ".tmp";
  const std::size_t slots = state.opt.slots();
  const auto value_file = [&](const param_ref<float>& p) { return tmp / (p.name + ".bin"); };
  const auto opt_file = [&](const param_ref<float>& p, std::size_t s) {
    return tmp / (p.name + ".opt" + std::to_string(s) + ".bin");
  };
  // 1. Process 0: a fresh temporary directory, every file at its final size.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp, ec);
    if (ec) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot create '" + tmp.string() + "': " + ec.message());
    for (const auto& p : state.params) {
      detail::create_file(value_file(p), detail::product(p.shape));
      for (std::size_t s = 0; s < slots; ++s) detail::create_file(opt_file(p, s), detail::product(p.shape));
    }
  });
  // 2. Every process: the blocks its devices own, at their places. A block replicated over a group
  // of devices is written by the group's first device only, so every element is written once.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    for (std::size_t i = 0; i < state.params.size(); ++i) {
      const auto& p = state.params[i];
      detail::block_writer out(value_file(p));
      for (std::size_t dev : state.local_devices())
        if (state.mesh.group_rank(dev, state.mesh.all_axes & ~p.sharded_axes) == 0) {
          const float* v = state.master(i, dev);
          detail::for_each_global_run(p, dev, 0, p.count[dev],
                                      [&](std::size_t k, std::size_t g, std::size_t n) { out.write(g, v + k, n); });
        }
      out.close();
    }
    std::vector<detail::block_writer> opt;
    opt.reserve(state.params.size() * slots);
    for (const auto& p : state.params)
      for (std::size_t s = 0; s < slots; ++s) opt.emplace_back(opt_file(p, s));
    for (std::size_t dev : state.local_devices())
      state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, const float* st, std::size_t stride) {
        const auto& p = state.params[i];
        if (!state.owns_state(dev, p)) return;
        detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
          for (std::size_t s = 0; s < slots; ++s) opt[i * slots + s].write(g, st + s * stride + (k - off), n);
        });
      });
    for (auto& o : opt) o.close();
  });
  // 3. Process 0: the index (with the checksums of what every process wrote), then the rename.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    std::ostringstream index;
    index << "meshlib-checkpoint 1\nstep " << state.step << "\nkey " << state.key.value << "\noptimizer "
          << static_cast<int>(state.opt.kind) << " slots " << slots << "\nparameters " << state.params.size() << "\n";
    for (const auto& p : state.params) {
      const std::size_t count = detail::product(p.shape);
      index << "param " << p.name << " float32 " << detail::shape_text(p.shape) << " "
            << detail::checksum_of(value_file(p), count);
      for (std::size_t s = 0; s < slots; ++s) index << " " << detail::checksum_of(opt_file(p, s), count);
      index << " sharding " << p.sharding << "\n";
    }
    {
      std::ofstream out(tmp / "index", std::ios::trunc);
      out << index.str();
      if (!out) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + (tmp / "index").string() + "'");
    }
    std::error_code ec;
    fs::path old = dir;
    old += ".old";
    fs::remove_all(old, ec);
    if (fs::exists(dir)) fs::rename(dir, old);
    fs::rename(tmp, dir);
    fs::remove_all(old, ec);
  });
}

/// @brief `save_checkpoint` over the transport given to `distributed::initialize` (none needed for
/// a state that holds every device).
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state) {
  const auto ex = distributed::exchange();
  save_checkpoint(dir, state, *ex);
}

/// @brief Loads a checkpoint into `state`, whatever mesh, ZeRO setting or number of processes it
/// was saved with. A state that holds only this process's devices needs every process to call
/// this; `ex` connects them (ignored for a state that holds every device).
/// @throws checkpoint_error (the state is unchanged, on every process) for a missing, truncated or
/// corrupted file, or a checkpoint of another model (parameter names or shapes) or optimizer.
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  auto& ex = detail::exchange_for(state, &ex_, "restore_checkpoint");
  const std::size_t count = state.params.size(), slots = state.opt.slots();
  std::vector<std::vector<float>> values(count), opt(count * slots);
  std::size_t step = 0;
  std::uint64_t key = 0;
  detail::agreed_phase(ex, "restore_checkpoint", [&] {
    const auto index_path = dir / "index";
    std::ifstream in(index_path);
    if (!in)
      throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "' is missing: not a checkpoint");
    auto bad = [&](const std::string& what) {
      return checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "': " + what);
    };
    std::string word, version;
    std::size_t saved_slots = 0, saved_count = 0;
    int kind = 0;
    if (!(in >> word >> version) || word != "meshlib-checkpoint" || version != "1")
      throw bad("not a meshlib checkpoint index (version 1)");
    if (!(in >> word >> step) || word != "step" || !(in >> word >> key) || word != "key") throw bad("malformed header");
    if (!(in >> word >> kind >> version >> saved_slots) || word != "optimizer") throw bad("malformed optimizer line");
    if (kind != static_cast<int>(state.opt.kind) || saved_slots != slots)
      throw bad("saved with optimizer kind " + std::to_string(kind) + " (" + std::to_string(saved_slots) +
                " state slots), but the train state's optimizer is " + state.opt.name());
    if (!(in >> word >> saved_count) || word != "parameters") throw bad("malformed parameter count");
    if (saved_count != count)
      throw bad("holds " + std::to_string(saved_count) + " parameters, the model has " + std::to_string(count) +
                ": a checkpoint of another model");
    for (std::size_t i = 0; i < count; ++i) {
      const auto& p = state.params[i];
      std::string name, dtype, shape, line;
      std::uint64_t sum = 0;
      if (!(in >> word >> name >> dtype >> shape >> sum) || word != "param")
        throw bad("malformed line for parameter " + std::to_string(i));
      if (name != p.name)
        throw bad("parameter " + std::to_string(i) + " is '" + name + "', the model's is '" + p.name +
                  "': a checkpoint of another model");
      if (dtype != "float32") throw bad("parameter '" + name + "' has dtype " + dtype + ", expected float32");
      if (shape != detail::shape_text(p.shape))
        throw bad("parameter '" + name + "' has shape " + shape + " in the checkpoint, the model's is " +
                  detail::shape_text(p.shape) + ": a checkpoint of another model");
      values[i] = detail::read_file(dir / (name + ".bin"), detail::product(p.shape), sum, name);
      for (std::size_t s = 0; s < slots; ++s) {
        if (!(in >> sum)) throw bad("missing optimizer checksum of parameter '" + name + "'");
        opt[i * slots + s] =
            detail::read_file(dir / (name + ".opt" + std::to_string(s) + ".bin"), values[i].size(), sum, name);
      }
      std::getline(in, line);  // the sharding it was saved with: informative
    }
  });
  // Everything checked, on every process: scatter into this mesh's blocks (the reshard).
  for (std::size_t i = 0; i < count; ++i) {
    const auto& p = state.params[i];
    for (std::size_t dev : state.local_devices()) {
      float* v = state.master(i, dev);
      detail::for_each_global_run(p, dev, 0, p.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
        std::copy_n(values[i].data() + g, n, v + k);
      });
    }
  }
  state.refresh_compute_copies();  // a mixed-precision state rounds its restored float masters
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, float* st, std::size_t stride) {
      const auto& p = state.params[i];
      detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
        for (std::size_t s = 0; s < slots; ++s) std::copy_n(opt[i * slots + s].data() + g, n, st + s * stride + (k - off));
      });
    });
  state.step = step;
  state.key = rng_key{key};
}

/// @brief `restore_checkpoint` over the transport given to `distributed::initialize` (none needed
/// for a state that holds every device).
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state) {
  const auto ex = distributed::exchange();
  restore_checkpoint(dir, state, *ex);
}

}  // namespace meshlib::nn
