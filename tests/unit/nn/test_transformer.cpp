// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The Transformer layers (issue 25): rms_norm, the vocabulary-parallel embedding, the learned
// positional embedding, causal self-attention with heads sharded over "model", and cross-entropy
// on vocabulary-parallel logits. Each forward against a plain reference loop written here; every
// parameter's gradient against central finite differences (double) on one device and on (1, 2) and
// (2, 2) meshes; the vocabulary-parallel embedding and cross-entropy on (1, 2) / (1, 4) equal to one
// device; each bad size a clear error naming the layer, the sizes and the fix.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
using rows_t = meshlib::named_sharding<mesh_t, meshlib::P<"data">>;
constexpr meshlib::axis_mask data_mask = mesh_t::mask_of<"data">();

constexpr std::size_t seq = 4, tokens = 8, classes = 5;  // two sequences of four tokens

std::vector<std::int32_t> labels_of(std::size_t n) {
  std::vector<std::int32_t> y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = static_cast<std::int32_t>((i * 3 + 1) % classes);
  return y;
}

template <class T>
std::vector<T> wave(std::size_t n, double f = 0.37) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>(std::sin(f * static_cast<double>(i) + 0.2));
  return v;
}

std::vector<std::int32_t> ids_of(std::size_t n, std::size_t vocab) {
  std::vector<std::int32_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = static_cast<std::int32_t>((i * 5 + 2) % vocab);
  return ids;
}

/// The global values of a parameter, assembled from the devices' blocks.
template <class T>
std::vector<T> global_values(const nn::param_ref<T>& p, bool grad = false) {
  std::size_t total = 1;
  for (auto e : p.shape) total *= e;
  std::vector<T> g(total);
  for (std::size_t dev = 0; dev < p.value.size(); ++dev)
    for (std::size_t i = 0; i < p.count[dev]; ++i) g[nn::detail::global_index(p, dev, i)] = (grad ? p.grad : p.value)[dev][i];
  return g;
}

/// The mean softmax cross-entropy of `net`'s output over `labels` (one per global row), as
/// `nn::check_gradients` runs it on each device: the devices' shares summed over data with the
/// public psum; when `backward`, the analytic gradients are added into the parameters.
/// `input(dev)` gives device `dev`'s block of the network's input.
template <class T, class Net, class Input>
auto loss_of(const mesh_t& m, Net& net, Input input, std::vector<std::int32_t> labels) {
  const std::size_t rows = labels.size() / m.axes_size(data_mask);
  return [&m, &net, input, labels = std::move(labels), rows, ce = nn::softmax_cross_entropy<T>(m)](
             std::size_t dev, bool backward) mutable {
    auto x = input(dev);
    auto logits = net.forward(x);
    const std::size_t di = meshlib::axis_index<"data">();
    auto part = ce.forward(logits, std::span<const std::int32_t>(labels).subspan(di * rows, rows), labels.size());
    if (backward) net.template backward<decltype(x)>(ce.backward(logits), true);
    using share_t = meshlib::local_tensor<double, 0, mesh_t, data_mask>;
    share_t share(std::array<std::size_t, 0>{}, m, dev);
    share() = part.loss;
    return meshlib::psum<"data">(share)();
  };
}

/// The loss of `net` (`loss_of`), with its gradients left in the parameters (a fresh `net`: they
/// start at zero).
template <class T, class Net, class Input>
double loss_and_grad(const mesh_t& m, Net& net, const Input& input, const std::vector<std::int32_t>& labels) {
  auto losses = meshlib::spmd(m, [loss = loss_of<T>(m, net, input, labels)](std::size_t dev) mutable {
    return loss(dev, true);
  });
  for (double l : losses) REQUIRE(std::abs(l - losses[0]) < 1e-12);  // every device agrees
  return losses[0];
}

/// Every element of every parameter against central differences of `loss_of` (step 1e-5, within
/// 1e-6 (1 + |numeric|)), on every device that holds it: gradients of parameters not split over
/// data are the data replicas' pending sums, summed over "data".
const nn::gradient_check_options<double> fd_options{.eps = 1e-5, .atol = 1e-6, .rtol = 1e-6, .reduce_axes = {"data"}};

/// Float rows `(n, width)` sharded over data, from a wave.
template <class T>
auto float_rows(const mesh_t& m, std::size_t n, std::size_t width) {
  return meshlib::from_host(rows_t{m}, std::array<std::size_t, 2>{n, width}, wave<T>(n * width));
}
/// Token ids `(n)` sharded over data.
auto id_rows(const mesh_t& m, const std::vector<std::int32_t>& ids) {
  return meshlib::from_host(rows_t{m}, std::array<std::size_t, 1>{ids.size()}, ids);
}

/// `y` (this device's rows of a `(rows, cols)` output, rows sharded over data) placed in `out`.
template <class Y, class T>
void place_rows(const Y& y, std::vector<T>& out) {
  const std::size_t rows = y.extent(0), cols = y.extent(1);
  const std::size_t r0 = y.mesh().group_rank(y.device(), data_mask) * rows;
  if (y.mesh().group_rank(y.device(), y.mesh().all_axes & ~data_mask) != 0) return;  // one model replica writes
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < cols; ++j) out[(r0 + i) * cols + j] = y(i, j);
}

const std::array<std::array<std::size_t, 2>, 3> fd_meshes{{{1, 1}, {1, 2}, {2, 2}}};

}  // namespace

// ---- rms_norm ---------------------------------------------------------------------------------

TEST_CASE("rms_norm: forward equals the formula, gradients match finite differences", "[nn][transformer]") {
  constexpr std::size_t n = 6;
  const mesh_t one{1, 1};
  nn::rms_norm<double, mesh_t> norm(one, "norm", n);
  std::vector<nn::param_ref<double>> ps;
  norm.collect(ps);
  for (std::size_t j = 0; j < n; ++j) ps[0].value[0][j] = 0.5 + 0.1 * static_cast<double>(j);
  const auto xs = float_rows<double>(one, tokens, n);
  std::vector<double> got(tokens * n);
  meshlib::spmd(one, [&](std::size_t dev) { place_rows(norm.forward(xs.local_value(dev)), got); });
  const auto x = wave<double>(tokens * n);
  for (std::size_t i = 0; i < tokens; ++i) {
    double ms = 0;
    for (std::size_t j = 0; j < n; ++j) ms += x[i * n + j] * x[i * n + j];
    const double r = 1.0 / std::sqrt(ms / n + 1e-6);
    for (std::size_t j = 0; j < n; ++j) CHECK(std::abs(got[i * n + j] - x[i * n + j] * r * (0.5 + 0.1 * j)) < 1e-12);
  }
  for (auto shape : fd_meshes) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{3};
    nn::sequential net(nn::column_dense<double, mesh_t>(m, "c1", 6, 8, key), nn::gelu<double>(m),
                       nn::row_dense<double, mesh_t>(m, "r2", 8, 8, key), nn::rms_norm<double, mesh_t>(m, "norm", 8),
                       nn::dense<double, mesh_t>(m, "d3", 8, classes, key));
    const auto in = float_rows<double>(m, tokens, 6);
    const auto input = [&](std::size_t dev) { return in.local_value(dev); };
    nn::check_gradients(m, net, loss_of<double>(m, net, input, labels_of(tokens)), fd_options);
  }
}

// ---- embeddings -------------------------------------------------------------------------------

TEST_CASE("embedding and positional embedding: forward equals the table lookup on every mesh", "[nn][transformer]") {
  constexpr std::size_t vocab = 8, width = 4, max_len = 6;
  const auto ids = ids_of(tokens, vocab);
  const nn::rng_key key{7};
  // The tables' values are mesh-invariant: read them on one device.
  const mesh_t one{1, 1};
  nn::embedding<float, mesh_t> tok1(one, "tok", vocab, width, key);
  nn::positional_embedding<float, mesh_t> pos1(one, "pos", max_len, width, seq, key);
  std::vector<nn::param_ref<float>> ps;
  tok1.collect(ps);
  pos1.collect(ps);
  const auto table = global_values(ps[0]), ptable = global_values(ps[1]);
  REQUIRE(tok1.to_string() == "tok (embedding 8 x 4, vocabulary sharded over 'model')");
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{1, 2}, std::array<std::size_t, 2>{1, 4},
                     std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    nn::embedding<float, mesh_t> tok(m, "tok", vocab, width, key);
    nn::positional_embedding<float, mesh_t> pos(m, "pos", max_len, width, seq, key);
    const auto in = id_rows(m, ids);
    std::vector<float> e(tokens * width), y(tokens * width);
    meshlib::spmd(m, [&](std::size_t dev) {
      auto h = tok.forward(in.local_value(dev));
      place_rows(h, e);
      place_rows(pos.forward(h), y);
    });
    INFO("mesh " << m);
    for (std::size_t i = 0; i < tokens; ++i)
      for (std::size_t j = 0; j < width; ++j) {
        CHECK(e[i * width + j] == table[static_cast<std::size_t>(ids[i]) * width + j]);
        CHECK(y[i * width + j] == table[static_cast<std::size_t>(ids[i]) * width + j] + ptable[(i % seq) * width + j]);
      }
  }
}

TEST_CASE("embeddings: gradients match finite differences on 1 device, (1, 2) and (2, 2)", "[nn][transformer]") {
  for (auto shape : fd_meshes) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{8};
    // Ids repeat (vocab 6 < 8 tokens), so a table row gathers several tokens' cotangents.
    nn::sequential net(nn::embedding<double, mesh_t>(m, "tok", 6, 4, key, 0.5f),
                       nn::positional_embedding<double, mesh_t>(m, "pos", 5, 4, seq, key, 0.5f),
                       nn::rms_norm<double, mesh_t>(m, "norm", 4), nn::column_dense<double, mesh_t>(m, "head", 4, 6, key));
    auto ids = ids_of(tokens, 6);
    ids[3] = ids[1];
    const auto in = id_rows(m, ids);
    const auto input = [&](std::size_t dev) { return in.local_value(dev); };
    nn::check_gradients(m, net, loss_of<double>(m, net, input, labels_of(tokens)), fd_options);
  }
}

// ---- causal self-attention ----------------------------------------------------------------------

namespace {
/// Attention by the definition: y = concat_h(softmax(mask(Q_h K_h^T / sqrt(hd))) V_h) Wo + bo with
/// [q, k, v] = x Wqkv + bqkv, columns [head][q, k, v][hd]; global weights, one sequence at a time.
std::vector<double> reference_attention(const std::vector<double>& x, std::size_t n, std::size_t d, std::size_t heads,
                                        std::size_t s, const std::vector<double>& wqkv, const std::vector<double>& bqkv,
                                        const std::vector<double>& wo, const std::vector<double>& bo) {
  const std::size_t hd = d / heads;
  std::vector<double> qkv(n * 3 * d, 0.0), cat(n * d, 0.0), y(n * d, 0.0);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t c = 0; c < 3 * d; ++c) {
      double acc = bqkv[c];
      for (std::size_t k = 0; k < d; ++k) acc += x[i * d + k] * wqkv[k * 3 * d + c];
      qkv[i * 3 * d + c] = acc;
    }
  auto at = [&](std::size_t tok, std::size_t h, std::size_t t, std::size_t e) { return qkv[tok * 3 * d + (h * 3 + t) * hd + e]; };
  for (std::size_t b = 0; b < n / s; ++b)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < s; ++i) {
        std::vector<double> sc(i + 1);
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (std::size_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (std::size_t e = 0; e < hd; ++e) dot += at(b * s + i, h, 0, e) * at(b * s + j, h, 1, e);
          sc[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, sc[j]);
        }
        for (auto& v : sc) sum += (v = std::exp(v - mx));
        for (std::size_t e = 0; e < hd; ++e) {
          double o = 0;
          for (std::size_t j = 0; j <= i; ++j) o += sc[j] / sum * at(b * s + j, h, 2, e);
          cat[(b * s + i) * d + h * hd + e] = o;
        }
      }
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t c = 0; c < d; ++c) {
      double acc = bo[c];
      for (std::size_t k = 0; k < d; ++k) acc += cat[i * d + k] * wo[k * d + c];
      y[i * d + c] = acc;
    }
  return y;
}
}  // namespace

TEST_CASE("causal_self_attention: forward equals the definition on every mesh", "[nn][transformer]") {
  constexpr std::size_t d = 8, heads = 4;
  const nn::rng_key key{9};
  const auto x = wave<double>(tokens * d, 0.53);
  std::vector<double> ref;
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{1, 2}, std::array<std::size_t, 2>{2, 2},
                     std::array<std::size_t, 2>{1, 4}, std::array<std::size_t, 2>{2, 1}}) {
    const mesh_t m{shape[0], shape[1]};
    nn::causal_self_attention<double, mesh_t> attn(m, "attn", d, heads, seq, key);
    std::vector<nn::param_ref<double>> ps;
    attn.collect(ps);
    REQUIRE(ps.size() == 4);
    CHECK(ps[0].name == "attn.qkv.w");
    CHECK(ps[3].name == "attn.out.b");
    // Non-zero biases, so their placement is checked too (the same on every mesh).
    for (std::size_t pi : {1u, 3u})
      for (std::size_t dev = 0; dev < m.size(); ++dev)
        for (std::size_t i = 0; i < ps[pi].count[dev]; ++i)
          ps[pi].value[dev][i] = 0.1 * std::cos(static_cast<double>(nn::detail::global_index(ps[pi], dev, i)));
    if (ref.empty())
      ref = reference_attention(x, tokens, d, heads, seq, global_values(ps[0]), global_values(ps[1]),
                                global_values(ps[2]), global_values(ps[3]));
    const auto in = meshlib::from_host(rows_t{m}, std::array<std::size_t, 2>{tokens, d}, x);
    std::vector<double> y(tokens * d);
    meshlib::spmd(m, [&](std::size_t dev) { place_rows(attn.forward(in.local_value(dev)), y); });
    INFO("mesh " << m);
    for (std::size_t i = 0; i < y.size(); ++i) REQUIRE(std::abs(y[i] - ref[i]) < 1e-12);
  }
  // The mask: a token's output does not depend on later tokens.
  const mesh_t one{1, 1};
  nn::causal_self_attention<double, mesh_t> attn(one, "attn", d, heads, seq, key);
  auto x2 = x;
  for (std::size_t j = 0; j < d; ++j) x2[3 * d + j] += 1.0;  // the last token of the first sequence
  const auto a = meshlib::from_host(rows_t{one}, std::array<std::size_t, 2>{tokens, d}, x);
  const auto b = meshlib::from_host(rows_t{one}, std::array<std::size_t, 2>{tokens, d}, x2);
  std::vector<double> ya(tokens * d), yb(tokens * d);
  meshlib::spmd(one, [&](std::size_t dev) {
    place_rows(attn.forward(a.local_value(dev)), ya);
    place_rows(attn.forward(b.local_value(dev)), yb);
  });
  for (std::size_t i = 0; i < 3 * d; ++i) CHECK(ya[i] == yb[i]);
  CHECK(ya[3 * d] != yb[3 * d]);
}

TEST_CASE("causal_self_attention: gradients match finite differences on 1 device, (1, 2) and (2, 2)",
          "[nn][transformer]") {
  for (auto shape : fd_meshes) {
    const mesh_t m{shape[0], shape[1]};
    const nn::rng_key key{10};
    // Four heads: two per device on (1, 2) and (2, 2), and whole sequences per data device.
    nn::sequential net(nn::dense<double, mesh_t>(m, "in", 3, 8, key),
                       nn::causal_self_attention<double, mesh_t>(m, "attn", 8, 4, seq, key),
                       nn::dense<double, mesh_t>(m, "out", 8, classes, key));
    const auto in = float_rows<double>(m, tokens, 3);
    const auto input = [&](std::size_t dev) { return in.local_value(dev); };
    nn::check_gradients(m, net, loss_of<double>(m, net, input, labels_of(tokens)), fd_options);
  }
}

// ---- cross-entropy on vocabulary-parallel logits --------------------------------------------------

TEST_CASE("a language-model head: vocab-parallel embedding and cross-entropy equal one device on (1, 2), (1, 4)",
          "[nn][transformer]") {
  constexpr std::size_t vocab = 16, width = 8;
  const auto ids = ids_of(tokens, vocab);
  std::vector<std::int32_t> next(tokens);  // the next token of each sequence (wrapping), as a language model
  for (std::size_t i = 0; i < tokens; ++i) next[i] = ids[(i / seq) * seq + (i % seq + 1) % seq];
  struct result {
    double loss;
    std::vector<std::vector<float>> grads;
  };
  auto run = [&](std::size_t model) {
    const mesh_t m{1, model};
    const nn::rng_key key{11};
    // The head's output columns (the vocabulary) are sharded over "model": the loss reduces its
    // max and sum-exp with pmax / psum and never gathers the logits.
    nn::sequential net(nn::embedding<float, mesh_t>(m, "tok", vocab, width, key, 1.0f),
                       nn::positional_embedding<float, mesh_t>(m, "pos", seq, width, seq, key),
                       nn::causal_self_attention<float, mesh_t>(m, "attn", width, 4, seq, key),
                       nn::rms_norm<float, mesh_t>(m, "norm", width),
                       nn::column_dense<float, mesh_t>(m, "head", width, vocab, key));
    const auto in = id_rows(m, ids);
    result r{loss_and_grad<float>(m, net, [&](std::size_t dev) { return in.local_value(dev); }, next), {}};
    std::vector<nn::param_ref<float>> ps;
    net.collect(ps);
    for (const auto& p : ps) r.grads.push_back(global_values(p, true));
    return r;
  };
  const result one = run(1);
  // The loss against the formula on whole logits is the next test's business; here: a language
  // model's loss near log(vocab) at initialisation.
  CHECK(std::abs(one.loss - std::log(16.0)) < 1.0);
  for (std::size_t model : {2u, 4u}) {
    const result r = run(model);
    INFO("(1, " << model << ")");
    CHECK(std::abs(r.loss - one.loss) <= 1e-5 * std::abs(one.loss));
    REQUIRE(r.grads.size() == one.grads.size());
    for (std::size_t p = 0; p < r.grads.size(); ++p) {
      float scale = 0;
      for (float g : one.grads[p]) scale = std::max(scale, std::abs(g));
      for (std::size_t i = 0; i < r.grads[p].size(); ++i)
        REQUIRE(std::abs(r.grads[p][i] - one.grads[p][i]) <= 1e-5f * scale + 1e-7f);
    }
  }
}

TEST_CASE("cross-entropy on vocabulary-parallel logits equals the formula on the whole vocabulary", "[nn][transformer]") {
  constexpr std::size_t vocab = 12;
  const auto z = wave<float>(tokens * vocab, 0.91);
  const auto y = labels_of(tokens);
  double want = 0;
  std::vector<double> dz(tokens * vocab);
  for (std::size_t i = 0; i < tokens; ++i) {
    double mx = -1e300, s = 0;
    for (std::size_t j = 0; j < vocab; ++j) mx = std::max(mx, static_cast<double>(z[i * vocab + j]));
    for (std::size_t j = 0; j < vocab; ++j) s += std::exp(z[i * vocab + j] - mx);
    want += (std::log(s) + mx - z[i * vocab + static_cast<std::size_t>(y[i])]) / tokens;
    for (std::size_t j = 0; j < vocab; ++j)
      dz[i * vocab + j] = (std::exp(z[i * vocab + j] - mx) / s - (static_cast<std::int32_t>(j) == y[i] ? 1 : 0)) / tokens;
  }
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{1, 2}, std::array<std::size_t, 2>{1, 4},
                     std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    using vocab_t = meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>;
    const auto zs = meshlib::from_host(vocab_t{m}, std::array<std::size_t, 2>{tokens, vocab}, z);
    nn::softmax_cross_entropy<float> ce(m);
    const std::size_t rows = tokens / m.axes_size(data_mask);
    std::vector<float> grad(tokens * vocab, -1.0f);
    const auto shares = meshlib::spmd(m, [&](std::size_t dev) {
      auto zl = zs.local_value(dev);
      decltype(zl) g(zl.shape(), m, dev);
      const std::size_t di = m.group_rank(dev, data_mask);
      const auto part = ce(zl, std::span<const std::int32_t>(y).subspan(di * rows, rows), tokens, g);  // the loss_function call
      const auto b = zs.block_of(dev);
      for (std::size_t i = 0; i < g.extent(0); ++i)
        for (std::size_t j = 0; j < g.extent(1); ++j) grad[(b.offset[0] + i) * vocab + b.offset[1] + j] = g(i, j);
      return part.loss;
    });
    double total = 0;
    for (std::size_t dev = 0; dev < m.size(); ++dev)
      if (m.group_rank(dev, m.all_axes & ~data_mask) == 0) total += shares[dev];
    INFO("mesh " << m);
    CHECK(std::abs(total - want) <= 1e-5 * want);
    for (std::size_t i = 0; i < grad.size(); ++i) REQUIRE(std::abs(grad[i] - dz[i]) < 1e-6);
  }
}

// ---- errors ---------------------------------------------------------------------------------------

TEST_CASE("Transformer layers: bad sizes are errors naming the layer, the sizes and the fix", "[nn][transformer][errors]") {
  const nn::rng_key key{1};
  const mesh_t m4{1, 4};
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::causal_self_attention<float, mesh_t> a(m4, "attn", 12, 6, 4, key);
        }) ==
        "meshlib::nn: attn (causal_self_attention 12 features, 6 heads): 6 heads are not divisible by the 4 devices of "
        "the model axis 'model' the heads are sharded over; use a number of heads divisible by 4 or a model axis whose "
        "size divides 6");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::causal_self_attention<float, mesh_t> a(m4, "attn", 12, 8, 4, key);
        }) ==
        "meshlib::nn: attn (causal_self_attention 12 features, 8 heads): 12 features do not split into 8 heads; use a "
        "width divisible by the number of heads");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::embedding<float, mesh_t> e(m4, "tok", 10, 8, key); }) ==
        "meshlib::nn: tok (embedding 10 x 8): the vocabulary of 10 is not divisible by the 4 devices of the model axis "
        "'model' it is sharded over; pad the vocabulary to 12 (ids that never occur) or use a model axis whose size "
        "divides 10");
  // The language model's head: a vocabulary the model axis does not divide (the cross-entropy then
  // never sees uneven blocks).
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::column_dense<float, mesh_t> h(m4, "head", 8, 10, key); }) ==
        "meshlib::nn: head (column_dense 8 -> 10): its 10 outputs are not divisible by the 4 devices of the model axis "
        "'model' it splits them over; use a width divisible by 4 (pad a vocabulary to 12 with ids that never occur) or "
        "a model axis whose size divides 10");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::row_dense<float, mesh_t> r(m4, "r", 6, 8, key); }) ==
        "meshlib::nn: r (row_dense 6 -> 8): its 6 inputs are not divisible by the 4 devices of the model axis 'model' it "
        "splits them over; use a width divisible by 4 or a model axis whose size divides 6");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::positional_embedding<float, mesh_t> p(m4, "pos", 6, 8, 8, key);
        }) ==
        "meshlib::nn: pos (positional_embedding of 6 positions): a sequence of 8 tokens does not fit its table of 6 "
        "positions; use sequences of at most 6 tokens or declare pos with max_length 8");
  nn::positional_embedding<float, mesh_t> pos(m4, "pos", 6, 8, 6, key);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { pos.set_sequence_length(7); }) ==
        "meshlib::nn: pos (positional_embedding of 6 positions): a sequence of 7 tokens does not fit its table of 6 "
        "positions; use sequences of at most 6 tokens or declare pos with max_length 7");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { pos.set_sequence_length(0); }) ==
        "meshlib::nn: pos (positional_embedding of 6 positions): a sequence length of 0; use sequences of 1 to 6 "
        "tokens");
  CHECK(pos.sequence_length() == 6);  // unchanged by the refusals
  pos.set_sequence_length(4);
  CHECK(pos.sequence_length() == 4);

  // Inside spmd: an id out of the vocabulary, and rows that are not whole sequences.
  const mesh_t m{2, 2};
  nn::embedding<float, mesh_t> tok(m, "tok", 8, 4, key);
  auto ids = ids_of(tokens, 8);
  ids[5] = 8;
  const auto bad = id_rows(m, ids);
  std::string what;
  try {
    meshlib::spmd(m, [&](std::size_t dev) { (void)tok.forward(bad.local_value(dev)); });
  } catch (const meshlib::device_error& e) {
    what = meshlib_test::message_of<std::out_of_range>([&] { e.rethrow_cause(); });
  }
  // Token 5 is local token 1 of data replica 1: devices 2 and 3 (its two model shards) both refuse it.
  const auto refused = [](std::size_t dev) {
    return "meshlib::nn: tok (embedding 8 x 4, vocabulary sharded over 'model'): token 1 on device " + std::to_string(dev) +
           " has id 8, not in [0, 8); map the text to ids below the vocabulary size";
  };
  CHECK((what == refused(2) || what == refused(3)));
  nn::causal_self_attention<float, mesh_t> attn(m, "attn", 8, 2, 3, key);  // sequences of 3: 4 rows per device is not whole
  const auto xs = float_rows<float>(m, tokens, 8);
  what.clear();
  try {
    meshlib::spmd(m, [&](std::size_t dev) { (void)attn.forward(xs.local_value(dev)); });
  } catch (const meshlib::device_error& e) {
    what = meshlib_test::message_of<meshlib::sharding_error>([&] { e.rethrow_cause(); });
  }
  CHECK(what.find("meshlib::nn: attn (causal_self_attention 8 features, 2 heads sharded over 'model', sequences of 3) "
                  "received 4 tokens on device ") == 0);
  CHECK(what.find("not a whole number of sequences of 3") != std::string::npos);
}

// ---- the pre-norm block -------------------------------------------------------------------------

TEST_CASE("transformer_block: forward equals its layers composed by hand, gradients match finite differences",
          "[nn][transformer]") {
  constexpr std::size_t d = 8, heads = 2, hidden = 16;
  const nn::rng_key key{12};
  const auto x = wave<double>(tokens * d, 0.71);
  for (auto shape : fd_meshes) {
    const mesh_t m{shape[0], shape[1]};
    nn::transformer_block<double, mesh_t> blk(m, "h0", d, heads, hidden, seq, key);
    CHECK(blk.to_string() == "h0 (transformer_block 8 features, 2 heads, MLP 16)");
    // The same layers by name hold the same values (initialisation is by name), composed here.
    nn::layer_norm<double, mesh_t> ln1(m, "h0.ln1", d), ln2(m, "h0.ln2", d);
    nn::causal_self_attention<double, mesh_t> attn(m, "h0.attn", d, heads, seq, key);
    nn::column_dense<double, mesh_t> fc1(m, "h0.mlp.fc1", d, hidden, key);
    nn::gelu<double> act(m);
    nn::row_dense<double, mesh_t> fc2(m, "h0.mlp.fc2", hidden, d, key);
    const auto in = meshlib::from_host(rows_t{m}, std::array<std::size_t, 2>{tokens, d}, x);
    std::vector<double> got(tokens * d), h(tokens * d), want(tokens * d);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto xl = in.local_value(dev);
      place_rows(blk.forward(xl), got);
      place_rows(attn.forward(ln1.forward(xl)), h);
    });
    for (std::size_t i = 0; i < h.size(); ++i) h[i] += x[i];
    const auto hs = meshlib::from_host(rows_t{m}, std::array<std::size_t, 2>{tokens, d}, h);
    meshlib::spmd(m, [&](std::size_t dev) {
      place_rows(fc2.forward(act.forward(fc1.forward(ln2.forward(hs.local_value(dev))))), want);
    });
    INFO("mesh " << m);
    for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(std::abs(got[i] - (want[i] + h[i])) < 1e-12);

    nn::sequential net(nn::dense<double, mesh_t>(m, "in", 3, d, key),
                       nn::transformer_block<double, mesh_t, "model", nn::rms_norm<double, mesh_t>>(m, "h0", d, heads,
                                                                                                     hidden, seq, key),
                       nn::dense<double, mesh_t>(m, "out", d, classes, key));
    const auto xin = float_rows<double>(m, tokens, 3);
    const auto input = [&](std::size_t dev) { return xin.local_value(dev); };
    nn::check_gradients(m, net, loss_of<double>(m, net, input, labels_of(tokens)), fd_options);
  }
}

// ---- weight tying -------------------------------------------------------------------------------

TEST_CASE("tied_head: logits equal x E^T on every mesh; the tied table's gradient matches finite differences",
          "[nn][transformer]") {
  constexpr std::size_t vocab = 8, width = 4;
  const nn::rng_key key{13};
  const auto x = wave<double>(tokens * width, 0.43);
  std::vector<double> table;
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{1, 2}, std::array<std::size_t, 2>{1, 4},
                     std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    nn::embedding<double, mesh_t> tok(m, "tok", vocab, width, key, 0.5f);
    nn::tied_head<double, mesh_t> head(tok);
    CHECK(head.to_string() == "tok.attend (tied_head 4 -> 8, vocabulary sharded over 'model')");
    std::vector<nn::param_ref<double>> ps;
    tok.collect(ps);
    head.collect(ps);
    REQUIRE(ps.size() == 1);  // the table, once
    if (table.empty()) table = global_values(ps[0]);
    const auto in = meshlib::from_host(rows_t{m}, std::array<std::size_t, 2>{tokens, width}, x);
    std::vector<double> logits(tokens * vocab, -1.0);
    meshlib::spmd(m, [&](std::size_t dev) {
      const auto z = head.forward(in.local_value(dev));
      const std::size_t r0 = m.group_rank(dev, data_mask) * z.extent(0);
      const std::size_t c0 = m.group_rank(dev, mesh_t::mask_of<"model">()) * z.extent(1);
      for (std::size_t i = 0; i < z.extent(0); ++i)
        for (std::size_t j = 0; j < z.extent(1); ++j) logits[(r0 + i) * vocab + c0 + j] = z(i, j);
    });
    INFO("mesh " << m);
    for (std::size_t i = 0; i < tokens; ++i)
      for (std::size_t v = 0; v < vocab; ++v) {
        double want = 0;
        for (std::size_t k = 0; k < width; ++k) want += x[i * width + k] * table[v * width + k];
        REQUIRE(std::abs(logits[i * vocab + v] - want) < 1e-12);
      }
  }
  for (auto shape : fd_meshes) {
    const mesh_t m{shape[0], shape[1]};
    nn::embedding<double, mesh_t> tok(m, "tok", vocab, width, key, 0.5f);
    nn::tied_head<double, mesh_t> head(tok);
    // The network holds copies of both: they share the one table, whose gradient sums the lookup's
    // and the head's contributions.
    nn::sequential net(tok, nn::positional_embedding<double, mesh_t>(m, "pos", 5, width, seq, key, 0.5f),
                       nn::rms_norm<double, mesh_t>(m, "norm", width), head);
    const auto in = id_rows(m, ids_of(tokens, vocab));
    const auto input = [&](std::size_t dev) { return in.local_value(dev); };
    nn::check_gradients(m, net, loss_of<double>(m, net, input, labels_of(tokens)), fd_options);
  }
}

}  // namespace MESHLIB_TEST_UNIT
