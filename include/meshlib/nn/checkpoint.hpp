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
/// Single process (every block local): multi-process runs gather first (not done yet).
/// @code
/// meshlib::nn::save_checkpoint("ckpt/step_1000", state);        // on a (4, 2) mesh
/// meshlib::nn::restore_checkpoint("ckpt/step_1000", other);     // on (2, 4): same numbers
/// @endcode

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/parameter.hpp"

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

inline void write_file(const std::filesystem::path& path, const std::vector<float>& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * sizeof(float)));
  if (!out) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + path.string() + "'");
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

/// @brief Writes `state` (parameters, optimizer state, step, key) to directory `dir` (see the file comment).
/// @throws checkpoint_error when a file cannot be written.
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state) {
  namespace fs = std::filesystem;
  fs::path tmp = dir;
  tmp += ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot create '" + tmp.string() + "': " + ec.message());
  const std::size_t slots = state.opt.slots();
  std::vector<std::vector<float>> values(state.params.size()), opt(state.params.size() * slots);
  for (std::size_t i = 0; i < state.params.size(); ++i) {
    const auto& p = state.params[i];
    values[i].assign(detail::product(p.shape), 0.0f);
    for (std::size_t s = 0; s < slots; ++s) opt[i * slots + s].assign(values[i].size(), 0.0f);
    for (std::size_t dev : state.local_devices())
      if (state.mesh.group_rank(dev, state.mesh.all_axes & ~p.sharded_axes) == 0)
        for (std::size_t k = 0; k < p.count[dev]; ++k) values[i][detail::global_index(p, dev, k)] = p.value[dev][k];
  }
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, const float* st, std::size_t stride) {
      const auto& p = state.params[i];
      if (!state.owns_state(dev, p)) return;
      for (std::size_t s = 0; s < slots; ++s)
        for (std::size_t k = 0; k < len; ++k)
          opt[i * slots + s][detail::global_index(p, dev, off + k)] = st[s * stride + k];
    });
  std::ostringstream index;
  index << "meshlib-checkpoint 1\nstep " << state.step << "\nkey " << state.key.value << "\noptimizer "
        << static_cast<int>(state.opt.kind) << " slots " << slots << "\nparameters " << state.params.size() << "\n";
  for (std::size_t i = 0; i < state.params.size(); ++i) {
    const auto& p = state.params[i];
    detail::write_file(tmp / (p.name + ".bin"), values[i]);
    index << "param " << p.name << " float32 " << detail::shape_text(p.shape) << " "
          << detail::fnv1a(reinterpret_cast<const char*>(values[i].data()), values[i].size() * sizeof(float));
    for (std::size_t s = 0; s < slots; ++s) {
      const auto& o = opt[i * slots + s];
      detail::write_file(tmp / (p.name + ".opt" + std::to_string(s) + ".bin"), o);
      index << " " << detail::fnv1a(reinterpret_cast<const char*>(o.data()), o.size() * sizeof(float));
    }
    index << " sharding " << p.sharding << "\n";
  }
  {
    std::ofstream out(tmp / "index", std::ios::trunc);
    out << index.str();
    if (!out) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot write '" + (tmp / "index").string() + "'");
  }
  fs::path old = dir;
  old += ".old";
  fs::remove_all(old, ec);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  fs::remove_all(old, ec);
}

/// @brief Loads a checkpoint into `state`, whatever mesh or ZeRO setting it was saved with.
/// @throws checkpoint_error (the state is unchanged) for a missing, truncated or corrupted file, or
/// a checkpoint of another model (parameter names or shapes) or optimizer.
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state) {
  const auto index_path = dir / "index";
  std::ifstream in(index_path);
  if (!in) throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "' is missing: not a checkpoint");
  auto bad = [&](const std::string& what) {
    return checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "': " + what);
  };
  std::string word, version;
  std::size_t step = 0, slots = 0, count = 0;
  std::uint64_t key = 0;
  int kind = 0;
  if (!(in >> word >> version) || word != "meshlib-checkpoint" || version != "1") throw bad("not a meshlib checkpoint index (version 1)");
  if (!(in >> word >> step) || word != "step" || !(in >> word >> key) || word != "key") throw bad("malformed header");
  if (!(in >> word >> kind >> version >> slots) || word != "optimizer") throw bad("malformed optimizer line");
  if (kind != static_cast<int>(state.opt.kind) || slots != state.opt.slots())
    throw bad("saved with optimizer kind " + std::to_string(kind) + " (" + std::to_string(slots) +
              " state slots), but the train state's optimizer is " + state.opt.name());
  if (!(in >> word >> count) || word != "parameters") throw bad("malformed parameter count");
  if (count != state.params.size())
    throw bad("holds " + std::to_string(count) + " parameters, the model has " + std::to_string(state.params.size()) +
              ": a checkpoint of another model");
  std::vector<std::vector<float>> values(count), opt(count * slots);
  for (std::size_t i = 0; i < count; ++i) {
    const auto& p = state.params[i];
    std::string name, dtype, shape, line;
    std::uint64_t sum = 0;
    if (!(in >> word >> name >> dtype >> shape >> sum) || word != "param") throw bad("malformed line for parameter " + std::to_string(i));
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
      opt[i * slots + s] = detail::read_file(dir / (name + ".opt" + std::to_string(s) + ".bin"), values[i].size(), sum, name);
    }
    std::getline(in, line);  // the sharding it was saved with: informative
  }
  // Everything checked: scatter into this mesh's blocks (the reshard).
  for (std::size_t i = 0; i < count; ++i) {
    const auto& p = state.params[i];
    for (std::size_t dev : state.local_devices())
      for (std::size_t k = 0; k < p.count[dev]; ++k) p.value[dev][k] = values[i][detail::global_index(p, dev, k)];
  }
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, float* st, std::size_t stride) {
      const auto& p = state.params[i];
      for (std::size_t s = 0; s < slots; ++s)
        for (std::size_t k = 0; k < len; ++k) st[s * stride + k] = opt[i * slots + s][detail::global_index(p, dev, off + k)];
    });
  state.step = step;
  state.key = rng_key{key};
}

}  // namespace meshlib::nn
