// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Kernel launches per training step (issue 38 item 2: few kernels per step), counted with
// meshlib::launch_counter on the CPU backend: the count does not depend on the backend, so a change
// that adds a kernel to the flagship's step fails here. Also the counter's own laws: it counts what
// runs while it lives, nests, and puts back the callbacks it found. A binary of its own: the counter
// installs process-wide Kokkos Tools callbacks.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string_view>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "synthetic_problem.hpp"

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

/// Whether this build's float products go to the BLAS (else they are meshlib's own Kokkos kernel).
bool blas_products() {
  const char* no = std::getenv("MESHLIB_NO_BLAS");
  return meshlib::config::kokkos_kernels && !(no != nullptr && std::string(no) == "1");
}

/// Runs `n` one-element kernels on the running instance.
void launch_n(std::size_t n, float* p) {
  for (std::size_t k = 0; k < n; ++k) meshlib::launch<meshlib::default_memory_space>(1, KOKKOS_LAMBDA(std::size_t) { *p += 1; });
}

}  // namespace

TEST_CASE("launch_counter counts the launches and products made while it lives, and nests", "[nn][launches]") {
  auto buf = meshlib::allocate<float, 1>({1}, "launch_counter_test");
  const auto before = Kokkos::Tools::Experimental::get_callbacks();
  for (std::size_t outer_n : {0, 1, 5}) {
    for (std::size_t inner_n : {0, 2, 7}) {
      meshlib::launch_counter outer;
      launch_n(outer_n, buf.data());
      {
        meshlib::launch_counter inner;
        launch_n(inner_n, buf.data());
        CHECK(inner.kernels() == inner_n);
        CHECK(inner.products() == 0);
      }
      launch_n(1, buf.data());
      CHECK(outer.kernels() == outer_n + inner_n + 1);
      outer.reset();
      CHECK(outer.launches() == 0);
      CHECK(outer.by_name().empty());
    }
  }
  // A product: one BLAS call (one region), or one Kokkos kernel without the BLAS.
  auto a = meshlib::allocate<float, 2>({3, 4}, "a");
  auto b = meshlib::allocate<float, 2>({4, 5}, "b");
  auto c = meshlib::allocate<float, 2>({3, 5}, "c");
  for (std::size_t n : {1, 3}) {
    meshlib::launch_counter count;
    for (std::size_t k = 0; k < n; ++k) meshlib::matmul_into(c, a, b);
    CHECK(count.products() == (blas_products() ? n : 0));
    CHECK(count.kernels() == (blas_products() ? 0 : n));
    if (blas_products()) CHECK(count.by_name().at(meshlib::blas_product_region) == n);
  }
  // Every counter gone: the callbacks found at the start are back (none are counting).
  const auto after = Kokkos::Tools::Experimental::get_callbacks();
  CHECK(after.begin_parallel_for == before.begin_parallel_for);
  CHECK(after.begin_parallel_reduce == before.begin_parallel_reduce);
  CHECK(after.push_region == before.push_region);
}

TEST_CASE("the MLP step launches a fixed number of kernels and products", "[nn][launches]") {
  // The flagship's model (issue 38) with 256-wide hidden layers: 784-256-256-10 of dense + relu,
  // Adam, on a 1x1 mesh. The counts do not depend on the batch.
  constexpr std::size_t features = 784, hidden = 256, classes = 10, batch = 32;
  const mesh_t m{1, 1};
  const nn::rng_key key{3};
  nn::train_state state(m,
                        nn::sequential(nn::dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                                       nn::dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::relu<float>(m),
                                       nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key)),
                        nn::adam(nn::constant(1e-3f)));
  const auto ds = meshlib_test::synthetic_problem(batch, features, classes);
  auto step = [&] {
    return nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch, 0, batch);
  };
  step();
  step();  // buffers are allocated (and zero-filled by kernels) in the first steps only
  meshlib::launch_counter count;
  (void)step();
  std::ostringstream text;
  text << count;
  INFO(text.str());
  // Products (BLAS calls): forward x W for the 3 layers; backward dW = x^T dy for the 3 layers and
  // dx = dy W^T for the 2 layers above the input (the input needs no gradient).
  constexpr std::size_t products = 3 + 3 + 2;
  // Kokkos kernels:
  //   forward: add_bias x 3, activation_forward (relu) x 2
  //   loss: softmax_cross_entropy_rows (per row: max, exp and normaliser, loss term, gradient; it
  //     was 3 kernels) and cross_entropy_totals (the rows' terms added in row order)
  //   backward: bias_grad for fc3, and for fc2 and fc1 one activation_bias_backward each (the relu
  //     above the layer's cotangent and the layer's bias gradient in one kernel; it was
  //     activation_backward + bias_grad, 2 each): 3 (was 5)
  //   gradient norm: one multi-tensor sum_of_squares over the 6 parameters' gradients, a kernel
  //     of partial sums per block and one that adds them (2; it was 9 per step: a pair per
  //     parameter of more than one block, one kernel for the others)
  //   optimizer: one multi-tensor Adam kernel over the 6 parameters (fused_runs_kernel<adam_step,
  //     scale_step>; it was one fused kernel per parameter, 6)
  constexpr std::size_t kernels = (3 + 2) + 2 + (1 + 2) + 2 + 1;  // 13 kernels + 8 products = 21 launches (was 23)
  if (blas_products()) {
    CHECK(count.products() == products);
    CHECK(count.kernels() == kernels);
  } else {
    CHECK(count.products() == 0);
    CHECK(count.kernels() == kernels + products);
  }
  CHECK(count.launches() == kernels + products);
}
TEST_CASE("a device's sum of squares is one multi-tensor reduction, bitwise the per-run sums in run order",
          "[nn][launches][norm]") {
  namespace d = meshlib::nn::detail;
  constexpr std::size_t blk = d::kernel_block;
  // Runs of every length class: empty, one element, one block less one, exactly one block, just over,
  // several blocks and a tail; alone and together, in both orders.
  const std::vector<std::size_t> lengths{0, 1, blk - 1, blk, blk + 1, 3 * blk + 17, 2 * blk};
  std::vector<std::vector<std::size_t>> cases{{}, {0}};
  for (std::size_t n : lengths) cases.push_back({n});
  cases.push_back(lengths);
  cases.emplace_back(lengths.rbegin(), lengths.rend());
  for (const auto& lens : cases) {
    std::size_t total = 0;
    for (std::size_t n : lens) total += n;
    auto data = meshlib::allocate<float, 1>({total + 1}, "norm_runs");
    std::vector<float> host(total + 1);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)) * (1 + i % 13));
    meshlib::copy_from_host<meshlib::default_memory_space>(data.data(), host.data(), host.size());
    std::vector<d::float_run> runs;
    double expected = 0;  // each run's blocks added from 0 in order, the runs' sums added in run order
    std::size_t off = 0;
    for (std::size_t n : lens) {
      runs.push_back({data.data() + off, n});
      double s = 0;
      for (std::size_t i0 = 0; i0 < n; i0 += blk) s += d::squares_of_block(host.data() + off, i0, std::min(n, i0 + blk));
      expected += s;
      off += n;
    }
    std::vector<std::size_t> words;
    const std::size_t blocks = d::run_table(runs, words);
    auto table = meshlib::allocate<std::size_t, 1>({words.size() + 1}, "norm_table");
    meshlib::copy_from_host<meshlib::default_memory_space>(table.data(), words.data(), words.size());
    auto scratch = meshlib::allocate<double, 1>({blocks + 1}, "norm_scratch");
    meshlib::launch_counter count;
    const double got = d::sum_of_squares<meshlib::default_memory_space>(table.data(), words.size() / d::run_words, blocks,
                                                                        scratch.data());
    INFO("runs of " << lens.size() << ", " << blocks << " blocks");
    CHECK(got == expected);
    CHECK(count.kernels() == (blocks == 0 ? 0 : 2));
  }
}

TEST_CASE("update_and_apply_all: one kernel over a device's runs, bitwise the update run by run",
          "[nn][launches][optim]") {
  namespace d = meshlib::nn::detail;
  constexpr std::size_t blk = d::kernel_block;
  // Runs of every length class (empty, one element, a block less one, a block, just over, several
  // blocks and a tail), each of its own parameter; the names decide weight decay's mask, so adamw's
  // runs carry different constants in one table.
  const std::vector<std::size_t> lengths{3 * blk + 17, 0, 1, blk - 1, blk, blk + 1, 2 * blk};
  const std::vector<std::string> names{"a.w", "b.w", "c.b", "d.w", "e.b", "f.w", "g.b"};
  struct custom {  // a user's transform: no kernel of ours, handed the runs one at a time
    std::size_t slots() const { return 0; }
    void update(const nn::update_run& r) const {
      for (std::size_t i = 0; i < r.size; ++i) r.updates[i] = 0.5f * r.updates[i] - 0.25f;
    }
  };
  const std::size_t shape[1] = {1};
  for (const char* which : {"adam", "adamw", "sgd", "clipped adamw", "custom"}) {
    INFO(which);
    const std::string w = which;
    const nn::optimizer opt = w == "adam"    ? nn::adam(nn::warmup_cosine(3e-2f, 2, 10))
                              : w == "adamw" ? nn::adamw(3e-2f, 1e-2f, 0.9f, 0.999f, 1e-8f,
                                                         [](std::string_view name) { return name.ends_with(".w"); })
                              : w == "sgd"   ? nn::sgd(3e-2f, 0.9f)
                              : w == "custom"
                                  ? nn::optimizer(nn::chain(custom{}, nn::scale_by_learning_rate(3e-2f)))
                                  : nn::optimizer(nn::chain(nn::clip_by_global_norm(0.7f), nn::adamw(3e-2f, 1e-2f)));
    const bool one_kernel = w == "adam" || w == "adamw" || w == "sgd";
    const std::size_t slots = opt.slots(), stage = opt.stages() - 1;
    // Two copies of every parameter, gradient and state slot: one updated run by run, one in a batch.
    std::size_t total = 0;
    for (std::size_t n : lengths) total += n;
    auto mem = meshlib::allocate<float, 1>({2 * total * (2 + slots) + 1}, "update_all");
    std::vector<float> host(2 * total * (2 + slots) + 1);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
    for (std::size_t i = 0; i < total; ++i) {  // the state slots start alike (the second moment >= 0)
      for (std::size_t s = 0; s < slots; ++s) {
        float& a = host[(2 + s) * total + i];
        a = s == 1 ? std::abs(a) : a;
        host[(2 + slots) * total + (2 + s) * total + i] = a;
      }
      host[(2 + slots) * total + i] = host[i];                  // the same gradient
      host[(2 + slots) * total + total + i] = host[total + i];  // the same parameter
    }
    meshlib::copy_from_host<meshlib::default_memory_space>(mem.data(), host.data(), host.size());
    std::vector<nn::update_run> runs[2];
    std::vector<float*> params[2], slot_ptrs[2];
    for (std::size_t c = 0; c < 2; ++c) {
      float* base = mem.data() + c * total * (2 + slots);
      std::size_t off = 0;
      slot_ptrs[c].resize(lengths.size() * slots + 1);
      for (std::size_t r = 0; r < lengths.size(); ++r) {
        for (std::size_t s = 0; s < slots; ++s) slot_ptrs[c][r * slots + s] = base + (2 + s) * total + off;
        runs[c].push_back(nn::update_run{base + off, base + total + off,
                                         std::span<float* const>(slot_ptrs[c].data() + r * slots, slots), lengths[r], 0,
                                         3, stage, 1.5, nn::param_info{names[r], shape, true}});
        params[c].push_back(base + total + off);
        off += lengths[r];
      }
    }
    for (std::size_t r = 0; r < lengths.size(); ++r) opt.update_and_apply(runs[0][r], params[0][r]);
    d::run_table_buffers tables(1);
    std::vector<std::size_t> words;
    meshlib::launch_counter count;
    opt.update_and_apply_all(d::update_batch{runs[1], params[1], &tables, &words, 0});
    if (one_kernel) {
      CHECK(count.kernels() == 1);
      REQUIRE(count.by_name().size() == 1);
      CHECK(count.by_name().begin()->first.find("fused_runs_kernel") != std::string::npos);
    } else {
      CHECK(count.kernels() > 1);
    }
    std::vector<float> out(host.size());
    meshlib::copy_to_host<meshlib::default_memory_space>(out.data(), mem.data(), out.size());
    const std::size_t half = total * (2 + slots);
    // Gradients (the updates), parameters and state: the batch's copy is the run-by-run copy's bits.
    REQUIRE(std::memcmp(out.data(), out.data() + half, half * sizeof(float)) == 0);
    // And the update did something: the parameters moved.
    CHECK(std::memcmp(out.data() + total, host.data() + total, total * sizeof(float)) != 0);
  }
}

TEST_CASE("softmax cross-entropy over every class in two kernels, bitwise the three-pass kernels",
          "[nn][launches][loss]") {
  namespace d = meshlib::nn::detail;
  using space = meshlib::default_memory_space;
  for (std::size_t rows : {1, 5, 33}) {
    for (std::size_t cols : {1, 10, 257}) {
      INFO(rows << " x " << cols);
      const std::size_t global_batch = 2 * rows + 1;  // the mean is over more rows than this device's
      std::vector<float> z(rows * cols);
      std::vector<std::int32_t> lab(rows);
      for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>(8 * std::sin(1.3 * static_cast<double>(i)));
      for (std::size_t i = 0; i < rows; ++i) lab[i] = static_cast<std::int32_t>((7 * i + 3) % cols);
      auto zd = meshlib::allocate<float, 1>({z.size()}, "z");
      auto ld = meshlib::allocate<std::int32_t, 1>({rows}, "labels");
      meshlib::copy_from_host<space>(zd.data(), z.data(), z.size());
      meshlib::copy_from_host<space>(ld.data(), lab.data(), rows);
      // The same buffers twice: [gradient | max | normaliser | target], and the terms.
      auto buf = meshlib::allocate<float, 1>({2 * (z.size() + 3 * rows)}, "grad");
      auto terms = meshlib::allocate<double, 1>({2 * (rows + 2)}, "terms");
      float* g[2] = {buf.data(), buf.data() + z.size() + 3 * rows};
      double* t[2] = {terms.data(), terms.data() + rows + 2};
      d::row_max<space>(zd.data(), rows, cols, g[0] + z.size());
      d::exp_and_target<space>(zd.data(), rows, cols, 0, ld.data(), g[0] + z.size(), g[0], g[0] + z.size() + rows,
                               g[0] + z.size() + 2 * rows);
      const nn::loss_part three =
          d::cross_entropy_terms<space>(rows, cols, 0, ld.data(), g[0] + z.size(), g[0] + z.size() + rows,
                                        g[0] + z.size() + 2 * rows, global_batch, g[0], t[0]);
      meshlib::launch_counter count;
      const nn::loss_part fused = d::softmax_cross_entropy_rows<space>(
          zd.data(), rows, cols, ld.data(), global_batch, g[1], g[1] + z.size(), g[1] + z.size() + rows,
          g[1] + z.size() + 2 * rows, t[1]);
      CHECK(count.kernels() == 2);
      CHECK(fused.loss == three.loss);
      CHECK(fused.correct == three.correct);
      std::vector<float> out(2 * (z.size() + 3 * rows));
      meshlib::copy_to_host<space>(out.data(), buf.data(), out.size());
      // The gradient and the per-row max, normaliser and target logit: the same bits.
      REQUIRE(std::memcmp(out.data(), out.data() + out.size() / 2, out.size() / 2 * sizeof(float)) == 0);
      // And both are softmax cross-entropy: a plain loop in double, to rounding.
      double loss = 0;
      std::size_t correct = 0;
      for (std::size_t i = 0; i < rows; ++i) {
        double m = -INFINITY, s = 0;
        for (std::size_t j = 0; j < cols; ++j) m = std::max(m, static_cast<double>(z[i * cols + j]));
        for (std::size_t j = 0; j < cols; ++j) s += std::exp(z[i * cols + j] - m);
        const std::size_t l = static_cast<std::size_t>(lab[i]);
        loss += (std::log(s) + m - z[i * cols + l]) / static_cast<double>(global_batch);
        correct += z[i * cols + l] >= m ? 1 : 0;
        for (std::size_t j = 0; j < cols; ++j) {
          const double p = std::exp(z[i * cols + j] - m) / s;
          const double want = (p - (j == l ? 1.0 : 0.0)) / static_cast<double>(global_batch);
          REQUIRE(std::abs(out[i * cols + j] - want) <= 1e-6);
        }
      }
      CHECK(std::abs(fused.loss - loss) <= 1e-5 * std::max(1.0, std::abs(loss)));
      CHECK(fused.correct == correct);
    }
  }
}

namespace {

/// `activation_bias_backward` against `activation_backward` then `bias_grad` (bitwise, and one
/// launch where those are two) and against plain loops (bitwise: the same expression per element,
/// each column's rows added in row order in `T`).
template <class T, class Fn>
void check_activation_bias_backward() {
  namespace d = meshlib::nn::detail;
  using space = meshlib::default_memory_space;
  // Widths on both sides of a column block (one work item, several, a partial last one).
  for (std::size_t rows : {1, 4, 33}) {
    for (std::size_t cols : {std::size_t{1}, std::size_t{10}, d::column_block, d::column_block + 1, 2 * d::column_block + 7}) {
      for (bool fresh : {true, false}) {
        INFO(Fn::name.view() << ", " << sizeof(T) << "-byte values, " << rows << " x " << cols << (fresh ? ", fresh" : ", adding"));
        const std::size_t n = rows * cols;
        // dy, x, and the bias gradient's starting values: x of both signs and zeros (relu's edge).
        std::vector<T> host(2 * n + cols);
        for (std::size_t i = 0; i < host.size(); ++i)
          host[i] = i % 7 == 3 ? T{0} : static_cast<T>(3 * std::sin(0.91 * static_cast<double>(i) + 0.3));
        auto in = meshlib::allocate<T, 1>({host.size()}, "in");
        meshlib::copy_from_host<space>(in.data(), host.data(), host.size());
        const T* dy = in.data();
        const T* x = in.data() + n;
        // [d | gb] twice: the two kernels', the fused kernel's.
        auto out = meshlib::allocate<T, 1>({2 * (n + cols)}, "out");
        T* o = out.data();
        meshlib::copy_from_host<space>(o + n, host.data() + 2 * n, cols);
        meshlib::copy_from_host<space>(o + 2 * n + cols, host.data() + 2 * n, cols);
        d::activation_backward<space, Fn>(o, dy, x, n);
        d::bias_grad<space>(o + n, o, rows, cols, fresh);
        meshlib::launch_counter count;
        d::activation_bias_backward<space, Fn>(o + n + cols, o + 2 * n + cols, dy, x, rows, cols, fresh);
        CHECK(count.kernels() == 1);
        std::vector<T> got(2 * (n + cols));
        meshlib::copy_to_host<space>(got.data(), o, got.size());
        REQUIRE(std::memcmp(got.data(), got.data() + n + cols, (n + cols) * sizeof(T)) == 0);
        // The plain loops.
        std::vector<T> want_d(n), want_gb(cols);
        for (std::size_t i = 0; i < n; ++i) {
          const T dyi = host[i], xi = host[n + i];
          if constexpr (std::is_same_v<Fn, d::relu_fn>) want_d[i] = xi > T{0} ? dyi : T{0};
          else want_d[i] = dyi * Fn::df(xi);
        }
        for (std::size_t j = 0; j < cols; ++j) {
          T s = fresh ? T{0} : host[2 * n + j];
          for (std::size_t i = 0; i < rows; ++i) s += want_d[i * cols + j];
          want_gb[j] = s;
        }
        CHECK(std::memcmp(got.data() + n + cols, want_d.data(), n * sizeof(T)) == 0);
        CHECK(std::memcmp(got.data() + 2 * n + cols, want_gb.data(), cols * sizeof(T)) == 0);
      }
    }
  }
}

/// Runs `net`'s layers forward and backward one by one (the unfused path: each layer's own
/// `backward`), with `round` applied to every output and cotangent as `sequential` applies it.
template <class Net, class X, std::size_t... I>
auto layer_by_layer(Net& net, const X& x, void (*round)(float*, std::size_t) noexcept, std::index_sequence<I...>) {
  constexpr std::size_t n = sizeof...(I);
  auto fwd = [&](auto& self, auto idx, const auto& v) {
    constexpr std::size_t k = decltype(idx)::value;
    if constexpr (k == n) {
      return v;
    } else {
      auto y = std::get<k>(net.layers).forward(v);
      if (round != nullptr) round(y.data(), y.size());
      return self(self, std::integral_constant<std::size_t, k + 1>{}, y);
    }
  };
  const auto y = fwd(fwd, std::integral_constant<std::size_t, 0>{}, x);
  auto bwd = [&](auto& self, auto idx, const auto& dy) {
    constexpr std::size_t k = decltype(idx)::value;
    auto dx = std::get<k>(net.layers).backward(dy, true);
    if (round != nullptr) round(dx.data(), dx.size());
    if constexpr (k == 0) return dx;
    else return self(self, std::integral_constant<std::size_t, k - 1>{}, dx);
  };
  return bwd(bwd, std::integral_constant<std::size_t, n - 1>{}, y);  // the output as its own cotangent
}

/// Every parameter's gradient on `dev`, and `dx`, as host floats.
template <class Net, class DX>
std::vector<float> grads_and_dx(Net& net, const DX& dx, std::size_t dev) {
  std::vector<nn::param_ref<float>> params;
  net.collect(params);
  std::vector<float> out(dx.data(), dx.data() + dx.size());
  for (const auto& p : params) {
    const float* g = p.grad[dev];
    out.insert(out.end(), g, g + p.count[dev]);
  }
  return out;
}

}  // namespace

TEST_CASE("an activation's backward and the dense bias gradient are one kernel, bitwise the two kernels",
          "[nn][launches][dense]") {
  check_activation_bias_backward<float, nn::detail::relu_fn>();
  check_activation_bias_backward<float, nn::detail::gelu_fn>();
  check_activation_bias_backward<double, nn::detail::relu_fn>();
  check_activation_bias_backward<double, nn::detail::gelu_fn>();
}

TEST_CASE("sequential fuses each dense layer's backward with its activation's: bitwise the layers one by one",
          "[nn][launches][dense]") {
  // Every kind of dense layer before an activation (column_dense + gelu first: the pair whose
  // fused backward hands back the network's dx; row_dense + relu; dense + relu last: the pair that
  // receives the network's cotangent), on one device and with the model axis split over two.
  constexpr std::size_t batch = 6, in = 5, hidden = 8, out = 4;
  const nn::rng_key key{11};
  std::vector<float> host_x(batch * in);
  for (std::size_t i = 0; i < host_x.size(); ++i) host_x[i] = static_cast<float>(std::sin(1.7 * static_cast<double>(i)));
  using round_fn = void (*)(float*, std::size_t) noexcept;
  std::vector<std::pair<std::string, round_fn>> roundings{{"float32", nullptr},
                                                          {"bfloat16", &nn::detail::round_to<meshlib::bfloat16>}};
#if MESHLIB_HAS_FLOAT16
  roundings.emplace_back("float16", &nn::detail::round_to<meshlib::float16>);
#endif
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{1, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    const auto xs = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>{m},
                                       std::array<std::size_t, 2>{batch, in}, host_x);
    for (const auto& entry : roundings) {
      const round_fn rounding = entry.second;  // not a structured binding: Clang before 16 cannot capture one
      const std::string& precision = entry.first;
      INFO("mesh " << shape[0] << "x" << shape[1] << ", computing in " << precision);
      auto make = [&] {
        return nn::sequential(nn::column_dense<float, mesh_t>(m, "c1", in, hidden, key), nn::gelu<float>(m),
                              nn::row_dense<float, mesh_t>(m, "r2", hidden, hidden, key), nn::relu<float>(m),
                              nn::dense<float, mesh_t>(m, "d3", hidden, out, key), nn::relu<float>(m));
      };
      auto fused = make();
      auto plain = make();
      fused.round_activations = rounding;
      std::vector<std::vector<float>> got(m.size()), want(m.size());
      std::size_t launches[2] = {0, 0};
      for (int pass = 0; pass < 2; ++pass) {  // the first overwrites the gradients, the second adds
        for (auto* net : {&fused, &plain}) {
          std::vector<nn::param_ref<float>> params;
          net->collect(params);
          for (const auto& p : params)
            for (std::size_t dev = 0; dev < m.size(); ++dev)
              if (p.overwrite != nullptr) p.overwrite[dev] = pass == 0 ? 1 : 0;
        }
        meshlib::launch_counter count_fused;
        meshlib::spmd(m, [&](std::size_t dev) {
          const auto x = xs.local_value(dev);
          const auto y = fused.forward(x);
          const auto dx = fused.template backward<std::remove_cvref_t<decltype(x)>>(y, true);
          got[dev] = grads_and_dx(fused, dx, dev);
        });
        launches[0] = count_fused.kernels() + count_fused.products();
        count_fused.reset();
        meshlib::launch_counter count_plain;
        meshlib::spmd(m, [&](std::size_t dev) {
          const auto dx = layer_by_layer(plain, xs.local_value(dev), rounding, std::make_index_sequence<6>{});
          want[dev] = grads_and_dx(plain, dx, dev);
        });
        launches[1] = count_plain.kernels() + count_plain.products();
        for (std::size_t dev = 0; dev < m.size(); ++dev) {
          INFO("pass " << pass << ", device " << dev);
          REQUIRE(got[dev].size() == want[dev].size());
          CHECK(std::memcmp(got[dev].data(), want[dev].data(), got[dev].size() * sizeof(float)) == 0);
        }
        // Three pairs fused on every device; rounding keeps the layers apart (it rounds the
        // activation's cotangent before the bias gradient sums it).
        CHECK(launches[1] - launches[0] == (rounding == nullptr ? 3 * m.size() : 0));
      }
    }
  }
}
