// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Checkpoints of a `train_state`: `save_checkpoint(dir, state)` and
/// `restore_checkpoint(dir, state)`, restorable on a *different* mesh and with or without ZeRO-1
/// (restore reshards). Layout (as Orbax / torch.distributed.checkpoint keep one file per array):
///
///     dir/meshlib-checkpoint    marks the directory as meshlib's (written first; only its name counts)
///     dir/index                 the current checkpoint, text: format, generation G, step, key,
///                               optimizer, one line per parameter (name, dtype, global shape, the
///                               FNV-1a checksums of its files, sharding), then (only for a
///                               model that has any) one line per buffer, then the checksum of
///                               every byte above it
///     dir/<name>.g<G>.bin       the parameter's (or buffer's) global array, row-major float32,
///                               filled from the blocks of the devices that own them (a
///                               replicated block once)
///     dir/<name>.g<G>.opt<s>.bin  optimizer state slot s (momentum / Adam moments), same shape
///     dir/<name>.g<G>.state.bin   the optimizer's per-parameter state (Adafactor's factored second
///                               moment: `param_state_size` floats, the same on every mesh), when
///                               it keeps any; the index line names its size and checksum
///     dir/pending               while a save runs: the files it creates (its own checksum)
///
/// Why a save is atomic: the index names its generation, and a save never touches the files of
/// the generation the current index names. It writes generation G + 1 beside it (journalled in
/// `pending` first, so what it created is known if it dies), syncs every file, writes `index.tmp`,
/// syncs it, and commits with ONE `rename(index.tmp, index)`, which POSIX makes atomic: a reader
/// sees the old index or the new one, never a mix, and each names a complete set of files. Only
/// then are the old generation's files and the journal removed (a failure there is harmless: the
/// next save removes them). So a save that fails (a write, a sync or the rename: EIO, ENOSPC) or a
/// process killed at any point leaves `dir` restoring the previous checkpoint, or the new one once
/// the rename happened; the next save clears what the dead one left.
///
/// What is never deleted: a save refuses (checkpoint_error, nothing written) a non-empty `dir` that
/// is not meshlib's (no `meshlib-checkpoint` marker and no meshlib `index`), and in its own
/// directory it removes only files it names itself: those of an index it wrote, and those of the
/// journal of a save that did not finish. Files you add to a checkpoint directory stay.
///
/// Buffers: the arrays a layer keeps but does not train, `batch_norm`'s running mean and variance
/// (PyTorch's buffers, flax's `batch_stats` collection), which evaluation uses. The model shows them
/// through `collect_buffers` (`detail::collect_buffers_of`); they are saved and restored as the
/// parameters are (resharded, checksummed), without optimizer state. An index written before buffers
/// were saved, or by a model without any, has no buffer lines: restoring it leaves the model's
/// buffers as they are (the parameters, step and key are restored). A checkpoint whose buffers differ
/// from the model's (names, count, shapes) is refused, naming the buffer and its layer.
///
/// Why every byte is verified: restore reads the index whole and checks its last line, the
/// FNV-1a checksum of everything before it, before believing any field (step, key, optimizer,
/// shapes); FNV-1a changes under any single-byte substitution, so an edited or damaged index is
/// refused rather than restored into a different state. Each data file is checked against its
/// checksum in the index. A missing, truncated or corrupted file, or a checkpoint of another model
/// or optimizer, throws `checkpoint_error` naming the file (and parameter); the state is not
/// modified then. Every failure of a save or restore is a `checkpoint_error` naming the path.
///
/// Several processes (a state that holds only this process's devices, as under `mpirun`): every
/// process writes the blocks its devices own straight into the global files, at their places (no
/// gather: the bytes of a block go to disk once, from the process that holds them); process 0
/// creates the files first and writes the index and commits last. `dir` must be on a file system
/// that every process sees. Restore reads the files on every process and takes its own blocks.
/// Each phase ends with an exchange of outcomes between the processes, so a failure on one of them
/// (a full disk, a missing file) throws `checkpoint_error` on all of them, naming the process,
/// instead of leaving the others waiting or with a different state.
/// @code
/// meshlib::nn::save_checkpoint("ckpt/step_1000", state);        // on a (4, 2) mesh
/// meshlib::nn::restore_checkpoint("ckpt/step_1000", other);     // on (2, 4): same numbers
/// meshlib::nn::save_checkpoint("ckpt/step_1000", part, ex);      // part of a multi-process state
/// @endcode

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <sstream>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/core/hash.hpp"
#include "meshlib/nn/optimizer.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/process_exchange.hpp"
#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn {

/// @brief A checkpoint that cannot be written or read (the message names the file and parameter).
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

/// The file operations a save makes, the vocabulary of the fault-injection seam below.
enum class checkpoint_op { make_dir, create, open, write, sync, close, rename, remove };

/// Test seam, off (null) by default: when set, it is called before each file operation of a save
/// with the operation and its path, and a non-zero result is an errno that the operation then
/// fails with, as the operating system would report it (EIO, ENOSPC). It costs one test of a
/// pointer per operation (per file or buffered run, never per element). The tests fail, or kill
/// the process at, each operation of a save in turn (tests/unit/nn/test_checkpoint.cpp).
using checkpoint_fault_hook = int (*)(checkpoint_op, const std::filesystem::path&);
inline checkpoint_fault_hook checkpoint_fault = nullptr;

inline const char* verb_of(checkpoint_op op) noexcept {
  switch (op) {
    case checkpoint_op::make_dir: return "create the directory";
    case checkpoint_op::create: return "create";
    case checkpoint_op::open: return "open";
    case checkpoint_op::write: return "write";
    case checkpoint_op::sync: return "sync (fsync)";
    case checkpoint_op::close: return "close";
    case checkpoint_op::rename: return "rename";
    case checkpoint_op::remove: return "remove";
  }
  return "use";
}

/// The file operations of one save of `dir`: each goes through the seam, and a failure is a
/// `checkpoint_error` naming the file, the system's reason and what `dir` holds then.
class save_io {
 public:
  explicit save_io(std::filesystem::path dir) : dir_(std::move(dir)) {}
  [[nodiscard]] const std::filesystem::path& dir() const noexcept { return dir_; }

  /// Runs `real()` (which returns 0 or an errno) as operation `op` on `path`.
  template <class F>
  void run(checkpoint_op op, const std::filesystem::path& path, F&& real, const std::string& about = {}) const {
    int err = checkpoint_fault != nullptr ? checkpoint_fault(op, path) : 0;
    if (err == 0) err = real();
    if (err != 0) throw failure(op, path, err, about);
  }
  /// As `run`, returning the errno instead of throwing (the clean-up after the commit, where a
  /// failure only leaves a file that the next save removes).
  template <class F>
  int quietly(checkpoint_op op, const std::filesystem::path& path, F&& real) const noexcept {
    int err = checkpoint_fault != nullptr ? checkpoint_fault(op, path) : 0;
    if (err == 0) err = real();
    return err;
  }
  [[nodiscard]] checkpoint_error failure(checkpoint_op op, const std::filesystem::path& path, int err,
                                         const std::string& about = {}) const {
    return checkpoint_error("meshlib::nn: save_checkpoint: cannot " + std::string(verb_of(op)) + " '" + path.string() +
                            "'" + about + ": " + std::generic_category().message(err) +
                            "; nothing was committed: '" + dir_.string() +
                            "' restores what it held before this save (free space or fix the file system, then save "
                            "again)");
  }

  /// `rename(from, to)`: atomic, replacing `to`.
  void rename(const std::filesystem::path& from, const std::filesystem::path& to) const {
    run(checkpoint_op::rename, from, [&] { return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno; },
        " to '" + to.string() + "'");
  }
  /// Syncs directory `d`, so the names created or renamed in it survive a power loss.
  void sync_dir(const std::filesystem::path& d) const {
    run(checkpoint_op::sync, d, [&] { return fsync_dir(d); });
  }
  /// `fsync` of directory `d`: 0 or an errno.
  static int fsync_dir(const std::filesystem::path& d) noexcept {
    const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    const int r = ::fsync(fd) == 0 ? 0 : errno;
    ::close(fd);
    return r;
  }
  /// Removes file `f`; true when it is gone (also when it was already).
  bool remove_quietly(const std::filesystem::path& f) const noexcept {
    return quietly(checkpoint_op::remove, f, [&] { return ::unlink(f.c_str()) == 0 || errno == ENOENT ? 0 : errno; }) == 0;
  }

 private:
  std::filesystem::path dir_;
};

/// A file of a save open for writing: contiguous writes are gathered into one `pwrite`, and
/// `finish` syncs and closes it, so its bytes are on disk before the index that names it is.
class out_file {
 public:
  /// Opens `path`; `create`: a new file of `size` bytes (zeros), else an existing one.
  out_file(const save_io& io, std::filesystem::path path, bool create, std::size_t size = 0)
      : io_(&io), path_(std::move(path)) {
    io.run(create ? checkpoint_op::create : checkpoint_op::open, path_, [&] {
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC | (create ? O_CREAT | O_TRUNC : 0), 0644);
      if (fd_ < 0) return errno;
      return create && ::ftruncate(fd_, static_cast<off_t>(size)) != 0 ? errno : 0;
    });
  }
  out_file(const out_file&) = delete;
  out_file& operator=(const out_file&) = delete;
  out_file(out_file&& o) noexcept
      : io_(o.io_), path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), at_(o.at_), buf_(std::move(o.buf_)) {}
  out_file& operator=(out_file&&) = delete;
  ~out_file() {
    if (fd_ >= 0) ::close(fd_);  // only after a failure: the file is not named by any index
  }

  /// Writes `n` bytes at byte `offset`.
  void write(std::size_t offset, const char* src, std::size_t n) {
    if (!buf_.empty() && (offset != at_ + buf_.size() || buf_.size() + n > (std::size_t{1} << 22))) flush();
    if (buf_.empty()) at_ = offset;
    buf_.insert(buf_.end(), src, src + n);
  }
  /// Writes what is gathered, syncs (unless `sync` is false: a file still to be filled) and closes.
  void finish(bool sync = true) {
    flush();
    if (sync) io_->run(checkpoint_op::sync, path_, [&] { return ::fsync(fd_) == 0 ? 0 : errno; });
    const int fd = std::exchange(fd_, -1);
    io_->run(checkpoint_op::close, path_, [&] { return ::close(fd) == 0 ? 0 : errno; });
  }

 private:
  void flush() {
    if (buf_.empty()) return;
    io_->run(checkpoint_op::write, path_, [&] {
      for (std::size_t done = 0; done < buf_.size();) {
        const ::ssize_t w = ::pwrite(fd_, buf_.data() + done, buf_.size() - done, static_cast<off_t>(at_ + done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return w < 0 ? errno : EIO;
        done += static_cast<std::size_t>(w);
      }
      return 0;
    });
    buf_.clear();
  }

  const save_io* io_;
  std::filesystem::path path_;
  int fd_ = -1;
  std::size_t at_ = 0;
  std::vector<char> buf_;
};

/// Writes a whole small file (the marker, the journal, the index), synced.
inline void write_whole(const save_io& io, const std::filesystem::path& path, std::string_view text) {
  out_file f(io, path, true);
  f.write(0, text.data(), text.size());
  f.finish();
}


/// The last line of a checksummed text file: `checksum <FNV-1a of body, 16 hex digits>`.
inline std::string checksum_line(std::string_view body) {
  char text[40];
  std::snprintf(text, sizeof text, "checksum %016llx\n",
                static_cast<unsigned long long>(meshlib::fnv1a_of(body)));
  return text;
}

/// The body of `text` when its last line is the checksum of everything before it, else nothing.
/// FNV-1a is a bijection of its state for each byte, so any one-byte substitution in the body
/// changes the sum, and one in the last line no longer matches it: every single edit is caught.
inline std::optional<std::string_view> verified_body(std::string_view text) {
  if (text.empty() || text.back() != '\n') return std::nullopt;
  const std::size_t nl = text.size() < 2 ? std::string_view::npos : text.rfind('\n', text.size() - 2);
  const std::size_t start = nl == std::string_view::npos ? 0 : nl + 1;
  const std::string_view body = text.substr(0, start);
  if (text.substr(start) != checksum_line(body)) return std::nullopt;
  return body;
}

/// The whole of a small file, or nothing when it cannot be read.
inline std::optional<std::string> read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return std::nullopt;
  return text;
}

inline constexpr std::string_view index_magic = "meshlib-checkpoint";
inline constexpr std::string_view journal_magic = "meshlib-checkpoint-pending 2\n";
inline constexpr const char* marker_name = "meshlib-checkpoint";

/// The data file of parameter `name` in generation `g`: `name.g<g>.bin`, or `.opt<slot>.bin`.
inline std::string data_file(const std::string& name, std::size_t g, std::size_t slot = std::size_t(-1)) {
  return name + ".g" + std::to_string(g) + (slot == std::size_t(-1) ? "" : ".opt" + std::to_string(slot)) + ".bin";
}

/// The file of parameter `name`'s per-parameter optimizer state in generation `g`.
inline std::string state_file(const std::string& name, std::size_t g) {
  return name + ".g" + std::to_string(g) + ".state.bin";
}

/// A parsed (and verified) index.
struct index_file {
  struct param {
    std::string name, dtype, shape, sharding;
    std::vector<std::uint64_t> sums;  ///< the value's, then each optimizer slot's
    std::size_t state_size = 0;       ///< floats of per-parameter optimizer state (0: none)
    std::uint64_t state_sum = 0;      ///< their file's checksum
  };
  std::size_t generation = 0, step = 0, slots = 0;
  std::uint64_t key = 0;
  std::string optimizer;
  std::vector<param> params;
  std::vector<param> buffers;  ///< no optimizer slots: `sums` holds the value's only

  /// Every data file it names.
  [[nodiscard]] std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& p : params) {
      out.push_back(data_file(p.name, generation));
      for (std::size_t s = 0; s < slots; ++s) out.push_back(data_file(p.name, generation, s));
      if (p.state_size != 0) out.push_back(state_file(p.name, generation));
    }
    for (const auto& b : buffers) out.push_back(data_file(b.name, generation));
    return out;
  }
};

/// Parses index `text` read from `path`; throws `checkpoint_error` (from `fn`) saying what is wrong.
inline index_file parse_index(const std::filesystem::path& path, std::string_view text, const char* fn) {
  auto bad = [&](const std::string& what) {
    return checkpoint_error(std::string("meshlib::nn: ") + fn + ": '" + path.string() + "': " + what);
  };
  const std::string_view first = text.substr(0, text.find('\n'));
  if (first.substr(0, index_magic.size() + 1) != std::string(index_magic) + " ")
    throw bad("not a meshlib checkpoint index (its first line is not 'meshlib-checkpoint <format>')");
  if (first != std::string(index_magic) + " 2")
    throw bad("format '" + std::string(first.substr(index_magic.size() + 1)) +
              "', but this meshlib reads format 2 (format 1, before every byte of the index was checksummed, is no "
              "longer read: restore it with the meshlib that wrote it and save it again)");
  const auto body = verified_body(text);
  if (!body)
    throw bad("the index does not match its checksum (its last line): it was edited, damaged or cut short, so "
              "none of its fields (step, key, shapes) can be trusted");
  std::istringstream in{std::string(*body)};
  index_file idx;
  std::string word, version, slots_word;
  std::size_t count = 0;
  // The checksum held, so these are the bytes save_checkpoint wrote; the checks are for its bugs.
  if (!(in >> word >> version) || !(in >> word >> idx.generation) || word != "generation" ||
      !(in >> word >> idx.step) || word != "step" || !(in >> word >> idx.key) || word != "key" ||
      !(in >> word >> idx.optimizer >> slots_word >> idx.slots) || word != "optimizer" || slots_word != "slots" ||
      !(in >> word >> count) || word != "parameters")
    throw bad("malformed header");
  for (std::size_t i = 0; i < count; ++i) {
    index_file::param p;
    if (!(in >> word >> p.name >> p.dtype >> p.shape) || word != "param")
      throw bad("malformed line for parameter " + std::to_string(i));
    p.sums.resize(1 + idx.slots);
    for (auto& s : p.sums)
      if (!(in >> s)) throw bad("missing checksum of parameter '" + p.name + "'");
    if (!(in >> word)) throw bad("malformed line for parameter '" + p.name + "'");
    if (word == "state" && !(in >> p.state_size >> p.state_sum >> word))
      throw bad("malformed optimizer state of parameter '" + p.name + "'");
    if (word != "sharding") throw bad("malformed line for parameter '" + p.name + "'");
    std::getline(in, p.sharding);
    idx.params.push_back(std::move(p));
  }
  // Buffers (running statistics): a section only a model that has some writes.
  if (in >> word) {
    if (word != "buffers" || !(in >> count)) throw bad("malformed line after the parameters");
    for (std::size_t i = 0; i < count; ++i) {
      index_file::param b;
      b.sums.resize(1);
      if (!(in >> word >> b.name >> b.dtype >> b.shape >> b.sums[0]) || word != "buffer")
        throw bad("malformed line for buffer " + std::to_string(i));
      if (!(in >> word) || word != "sharding") throw bad("malformed line for buffer '" + b.name + "'");
      std::getline(in, b.sharding);
      idx.buffers.push_back(std::move(b));
    }
  }
  return idx;
}

/// The index of `dir` when it is a verified one of this format.
inline std::optional<index_file> try_index(const std::filesystem::path& dir) {
  const auto text = read_text(dir / "index");
  if (!text) return std::nullopt;
  try {
    return parse_index(dir / "index", *text, "save_checkpoint");
  } catch (const checkpoint_error&) {
    return std::nullopt;
  }
}

/// The journal of a save: its generation, the files it creates (`fresh`) and the previous
/// generation's files it removes once committed (`stale`).
struct save_journal {
  std::size_t generation = 0;
  std::vector<std::string> fresh, stale;

  [[nodiscard]] std::string text() const {
    std::string t(journal_magic);
    t += "generation " + std::to_string(generation) + "\n";
    for (const auto& f : fresh) t += "new " + f + "\n";
    for (const auto& f : stale) t += "old " + f + "\n";
    return t + checksum_line(t);
  }
  static std::optional<save_journal> read(const std::filesystem::path& path) {
    const auto text = read_text(path);
    if (!text || text->compare(0, journal_magic.size(), journal_magic) != 0) return std::nullopt;
    const auto body = verified_body(*text);
    if (!body) return std::nullopt;  // cut short while written: it had created nothing yet
    std::istringstream in{std::string(body->substr(journal_magic.size()))};
    save_journal j;
    std::string word, name;
    if (!(in >> word >> j.generation) || word != "generation") return std::nullopt;
    while (in >> word >> name) (word == "new" ? j.fresh : j.stale).push_back(name);
    return j;
  }
};

/// The generation a damaged index names (its second line), so a save does not reuse its files.
inline std::size_t generation_named(const std::filesystem::path& index) {
  const auto text = read_text(index);
  if (!text) return 0;
  std::istringstream in(*text);
  std::string line, word;
  std::size_t g = 0;
  std::getline(in, line);
  return (in >> word >> g) && word == "generation" ? g : 0;
}

/// Whether `dir` is meshlib's to write into: new or empty, marked, or holding a meshlib index.
inline bool is_meshlib_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::is_empty(dir, ec) && !ec) return true;
  if (std::filesystem::is_regular_file(dir / marker_name, ec)) return true;
  const auto text = read_text(dir / "index");
  return text && text->compare(0, index_magic.size() + 1, std::string(index_magic) + " ") == 0;
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

/// The FNV-1a checksum of a whole file (process 0 reads back what every process wrote).
inline std::uint64_t checksum_of(const std::filesystem::path& path, std::size_t count) {
  std::vector<char> data(count * sizeof(float));
  std::ifstream in(path, std::ios::binary);
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  if (!in) throw checkpoint_error("meshlib::nn: save_checkpoint: cannot read back '" + path.string() + "'");
  return meshlib::fnv1a_of({data.data(), data.size()});
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
                                    const std::string& param, const char* kind = "parameter") {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param +
                           "') is missing");
  if (size != count * sizeof(float))
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param + "') has " +
                           std::to_string(size) + " bytes, expected " + std::to_string(count * sizeof(float)) +
                           " (" + std::to_string(count) + " float32): truncated or not this checkpoint's file");
  std::vector<float> data(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(data.data()), static_cast<std::streamsize>(size));
  if (!in) throw checkpoint_error("meshlib::nn: restore_checkpoint: cannot read '" + path.string() + "'");
  if (meshlib::fnv1a_of({reinterpret_cast<const char*>(data.data()), size}) != sum)
    throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + path.string() + "' (" + std::string(kind) + " '" + param +
                           "') does not match its checksum in the index: the file is corrupted");
  return data;
}

/// The buffers of `state`'s model (running statistics; none for most models), in layer order.
template <class State>
auto model_buffers(State& state) {
  std::remove_cvref_t<decltype(state.params)> out;
  collect_buffers_of(state.model, out);
  return out;
}

/// The layer a parameter or buffer belongs to: its name up to the last dot (`"b1.bn2"` for
/// `"b1.bn2.running_mean"`).
inline std::string layer_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

/// Throws unless the model's buffers (names, count, shapes) are the ones checkpoint `idx` holds;
/// `bad` makes the error (it prefixes the index's path).
template <class Ref, class Bad>
void check_buffers(const index_file& idx, const std::vector<Ref>& buffers, Bad&& bad) {
  const auto of = [](const std::string& n) { return "'" + n + "' (running statistics of layer '" + layer_of(n) + "')"; };
  const std::string other = ": a checkpoint of another model; restore into the model it was saved from";
  for (std::size_t i = 0; i < std::max(idx.buffers.size(), buffers.size()); ++i) {
    if (i >= buffers.size())
      throw bad("holds the buffer " + of(idx.buffers[i].name) + ", which the model does not have" + other);
    if (i >= idx.buffers.size())
      throw bad("holds " + std::to_string(idx.buffers.size()) + " buffers and not the model's buffer " +
                of(buffers[i].name) + other);
    const auto& saved = idx.buffers[i];
    const auto& b = buffers[i];
    if (saved.name != b.name)
      throw bad("buffer " + std::to_string(i) + " is " + of(saved.name) + ", the model's is " + of(b.name) + other);
    if (saved.dtype != "float32") throw bad("buffer '" + saved.name + "' has dtype " + saved.dtype + ", expected float32");
    if (saved.shape != shape_text(b.shape))
      throw bad("buffer " + of(saved.name) + " has shape " + saved.shape + " in the checkpoint, the model's is " +
                shape_text(b.shape) + ": declare layer '" + layer_of(b.name) + "' with the size it was saved with");
  }
}

/// Throws unless `name` can be a file name in the checkpoint (and a word of the index).
inline void check_param_name(const std::string& name) {
  const bool ok = !name.empty() && name != "." && name != ".." &&
                  name.find_first_of("/\\ \t\r\n") == std::string::npos;
  if (!ok)
    throw checkpoint_error("meshlib::nn: save_checkpoint: parameter name '" + name +
                           "' cannot name a checkpoint file: give the layer a name without spaces or slashes");
}

}  // namespace detail

/// @brief Writes `state` (parameters, optimizer state, step, key) to directory `dir` (see the file
/// comment: atomic, and never deleting a file meshlib did not write). A state that holds only this
/// process's devices needs every process to call this with the same `dir`; `ex` connects them
/// (ignored for a state that holds every device).
/// @throws checkpoint_error when `dir` is a non-empty directory that is not a meshlib checkpoint
/// (nothing is written), or when a file cannot be written, synced or renamed, on this or (for a
/// multi-process state) any other process; `dir` then restores what it held before the save.
template <class State>
void save_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  namespace fs = std::filesystem;
  auto& ex = detail::exchange_for(state, &ex_, "save_checkpoint");
  const bool first = ex.rank() == 0;
  const detail::save_io io(dir);
  const std::size_t slots = state.opt.slots();
  const auto buffers = detail::model_buffers(state);
  std::size_t generation = 0;
  detail::save_journal journal;
  const auto value_file = [&](const param_ref<float>& p) { return dir / detail::data_file(p.name, generation); };
  const auto opt_file = [&](const param_ref<float>& p, std::size_t s) {
    return dir / detail::data_file(p.name, generation, s);
  };
  const auto state_file = [&](const param_ref<float>& p) { return dir / detail::state_file(p.name, generation); };
  // 1. Process 0: claim the directory (refusing one that is not meshlib's), clear what a save that
  // did not finish left, journal this save, create its files at their final sizes.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    for (const auto& p : state.params) detail::check_param_name(p.name);
    for (const auto& b : buffers) {
      detail::check_param_name(b.name);
      for (const auto& p : state.params)
        if (p.name == b.name)
          throw checkpoint_error("meshlib::nn: save_checkpoint: the buffer '" + b.name + "' of layer '" +
                                 detail::layer_of(b.name) + "' has the name of a parameter, so both would be one file; "
                                 "give the layers distinct names");
    }
    std::error_code ec;
    const auto status = fs::status(dir, ec);
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw checkpoint_error("meshlib::nn: save_checkpoint: cannot inspect '" + dir.string() + "': " + ec.message());
    if (!fs::exists(status)) {
      io.run(detail::checkpoint_op::make_dir, dir, [&] {
        std::error_code e;
        fs::create_directories(dir, e);
        return e.value();
      });
    } else if (!fs::is_directory(status)) {
      throw checkpoint_error("meshlib::nn: save_checkpoint: '" + dir.string() +
                             "' exists and is not a directory; pass the path of a new or empty directory, or of a "
                             "checkpoint");
    } else if (!detail::is_meshlib_dir(dir)) {
      throw checkpoint_error("meshlib::nn: save_checkpoint: '" + dir.string() +
                             "' is a non-empty directory that is not a meshlib checkpoint (it has neither a '" +
                             detail::marker_name + "' nor a meshlib 'index' file); nothing was written or deleted: "
                             "pass a new or empty directory, e.g. '" + (dir / "checkpoint").string() + "'");
    }
    if (!fs::exists(dir / detail::marker_name, ec))
      detail::write_whole(io, dir / detail::marker_name,
                          "This directory holds a meshlib checkpoint (see 'index'). meshlib removes only the files it "
                          "wrote here.\n");
    const auto previous = detail::try_index(dir);
    const bool has_index = fs::exists(dir / "index", ec);
    std::vector<std::string> current;
    if (previous) current = previous->files();
    const auto is_current = [&](const std::string& f) { return std::find(current.begin(), current.end(), f) != current.end(); };
    const auto unfinished = detail::save_journal::read(dir / "pending");
    std::vector<std::string> left;  // files of the unfinished save that could not be removed now
    if (unfinished && (previous || !has_index)) {
      // Committed (the index names its generation): its clean-up did not finish; else its files
      // were never named by an index. A damaged index leaves both alone: they may be its files.
      const bool committed = previous && unfinished->generation == previous->generation;
      for (const auto& f : committed ? unfinished->stale : unfinished->fresh)
        if (!is_current(f) && !io.remove_quietly(dir / f)) left.push_back(f);
    }
    generation = std::max({previous ? previous->generation : std::size_t{0},
                           unfinished ? unfinished->generation : std::size_t{0},
                           has_index && !previous ? detail::generation_named(dir / "index") : std::size_t{0}}) + 1;
    journal.generation = generation;
    for (const auto& p : state.params) {
      journal.fresh.push_back(detail::data_file(p.name, generation));
      for (std::size_t s = 0; s < slots; ++s) journal.fresh.push_back(detail::data_file(p.name, generation, s));
      if (state.param_state_size(static_cast<std::size_t>(&p - state.params.data())) != 0)
        journal.fresh.push_back(detail::state_file(p.name, generation));
    }
    for (const auto& b : buffers) journal.fresh.push_back(detail::data_file(b.name, generation));
    journal.stale = current;  // and what could not be removed yet: this journal keeps track of it
    journal.stale.insert(journal.stale.end(), left.begin(), left.end());
    detail::write_whole(io, dir / "pending", journal.text());
    io.sync_dir(dir);  // the journal is on disk before any file it lists exists
    for (const auto& p : state.params) {
      const std::size_t bytes = detail::product(p.shape) * sizeof(float);
      detail::out_file(io, value_file(p), true, bytes).finish(false);
      for (std::size_t s = 0; s < slots; ++s) detail::out_file(io, opt_file(p, s), true, bytes).finish(false);
      if (const std::size_t n = state.param_state_size(static_cast<std::size_t>(&p - state.params.data())))
        detail::out_file(io, state_file(p), true, n * sizeof(float)).finish(false);
    }
    for (const auto& b : buffers)
      detail::out_file(io, value_file(b), true, detail::product(b.shape) * sizeof(float)).finish(false);
  });
  if (ex.size() > 1) generation = std::stoull(ex.all_gather(first ? std::to_string(generation) : "")[0]);
  // 2. Every process: the blocks its devices own, at their places, synced. A block replicated over
  // a group of devices is written by the group's first device only, so every element is written once.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    const auto put = [](detail::out_file& f, std::size_t at, const float* src, std::size_t n) {
      f.write(at * sizeof(float), reinterpret_cast<const char*>(src), n * sizeof(float));
    };
    std::vector<float> stage;  // a block copied to the host (device memory only)
    using space = default_memory_space;
    for (std::size_t i = 0; i < state.params.size(); ++i) {
      const auto& p = state.params[i];
      detail::out_file out(io, value_file(p), false);
      for (std::size_t dev : state.local_devices())
        if (state.mesh.group_rank(dev, state.mesh.all_axes & ~p.sharded_axes) == 0) {
          const float* v = meshlib::host_readable<space>(state.master(i, dev), p.count[dev], stage);
          detail::for_each_global_run(p, dev, 0, p.count[dev],
                                      [&](std::size_t k, std::size_t g, std::size_t n) { put(out, g, v + k, n); });
        }
      out.finish();
    }
    for (const auto& b : buffers) {  // as the parameters' values
      detail::out_file out(io, value_file(b), false);
      for (std::size_t dev : state.local_devices())
        if (state.mesh.group_rank(dev, state.mesh.all_axes & ~b.sharded_axes) == 0) {
          const float* v = meshlib::host_readable<space>(b.value[dev], b.count[dev], stage);
          detail::for_each_global_run(b, dev, 0, b.count[dev],
                                      [&](std::size_t k, std::size_t g, std::size_t n) { put(out, g, v + k, n); });
        }
      out.finish();
    }
    std::vector<detail::out_file> opt;
    opt.reserve(state.params.size() * slots);
    for (const auto& p : state.params)
      for (std::size_t s = 0; s < slots; ++s) opt.emplace_back(io, opt_file(p, s), false);
    for (std::size_t dev : state.local_devices())
      state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const> slot) {
        const auto& p = state.params[i];
        if (!state.owns_state(dev, p)) return;
        for (std::size_t s = 0; s < slots; ++s) {
          const float* v = meshlib::host_readable<space>(slot[s], len, stage);
          detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
            put(opt[i * slots + s], g, v + (k - off), n);
          });
        }
      });
    for (auto& o : opt) o.finish();
    // Per-parameter state is alike on every device holding a block of the parameter: the device
    // of its first block writes it (every process that has one writes the same bytes).
    for (std::size_t i = 0; i < state.params.size(); ++i) {
      const auto& p = state.params[i];
      const std::size_t n = state.param_state_size(i);
      if (n == 0) continue;
      for (std::size_t dev : state.local_devices()) {
        const auto offset = p.layout->offset(dev);
        if (state.param_state(i, dev) == nullptr ||
            std::any_of(offset.begin(), offset.end(), [](std::size_t o) { return o != 0; }))
          continue;
        detail::out_file out(io, state_file(p), false);
        put(out, 0, meshlib::host_readable<space>(state.param_state(i, dev), n, stage), n);
        out.finish();
        break;
      }
    }
  });
  // 3. Process 0: the index (with the checksums of what every process wrote) as `index.tmp`, then
  // the commit, one atomic rename over `index`; then the previous generation's files go.
  detail::agreed_phase(ex, "save_checkpoint", [&] {
    if (!first) return;
    std::ostringstream index;
    index << detail::index_magic << " 2\ngeneration " << generation << "\nstep " << state.step << "\nkey "
          << state.key.value << "\noptimizer " << state.opt.kind() << " slots " << slots << "\nparameters "
          << state.params.size() << "\n";
    for (const auto& p : state.params) {
      const std::size_t count = detail::product(p.shape);
      index << "param " << p.name << " float32 " << detail::shape_text(p.shape) << " "
            << detail::checksum_of(value_file(p), count);
      for (std::size_t s = 0; s < slots; ++s) index << " " << detail::checksum_of(opt_file(p, s), count);
      if (const std::size_t n = state.param_state_size(static_cast<std::size_t>(&p - state.params.data())))
        index << " state " << n << " " << detail::checksum_of(state_file(p), n);
      index << " sharding " << p.sharding << "\n";
    }
    if (!buffers.empty()) index << "buffers " << buffers.size() << "\n";
    for (const auto& b : buffers)
      index << "buffer " << b.name << " float32 " << detail::shape_text(b.shape) << " "
            << detail::checksum_of(value_file(b), detail::product(b.shape)) << " sharding " << b.sharding << "\n";
    std::string text = index.str();
    text += detail::checksum_line(text);
    detail::write_whole(io, dir / "index.tmp", text);
    io.rename(dir / "index.tmp", dir / "index");  // the commit
    if (const int err = io.quietly(detail::checkpoint_op::sync, dir, [&] { return detail::save_io::fsync_dir(dir); }))
      throw checkpoint_error("meshlib::nn: save_checkpoint: cannot sync (fsync) the directory '" + dir.string() +
                             "' after committing: " + std::generic_category().message(err) +
                             "; the new checkpoint is in place and restores, but may not survive a power loss: check "
                             "the file system");
    // The journal goes last, and only when every stale file went: else the next save finishes this.
    bool all_removed = true;
    for (const auto& f : journal.stale)
      if (std::find(journal.fresh.begin(), journal.fresh.end(), f) == journal.fresh.end())
        all_removed = io.remove_quietly(dir / f) && all_removed;
    if (all_removed) io.remove_quietly(dir / "pending");
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
/// @throws checkpoint_error (the state is unchanged, on every process) for a missing, truncated,
/// edited or corrupted file (every byte of the index and of the data files is checksummed), or a
/// checkpoint of another model (parameter or buffer names or shapes) or optimizer. A checkpoint
/// without buffers (see the file comment) leaves the model's running statistics as they are.
template <class State>
void restore_checkpoint(const std::filesystem::path& dir, State& state, distributed::process_exchange& ex_) {
  auto& ex = detail::exchange_for(state, &ex_, "restore_checkpoint");
  const std::size_t count = state.params.size(), slots = state.opt.slots();
  std::vector<std::vector<float>> values(count), opt(count * slots), param_state(count);
  const auto buffers = detail::model_buffers(state);
  std::vector<std::vector<float>> buffer_values;  // empty: the checkpoint has none (left as they are)
  std::size_t step = 0;
  std::uint64_t key = 0;
  detail::agreed_phase(ex, "restore_checkpoint", [&] {
    const auto index_path = dir / "index";
    const auto text = detail::read_text(index_path);
    if (!text) {
      std::error_code ec;
      if (std::filesystem::exists(dir / detail::marker_name, ec))
        throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + dir.string() +
                               "' holds no complete checkpoint: '" + index_path.string() +
                               "' is missing (the first save into it did not finish)");
      throw checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "' is missing: not a checkpoint");
    }
    const auto idx = detail::parse_index(index_path, *text, "restore_checkpoint");
    auto bad = [&](const std::string& what) {
      return checkpoint_error("meshlib::nn: restore_checkpoint: '" + index_path.string() + "': " + what);
    };
    if (idx.optimizer != state.opt.kind() || idx.slots != slots)
      throw bad("saved with optimizer " + idx.optimizer + " (" + std::to_string(idx.slots) +
                " state slots), but the train state's optimizer is " + state.opt.name() +
                ": restore into a train state made with the optimizer it was saved with");
    if (idx.params.size() != count)
      throw bad("holds " + std::to_string(idx.params.size()) + " parameters, the model has " + std::to_string(count) +
                ": a checkpoint of another model");
    for (std::size_t i = 0; i < count; ++i) {
      const auto& p = state.params[i];
      const auto& saved = idx.params[i];
      if (saved.name != p.name)
        throw bad("parameter " + std::to_string(i) + " is '" + saved.name + "', the model's is '" + p.name +
                  "': a checkpoint of another model");
      if (saved.dtype != "float32")
        throw bad("parameter '" + saved.name + "' has dtype " + saved.dtype + ", expected float32");
      if (saved.shape != detail::shape_text(p.shape))
        throw bad("parameter '" + saved.name + "' has shape " + saved.shape + " in the checkpoint, the model's is " +
                  detail::shape_text(p.shape) + ": a checkpoint of another model");
      const std::size_t n = detail::product(p.shape);
      values[i] = detail::read_file(dir / detail::data_file(p.name, idx.generation), n, saved.sums[0], p.name);
      for (std::size_t s = 0; s < slots; ++s)
        opt[i * slots + s] =
            detail::read_file(dir / detail::data_file(p.name, idx.generation, s), n, saved.sums[1 + s], p.name);
      const std::size_t kept = state.param_state_size(i);
      if (saved.state_size != kept)
        throw bad("parameter '" + saved.name + "' has " + std::to_string(saved.state_size) +
                  " floats of per-parameter optimizer state in the checkpoint, the train state's optimizer " +
                  state.opt.name() + " keeps " + std::to_string(kept) +
                  " (factored or not, min_dim_size_to_factor): restore with the optimizer options it was saved with");
      if (kept != 0)
        param_state[i] =
            detail::read_file(dir / detail::state_file(p.name, idx.generation), kept, saved.state_sum, p.name);
    }
    if (!idx.buffers.empty()) {
      detail::check_buffers(idx, buffers, bad);
      for (std::size_t i = 0; i < buffers.size(); ++i)
        buffer_values.push_back(detail::read_file(dir / detail::data_file(buffers[i].name, idx.generation),
                                                  detail::product(buffers[i].shape), idx.buffers[i].sums[0],
                                                  buffers[i].name, "buffer"));
    }
    step = idx.step;
    key = idx.key;
  });
  // Everything checked, on every process: scatter into this mesh's blocks (the reshard).
  // Blocks in device memory are edited in a host copy (`edit_on_host`), in host memory in place.
  using space = default_memory_space;
  std::vector<float> stage;
  for (std::size_t i = 0; i < count; ++i) {
    const auto& p = state.params[i];
    for (std::size_t dev : state.local_devices())
      meshlib::edit_on_host<space>(state.master(i, dev), p.count[dev], stage, [&](float* v) {
        detail::for_each_global_run(p, dev, 0, p.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
          std::copy_n(values[i].data() + g, n, v + k);
        });
      });
  }
  for (std::size_t i = 0; i < buffer_values.size(); ++i) {
    const auto& b = buffers[i];
    for (std::size_t dev : state.local_devices())
      meshlib::edit_on_host<space>(b.value[dev], b.count[dev], stage, [&](float* v) {
        detail::for_each_global_run(b, dev, 0, b.count[dev], [&](std::size_t k, std::size_t g, std::size_t n) {
          std::copy_n(buffer_values[i].data() + g, n, v + k);
        });
      });
  }
  state.refresh_compute_copies();  // a mixed-precision state rounds its restored float masters
  for (std::size_t dev : state.local_devices())
    state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const> slot) {
      const auto& p = state.params[i];
      for (std::size_t s = 0; s < slots; ++s)
        meshlib::edit_on_host<space>(slot[s], len, stage, [&](float* v) {
          detail::for_each_global_run(p, dev, off, len, [&](std::size_t k, std::size_t g, std::size_t n) {
            std::copy_n(opt[i * slots + s].data() + g, n, v + (k - off));
          });
        });
    });
  for (std::size_t i = 0; i < count; ++i)
    if (!param_state[i].empty())
      for (std::size_t dev : state.local_devices())
        if (float* v = state.param_state(i, dev))
          meshlib::edit_on_host<space>(v, param_state[i].size(), stage,
                                       [&](float* h) { std::copy(param_state[i].begin(), param_state[i].end(), h); });
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
