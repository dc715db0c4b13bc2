// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Checkpoints: saved on one mesh, restored on another (and across ZeRO-1), training continues with
// the losses of an uninterrupted run; bad checkpoints are refused with the file and parameter named;
// every byte of the index is verified (each one-byte edit is refused); a directory that is not a
// checkpoint is never written into; a save that fails or is killed at any of its file operations
// leaves the previous checkpoint or the new one, and the next save clears what it left.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
namespace fs = std::filesystem;

constexpr std::size_t features = 8, hidden = 16, classes = 4, batch = 16, steps = 6;

auto make_net(const mesh_t& m, std::size_t width = hidden) {
  const nn::rng_key key{21};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, width, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", width, classes, key));
}

struct data {
  std::vector<float> x = std::vector<float>(batch * steps * features);
  std::vector<std::int32_t> y = std::vector<std::int32_t>(batch * steps);
  data() {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::cos(0.61 * static_cast<double>(i)));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 7 + i / 3) % classes);
  }
};

template <class State>
double step(State& s, const data& d, std::size_t i) {
  return nn::train_step(s, std::span<const float>(d.x).subspan(i * batch * features, batch * features),
                        std::span<const std::int32_t>(d.y).subspan(i * batch, batch), batch, 0, batch)
      .loss;
}

fs::path scratch(const std::string& name) {
  auto p = fs::temp_directory_path() / ("meshlib_nn_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

/// A directory where fsync costs nothing when the system has one (the loops below write and sync thousands of files).
fs::path fast_scratch(const std::string& name) {
  const fs::path shm = "/dev/shm";
  std::error_code ec;
  const auto base = fs::is_directory(shm, ec) ? shm : fs::temp_directory_path();
  auto p = base / ("meshlib_nn_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

/// Everything restore writes into a state: step, key, every master block and optimizer state.
template <class State>
std::vector<double> snapshot(State& s) {
  std::vector<double> out{static_cast<double>(s.step), static_cast<double>(s.key.value)};
  for (std::size_t dev : s.local_devices()) {
    for (std::size_t i = 0; i < s.params.size(); ++i)
      for (std::size_t k = 0; k < s.params[i].count[dev]; ++k) out.push_back(s.master(i, dev)[k]);
    for (float v : s.optimizer_state(dev)) out.push_back(v);
  }
  return out;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

/// The names in `dir` (one level), sorted.
std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

}  // namespace

TEST_CASE("a checkpoint saved on (4, 2) and restored on (2, 4) continues with the same losses", "[nn][checkpoint]") {
  const data d;
  const auto opt = nn::adam(nn::constant(1e-2f));
  for (auto [save_zero, load_zero] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
    INFO("zero on save " << save_zero << ", on restore " << load_zero);
    const mesh_t a{4, 2}, b{2, 4};
    nn::train_state whole(a, make_net(a), opt, {});
    std::vector<double> ref;
    for (std::size_t i = 0; i < steps; ++i) ref.push_back(step(whole, d, i));

    const auto dir = scratch("reshard");
    nn::train_state first(a, make_net(a), opt, nn::data_parallel<"data">{.zero = save_zero ? 1 : 0});
    for (std::size_t i = 0; i < 3; ++i) CHECK(std::abs(step(first, d, i) - ref[i]) <= 1e-5 * ref[i]);
    nn::save_checkpoint(dir, first);
    CHECK(fs::exists(dir / "index"));
    CHECK(!fs::exists(fs::path(dir.string() + ".tmp")));

    nn::train_state second(b, make_net(b), opt, nn::data_parallel<"data">{.zero = load_zero ? 1 : 0});
    nn::restore_checkpoint(dir, second);
    CHECK(second.step == 3);
    for (std::size_t i = 3; i < steps; ++i) {
      INFO("step " << i);
      CHECK(std::abs(step(second, d, i) - ref[i]) <= 1e-5 * ref[i]);
    }
    fs::remove_all(dir);
  }
}

TEST_CASE("bad checkpoints are refused naming the file and the parameter", "[nn][checkpoint][errors]") {
  const data d;
  const mesh_t m{2, 2};
  const auto dir = scratch("bad");
  nn::train_state s(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
  step(s, d, 0);
  nn::save_checkpoint(dir, s);
  const std::string idx = (dir / "index").string();

  SECTION("another model") {
    nn::train_state other(m, make_net(m, 8), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + idx +
              "': parameter 'fc1.w' has shape 8x16 in the checkpoint, the model's is 8x8: a checkpoint of another model");
  }
  SECTION("another optimizer, named as its factory is") {
    nn::train_state other(m, make_net(m), nn::sgd(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + idx +
              "': saved with optimizer adam (2 state slots), but the train state's optimizer is sgd(momentum "
              "0.9): restore into a train state made with the optimizer it was saved with");
    nn::train_state adamw(m, make_net(m), nn::adamw(1e-2f), {});  // same slots, another rule
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, adamw); })
              .find("saved with optimizer adam (2 state slots), but the train state's optimizer is adamw(") !=
          std::string::npos);
  }
  SECTION("a truncated file") {
    fs::resize_file(dir / "fc2.w.g1.bin", 10);
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    const double before = other.params[2].value[0][0];
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "fc2.w.g1.bin").string() +
              "' (parameter 'fc2.w') has 10 bytes, expected 256 (64 float32): truncated or not this checkpoint's file");
    CHECK(other.params[2].value[0][0] == before);  // nothing half-restored
  }
  SECTION("a corrupted file") {
    {
      std::fstream f(dir / "fc1.b.g1.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(5);
      f.put('\x7f');
    }
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "fc1.b.g1.bin").string() +
              "' (parameter 'fc1.b') does not match its checksum in the index: the file is corrupted");
  }
  SECTION("no checkpoint at all") {
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir / "nope", other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "nope" / "index").string() + "' is missing: not a checkpoint");
  }
  fs::remove_all(dir);
}

TEST_CASE("a number is a constant learning-rate schedule: nn::adam(1e-2f) trains as adam(constant(1e-2f))",
          "[nn][optimizer]") {
  const nn::schedule from_number = 1e-2f;
  for (std::size_t step : {std::size_t{0}, std::size_t{1}, std::size_t{99}, std::size_t{1} << 40})
    CHECK(from_number(step) == 1e-2f);
  CHECK(nn::scale_by_learning_rate(1e-3).rate(7) == 1e-3f);  // a double converts as well
  CHECK(nn::adam(1e-3).name() == "adam");
  const data d;
  const mesh_t m{2, 2};
  nn::train_state a(m, make_net(m), nn::adam(1e-2f), {});
  nn::train_state b(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
  nn::train_state c(m, make_net(m), nn::sgd(0.1f, 0.5f), {});
  nn::train_state e(m, make_net(m), nn::sgd(nn::constant(0.1f), 0.5f), {});
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(step(a, d, i) == step(b, d, i));
    CHECK(step(c, d, i) == step(e, d, i));
  }
  CHECK(snapshot(a) == snapshot(b));
  CHECK(snapshot(c) == snapshot(e));
}

TEST_CASE("every one-byte edit or cut of the index is refused, never restored as another state",
          "[nn][checkpoint][errors][law]") {
  const data d;
  const mesh_t m{2, 2};
  const auto dir = fast_scratch("index_law");
  nn::train_state s(m, make_net(m), nn::adam(1e-2f), {});
  step(s, d, 0);
  step(s, d, 1);
  s.key = nn::rng_key{0x0123456789abcdefull};
  nn::save_checkpoint(dir, s);
  const auto saved = snapshot(s);
  const std::string index = read_all(dir / "index");
  REQUIRE(index.size() > 300);
  nn::train_state other(m, make_net(m), nn::adam(1e-2f), {});
  nn::restore_checkpoint(dir, other);
  REQUIRE(snapshot(other) == saved);  // the unedited index restores exactly

  // The law: each edit throws checkpoint_error or restores exactly the saved state.
  std::size_t refused = 0, edits = 0;
  nn::train_state fresh(m, make_net(m), nn::adam(1e-2f), {});
  auto before = snapshot(fresh);
  REQUIRE(before != saved);
  const auto law = [&](const std::string& edited) {
    write_all(dir / "index", edited);
    ++edits;
    try {
      nn::restore_checkpoint(dir, fresh);
      before = snapshot(fresh);
      CHECK(before == saved);
    } catch (const nn::checkpoint_error&) {
      ++refused;
      CHECK(snapshot(fresh) == before);  // refused: nothing half-restored
    }
  };
  for (std::size_t at = 0; at < index.size(); ++at)
    for (unsigned char flip : {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80}) {
      std::string edited = index;
      edited[at] = static_cast<char>(static_cast<unsigned char>(edited[at]) ^ flip);
      INFO("byte " << at << " ('" << index[at] << "') xor " << int{flip});
      law(edited);
    }
  for (std::size_t len = 0; len < index.size(); ++len) law(index.substr(0, len));
  law(index + "\n");
  CHECK(edits == index.size() * 9 + 1);
  CHECK(refused == edits);  // with the checksum, in fact every edit is refused
  write_all(dir / "index", index);
  // The message of the step edit the issue found (step 2 -> step 3).
  std::string three = index;
  three.replace(three.find("step 2"), 6, "step 3");
  write_all(dir / "index", three);
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
        "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() +
            "': the index does not match its checksum (its last line): it was edited, damaged or cut short, so none "
            "of its fields (step, key, shapes) can be trusted");
  fs::remove_all(dir);
}

TEST_CASE("save_checkpoint never writes into or deletes from a directory that is not a meshlib checkpoint",
          "[nn][checkpoint][errors]") {
  const data d;
  const mesh_t m{2, 2};
  const auto dir = scratch("foreign");
  nn::train_state s(m, make_net(m), nn::adam(1e-2f), {});
  step(s, d, 0);
  fs::create_directories(dir / "logs");
  write_all(dir / "precious.txt", "my notes");
  write_all(dir / "logs" / "run.log", "step 1");
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::save_checkpoint(dir, s); }) ==
        "meshlib::nn: save_checkpoint: '" + dir.string() +
            "' is a non-empty directory that is not a meshlib checkpoint (it has neither a 'meshlib-checkpoint' nor "
            "a meshlib 'index' file); nothing was written or deleted: pass a new or empty directory, e.g. '" +
            (dir / "checkpoint").string() + "'");
  CHECK(listing(dir) == std::set<std::string>{"logs", "precious.txt"});
  CHECK(read_all(dir / "precious.txt") == "my notes");
  CHECK(read_all(dir / "logs" / "run.log") == "step 1");

  // A file where the directory should be.
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::save_checkpoint(dir / "precious.txt", s); }) ==
        "meshlib::nn: save_checkpoint: '" + (dir / "precious.txt").string() +
            "' exists and is not a directory; pass the path of a new or empty directory, or of a checkpoint");
  CHECK(read_all(dir / "precious.txt") == "my notes");

  // Beside them, in a subdirectory: saved; a file the user adds there survives later saves, and
  // each save leaves only its own generation's files.
  const auto ckpt = dir / "checkpoint";
  nn::save_checkpoint(ckpt, s);
  write_all(ckpt / "notes.txt", "kept");
  step(s, d, 1);
  nn::save_checkpoint(ckpt, s);
  step(s, d, 2);
  nn::save_checkpoint(ckpt, s);
  std::set<std::string> expected{"meshlib-checkpoint", "index", "notes.txt"};
  for (const std::string p : {"fc1.w", "fc1.b", "fc2.w", "fc2.b"})
    for (const std::string suffix : {".g3.bin", ".g3.opt0.bin", ".g3.opt1.bin"}) expected.insert(p + suffix);
  CHECK(listing(ckpt) == expected);
  CHECK(read_all(ckpt / "notes.txt") == "kept");
  nn::train_state other(m, make_net(m), nn::adam(1e-2f), {});
  nn::restore_checkpoint(ckpt, other);
  CHECK(snapshot(other) == snapshot(s));
  // An empty directory is fine too.
  fs::create_directories(dir / "empty");
  nn::save_checkpoint(dir / "empty", s);
  CHECK(fs::exists(dir / "empty" / "index"));
  fs::remove_all(dir);
}

namespace {

/// The fault-injection seam's test side: counts the save's file operations, logs them, and at
/// operation `at` fails it with `error` or kills the process (SIGKILL, as a crash would).
struct faults {
  static inline long at = -1;
  static inline long seen = 0;
  static inline int error = EIO;
  static inline bool kill = false;
  static inline std::vector<std::pair<nn::detail::checkpoint_op, std::string>> log;
  static int hook(nn::detail::checkpoint_op op, const fs::path& path) {
    log.emplace_back(op, path.filename().string());
    if (seen++ != at) return 0;
    if (kill) ::raise(SIGKILL);
    return error;
  }
  /// Installs the hook for a scope, failing operation `k` (-1: none).
  struct scope {
    explicit scope(long k, int err = EIO, bool die = false) {
      at = k, seen = 0, error = err, kill = die;
      log.clear();
      nn::detail::checkpoint_fault = &hook;
    }
    ~scope() { nn::detail::checkpoint_fault = nullptr; }
  };
};

/// The names in `dir` with each data file's generation replaced by `*`, and the set of
/// generations seen: one generation's files, whatever its number, and nothing else.
std::pair<std::set<std::string>, std::set<std::string>> generations(const fs::path& dir) {
  std::set<std::string> names, gens;
  for (auto name : listing(dir)) {
    const auto g = name.find(".g");
    if (g != std::string::npos && name.size() > g + 2 && std::isdigit(static_cast<unsigned char>(name[g + 2]))) {
      const auto end = name.find('.', g + 2);
      gens.insert(name.substr(g + 2, end - g - 2));
      name.replace(g + 2, end - g - 2, "*");
    }
    names.insert(name);
  }
  return {names, gens.size() == 1 ? std::set<std::string>{"one"} : gens};
}

}  // namespace

TEST_CASE("a save makes its file operations in a crash-safe order", "[nn][checkpoint][faults]") {
  using op = nn::detail::checkpoint_op;
  const data d;
  const mesh_t m{1, 1};
  const auto dir = fast_scratch("order");
  nn::train_state a(m, make_net(m), nn::adam(1e-2f), {});
  step(a, d, 0);
  nn::save_checkpoint(dir, a);
  step(a, d, 1);
  faults::scope record(-1);
  nn::save_checkpoint(dir, a);
  const auto& log = faults::log;
  const auto first = [&](op o, const std::string& f) {
    return std::find(log.begin(), log.end(), std::pair{o, f}) - log.begin();
  };
  const auto renames = std::count_if(log.begin(), log.end(), [](const auto& e) { return e.first == op::rename; });
  CHECK(renames == 1);  // one commit
  const auto commit = first(op::rename, "index.tmp");
  REQUIRE(commit < static_cast<long>(log.size()));
  CHECK(first(op::sync, "pending") < first(op::create, "fc1.w.g2.bin"));  // journal before its files
  for (const std::string p : {"fc1.w", "fc1.b", "fc2.w", "fc2.b"})
    for (const std::string& f : {p + ".g2.bin", p + ".g2.opt0.bin", p + ".g2.opt1.bin"}) {
      INFO(f);
      CHECK(first(op::sync, f) < commit);                       // data on disk before the index names it
      CHECK(first(op::remove, p + ".g1.bin") > commit);         // the previous generation only after
      CHECK(first(op::remove, f) == static_cast<long>(log.size()));  // the new files are never removed
    }
  CHECK(first(op::sync, "index.tmp") < commit);
  CHECK(first(op::remove, "pending") > commit);
  fs::remove_all(dir);
}

TEST_CASE("a save that fails or is killed at any file operation leaves the previous or the new checkpoint",
          "[nn][checkpoint][faults]") {
  const data d;
  const mesh_t m{1, 1};
  nn::train_state a(m, make_net(m), nn::adam(1e-2f), {}), b(m, make_net(m), nn::adam(1e-2f), {});
  step(a, d, 0);
  step(b, d, 0);
  step(b, d, 1);
  const auto old_state = snapshot(a), new_state = snapshot(b);
  REQUIRE(old_state != new_state);
  const auto base = fast_scratch("faults");
  const auto pristine = base / "pristine", dir = base / "ckpt";
  nn::save_checkpoint(pristine, a);
  std::pair<std::set<std::string>, std::set<std::string>> after_clean_save;  // what a clean save leaves

  for (const bool from_nothing : {false, true}) {
    INFO((from_nothing ? "first save into a new directory" : "a save over a checkpoint"));
    const auto reset = [&] {
      fs::remove_all(dir);
      if (!from_nothing) fs::copy(pristine, dir, fs::copy_options::recursive);
    };
    // How many operations a save makes from this start.
    reset();
    long ops = 0;
    {
      faults::scope count(-1);
      nn::save_checkpoint(dir, b);
      ops = faults::seen;
    }
    after_clean_save = generations(dir);
    CHECK(ops > 20);
    // What restore finds now: the old state, the new one, or (only for a first save) nothing.
    const auto restored = [&] {
      nn::train_state r(m, make_net(m), nn::adam(1e-2f), {});
      try {
        nn::restore_checkpoint(dir, r);
      } catch (const nn::checkpoint_error& e) {
        CHECK(from_nothing);
        const std::string what = e.what();
        CHECK((what == "meshlib::nn: restore_checkpoint: '" + dir.string() + "' holds no complete checkpoint: '" +
                           (dir / "index").string() + "' is missing (the first save into it did not finish)" ||
               what == "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() +
                           "' is missing: not a checkpoint"));
        return 0;
      }
      const auto got = snapshot(r);
      CHECK((got == new_state || (!from_nothing && got == old_state)));
      return got == new_state ? 2 : 1;
    };
    // ... and the next save, without faults, succeeds and leaves exactly a clean save's files.
    const auto recovers = [&] {
      nn::save_checkpoint(dir, b);
      CHECK(restored() == 2);
      CHECK(generations(dir) == after_clean_save);
    };
    for (long k = 0; k < ops; ++k) {
      INFO("operation " << k << " of " << ops);
      // A failing operation (EIO, ENOSPC): a checkpoint_error naming the file, or, for the clean-up
      // after the commit, success.
      reset();
      const int err = k % 2 ? ENOSPC : EIO;
      bool threw = false;
      {
        faults::scope fail(k, err);
        try {
          nn::save_checkpoint(dir, b);
        } catch (const nn::checkpoint_error& e) {
          threw = true;
          const std::string what = e.what();
          const auto& failed = faults::log.at(static_cast<std::size_t>(k)).second;
          CHECK(what.find("meshlib::nn: save_checkpoint: cannot ") == 0);
          CHECK(what.find(failed) != std::string::npos);
          CHECK(what.find(std::generic_category().message(err)) != std::string::npos);
        }
      }
      const int found = restored();
      if (threw && found == 2) {  // only the sync of the directory after the commit fails so
        CHECK(faults::log.at(static_cast<std::size_t>(k)).first == nn::detail::checkpoint_op::sync);
        CHECK(faults::log.at(static_cast<std::size_t>(k)).second == dir.filename().string());
      }
      if (!threw) CHECK(found == 2);
      recovers();

      // The process killed (SIGKILL) at that operation.
      reset();
      const pid_t child = ::fork();
      REQUIRE(child >= 0);
      if (child == 0) {
        faults::scope die(k, EIO, true);
        try {
          nn::save_checkpoint(dir, b);
        } catch (...) {
          ::_exit(3);
        }
        ::_exit(0);
      }
      int status = 0;
      REQUIRE(::waitpid(child, &status, 0) == child);
      CHECK(WIFSIGNALED(status));
      CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));
      restored();
      recovers();
    }
  }
  fs::remove_all(base);
}

}  // namespace MESHLIB_TEST_UNIT
