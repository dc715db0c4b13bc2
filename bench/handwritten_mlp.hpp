// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The hand-written peer of the training benchmark (issue 8): a plain single-process C++ trainer of
// the flagship's model, an MLP inputs-hidden-hidden-classes with ReLU and softmax cross-entropy,
// trained by Adam or SGD with momentum under the flagship's learning-rate schedule (linear warm-up,
// cosine decay), written directly on cblas_sgemm the way a careful engineer would without meshlib.
// No meshlib here: bench/handwritten_mlp_main.cpp trains it on Fashion-MNIST, and a training
// benchmark can time its step next to meshlib's (construct an mlp, call step()).
//
// Careful means: every product is one sgemm on row-major batches; bias gradients are sgemv with a
// vector of ones; for SGD the momentum update is folded into the gradient sgemm (V = momentum V +
// A^T dZ through beta) and the weight update is one saxpy; each element-wise pass (bias + ReLU,
// the ReLU mask, Adam's update) is one loop over contiguous memory. Those loops run on the calling
// thread by default: splitting them over a second std::thread measured slower here (3 runs each
// way on the shared 2-core machine: the step took 73-74% of its sgemm time's rate with a helper
// thread, 79-93% without), as OpenBLAS's idle worker holds the other core; `threads` changes it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <cblas.h>

namespace handwritten {

enum class optimizer { sgd, adam };

struct mlp_config {
  std::size_t inputs = 784;
  std::size_t hidden = 1024;
  std::size_t classes = 10;
  std::size_t batch = 256;  ///< the largest number of rows a step or an evaluation gets
  optimizer method = optimizer::adam;
  float learning_rate = 1e-3f;  ///< peak of the schedule
  std::size_t warmup = 0;       ///< steps of linear warm-up (lr * (t+1) / warmup)
  std::size_t total = 0;        ///< cosine decay to lr * final_fraction at step `total`; 0: constant
  float final_fraction = 0.0f;
  float momentum = 0.9f;  ///< SGD
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  ///< Adam (eps outside the square root, as optax)
  int threads = 1;        ///< threads of the element-wise passes (BLAS's are set by the caller)
  std::uint64_t seed = 0;
};

/// The learning rate of step t (0-based): the flagship's warm-up + cosine schedule.
inline float scheduled_rate(const mlp_config& c, std::size_t t) {
  if (t < c.warmup) return c.learning_rate * static_cast<float>(t + 1) / static_cast<float>(c.warmup);
  if (c.total == 0) return c.learning_rate;
  if (t >= c.total) return c.learning_rate * c.final_fraction;
  const double x = static_cast<double>(t - c.warmup) /
                   static_cast<double>(c.total > c.warmup ? c.total - c.warmup : 1);
  const double cosine = 0.5 * (1.0 + std::cos(3.141592653589793 * x));
  return static_cast<float>(c.learning_rate * (c.final_fraction + (1.0 - c.final_fraction) * cosine));
}

/// MLP inputs -> hidden -> hidden -> classes, ReLU between, on the mean cross-entropy of a batch.
/// Weights and biases start uniform in +-1/sqrt(fan_in) (PyTorch's nn.Linear default).
class mlp {
 public:
  explicit mlp(const mlp_config& c) : c_(c) {
    const std::size_t sizes[3][2] = {{c.inputs, c.hidden}, {c.hidden, c.hidden}, {c.hidden, c.classes}};
    std::uint64_t state = c.seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
    for (int l = 0; l < 3; ++l) {
      layer& L = layers_[l];
      L.in = sizes[l][0];
      L.out = sizes[l][1];
      const float bound = 1.0f / std::sqrt(static_cast<float>(L.in));
      for (auto* v : {&L.w, &L.b}) {
        v->resize(v == &L.w ? L.in * L.out : L.out);
        for (auto& e : *v) {
          state = state * 6364136223846793005ull + 1442695040888963407ull;  // PCG's LCG step
          const float u = static_cast<float>(state >> 40) / static_cast<float>(1ull << 24);
          e = (2.0f * u - 1.0f) * bound;
        }
      }
      for (auto* v : {&L.gw, &L.mw, &L.vw}) v->assign(L.w.size(), 0.0f);
      for (auto* v : {&L.gb, &L.mb, &L.vb}) v->assign(L.b.size(), 0.0f);
    }
    a1_.resize(c.batch * c.hidden);
    a2_.resize(c.batch * c.hidden);
    scratch_.resize(c.batch * c.hidden);
    logits_.resize(c.batch * c.classes);
    ones_.assign(c.batch, 1.0f);
  }

  [[nodiscard]] const mlp_config& config() const { return c_; }
  [[nodiscard]] std::size_t steps_taken() const { return t_; }

  /// Floating-point operations of one training step on `rows` rows (the sgemms; the element-wise
  /// work is O(rows * hidden) and not counted): forward 2*rows*(in*h + h*h + h*k), backward the
  /// weight gradients of all three layers and the input gradients of layers 2 and 3.
  [[nodiscard]] double step_flops(std::size_t rows) const {
    const double in = static_cast<double>(c_.inputs), h = static_cast<double>(c_.hidden),
                 k = static_cast<double>(c_.classes), n = static_cast<double>(rows);
    return 2.0 * n * (in * h + h * h + h * k) + 2.0 * n * (in * h + 2.0 * h * h + 2.0 * h * k);
  }

  /// One optimizer step on rows of x (rows x inputs, row-major) with labels y; returns the mean
  /// loss of the batch before the step.
  float step(const float* x, const std::int32_t* y, std::size_t rows) {
    forward(x, rows);
    const float loss = softmax_cross_entropy_grad(y, rows);  // logits_ becomes dLoss/dlogits
    const int n = static_cast<int>(rows);
    // Layer 3, then 2 (a2_ becomes dZ2), then 1 (a1_ becomes dZ1; no input gradient).
    weight_gradients(layers_[2], a2_.data(), logits_.data(), n);
    relu_backward(logits_.data(), layers_[2], a2_.data(), n);
    weight_gradients(layers_[1], a1_.data(), a2_.data(), n);
    relu_backward(a2_.data(), layers_[1], a1_.data(), n);
    weight_gradients(layers_[0], x, a1_.data(), n);
    const float lr = scheduled_rate(c_, t_++);
    for (layer& L : layers_) update(L, lr);
    return loss;
  }

  /// Correct predictions (arg-max of the logits) on rows of x with labels y; any number of rows.
  [[nodiscard]] std::size_t correct(const float* x, const std::int32_t* y, std::size_t rows) {
    std::size_t right = 0;
    for (std::size_t start = 0; start < rows; start += c_.batch) {
      const std::size_t n = std::min(c_.batch, rows - start);
      forward(x + start * c_.inputs, n);
      for (std::size_t r = 0; r < n; ++r) {
        const float* row = logits_.data() + r * c_.classes;
        const auto best = static_cast<std::int32_t>(std::max_element(row, row + c_.classes) - row);
        right += best == y[start + r];
      }
    }
    return right;
  }

  /// Seconds of the sgemm calls of one step alone (the same shapes, transposes and leading
  /// dimensions, in the same order, on scratch copies), best of `reps`: the BLAS floor of a step.
  [[nodiscard]] double sgemm_only_seconds(const float* x, std::size_t rows, int reps) {
    const int n = static_cast<int>(rows), in = static_cast<int>(c_.inputs),
              h = static_cast<int>(c_.hidden), k = static_cast<int>(c_.classes);
    const auto &w1 = layers_[0].w, &w2 = layers_[1].w, &w3 = layers_[2].w;
    std::vector<float> g1(w1.size()), g2(w2.size()), g3(w3.size()), d2(a2_.size()), d1(a1_.size());
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, in, 1.0f, x, in, w1.data(), h, 0.0f, a1_.data(), h);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, h, 1.0f, a1_.data(), h, w2.data(), h, 0.0f, a2_.data(), h);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, k, h, 1.0f, a2_.data(), h, w3.data(), k, 0.0f, logits_.data(), k);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, k, n, 1.0f, a2_.data(), h, logits_.data(), k, 0.0f, g3.data(), k);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, h, k, 1.0f, logits_.data(), k, w3.data(), k, 0.0f, d2.data(), h);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, h, h, n, 1.0f, a1_.data(), h, d2.data(), h, 0.0f, g2.data(), h);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, h, h, 1.0f, d2.data(), h, w2.data(), h, 0.0f, d1.data(), h);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, h, n, 1.0f, x, in, d1.data(), h, 0.0f, g1.data(), h);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  }

 private:
  struct layer {
    std::size_t in = 0, out = 0;
    std::vector<float> w, b;    // in x out row-major, out
    std::vector<float> gw, gb;  // gradients (Adam)
    std::vector<float> mw, mb;  // SGD: velocity; Adam: first moment
    std::vector<float> vw, vb;  // Adam: second moment
  };

  /// f(begin, end) over [0, n) in c_.threads contiguous parts, the caller taking the last; less
  /// than 32 Ki elements of `work` run on the caller alone (a thread start costs ~20 us).
  template <class F>
  void parallel_ranges(std::size_t n, std::size_t work, F f) const {
    const std::size_t parts = work < (std::size_t{1} << 15) ? 1 : static_cast<std::size_t>(std::max(1, c_.threads));
    std::vector<std::thread> helpers;
    for (std::size_t p = 0; p + 1 < parts; ++p) helpers.emplace_back(f, p * n / parts, (p + 1) * n / parts);
    f((parts - 1) * n / parts, n);
    for (auto& t : helpers) t.join();
  }

  /// a1 = relu(x W1 + b1), a2 = relu(a1 W2 + b2), logits = a2 W3 + b3.
  void forward(const float* x, std::size_t rows) {
    dense(layers_[0], x, a1_.data(), rows, true);
    dense(layers_[1], a1_.data(), a2_.data(), rows, true);
    dense(layers_[2], a2_.data(), logits_.data(), rows, false);
  }

  void dense(const layer& L, const float* in, float* out, std::size_t rows, bool relu) const {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(L.out),
                static_cast<int>(L.in), 1.0f, in, static_cast<int>(L.in), L.w.data(), static_cast<int>(L.out),
                0.0f, out, static_cast<int>(L.out));
    const float* bias = L.b.data();
    const std::size_t cols = L.out;
    parallel_ranges(rows, rows * cols, [=](std::size_t begin, std::size_t end) {
      for (std::size_t r = begin; r < end; ++r) {
        float* row = out + r * cols;
        if (relu) {
          for (std::size_t j = 0; j < cols; ++j) row[j] = std::max(row[j] + bias[j], 0.0f);
        } else {
          for (std::size_t j = 0; j < cols; ++j) row[j] += bias[j];
        }
      }
    });
  }

  /// Turns logits_ into dLoss/dlogits = (softmax - onehot) / rows; returns the mean loss.
  float softmax_cross_entropy_grad(const std::int32_t* y, std::size_t rows) {
    double loss = 0;
    const float inv = 1.0f / static_cast<float>(rows);
    for (std::size_t r = 0; r < rows; ++r) {
      float* row = logits_.data() + r * c_.classes;
      const float top = *std::max_element(row, row + c_.classes);
      float sum = 0;
      for (std::size_t j = 0; j < c_.classes; ++j) sum += (row[j] = std::exp(row[j] - top));
      const auto label = static_cast<std::size_t>(y[r]);
      loss -= std::log(row[label] / sum);
      for (std::size_t j = 0; j < c_.classes; ++j) row[j] = row[j] / sum * inv;
      row[label] -= inv;
    }
    return static_cast<float>(loss / static_cast<double>(rows));
  }

  /// dW = A^T dZ and db = colsum(dZ), into the gradient (Adam) or, folded, into the velocity
  /// (SGD: V = momentum V + dW).
  void weight_gradients(layer& L, const float* a, const float* dz, int rows) {
    const bool sgd = c_.method == optimizer::sgd;
    const float beta = sgd ? c_.momentum : 0.0f;
    float* gw = sgd ? L.mw.data() : L.gw.data();
    float* gb = sgd ? L.mb.data() : L.gb.data();
    const int in = static_cast<int>(L.in), out = static_cast<int>(L.out);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, in, out, rows, 1.0f, a, in, dz, out, beta, gw, out);
    cblas_sgemv(CblasRowMajor, CblasTrans, rows, out, 1.0f, dz, out, ones_.data(), 1, beta, gb, 1);
  }

  /// dA = dZ_next W^T, then in place over the activations a: dZ = dA where a > 0, else 0.
  void relu_backward(const float* dz_next, const layer& next, float* a, int rows) {
    const int h = static_cast<int>(next.in), k = static_cast<int>(next.out);
    float* da = scratch_.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, h, k, 1.0f, dz_next, k, next.w.data(), k,
                0.0f, da, h);
    const std::size_t n = static_cast<std::size_t>(rows) * next.in;
    parallel_ranges(n, n, [=](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) a[i] = a[i] > 0.0f ? da[i] : 0.0f;
    });
  }

  void update(layer& L, float lr) {
    if (c_.method == optimizer::sgd) {  // w -= lr * v (v already holds momentum v + g)
      cblas_saxpy(static_cast<int>(L.w.size()), -lr, L.mw.data(), 1, L.w.data(), 1);
      cblas_saxpy(static_cast<int>(L.b.size()), -lr, L.mb.data(), 1, L.b.data(), 1);
      return;
    }
    const float b1 = c_.beta1, b2 = c_.beta2, eps = c_.eps;
    const auto t = static_cast<double>(t_);  // already incremented: 1 at the first step
    const float step = static_cast<float>(lr / (1.0 - std::pow(static_cast<double>(b1), t)));
    const float v_scale = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
    auto adam = [=, this](float* w, const float* g, float* m, float* v, std::size_t n) {
      parallel_ranges(n, n, [=](std::size_t begin, std::size_t end) {
        for (std::size_t i = begin; i < end; ++i) {
          m[i] = b1 * m[i] + (1.0f - b1) * g[i];
          v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
          w[i] -= step * m[i] / (std::sqrt(v[i] * v_scale) + eps);
        }
      });
    };
    adam(L.w.data(), L.gw.data(), L.mw.data(), L.vw.data(), L.w.size());
    adam(L.b.data(), L.gb.data(), L.mb.data(), L.vb.data(), L.b.size());
  }

  mlp_config c_;
  layer layers_[3];
  std::size_t t_ = 0;
  std::vector<float> a1_, a2_, scratch_, logits_, ones_;
};

}  // namespace handwritten
