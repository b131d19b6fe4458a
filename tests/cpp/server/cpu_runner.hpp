// A Runner that computes a tiny stitched program on the CPU: y = x @ w^T + bias (its one Matmul step),
// reading w and bias from the program's own weights, at whatever batch it is handed (a family's too).
// The server's tests run the real batcher and HTTP front on it where no GPU is present.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <stitchcuda/family.hpp>
#include <stitchcuda/program.hpp>

#include "batcher.hpp"

namespace stitchcuda_test {

namespace program = stitchcuda::program;

/// x f32[batch, k] -> y f32[batch, n] = x @ w^T + bias, with seeded weights.
inline program::Program linear_program(int batch, int k, int n) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto bytes = [&](std::size_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = u(rng);
    return std::string(reinterpret_cast<const char*>(v.data()), count * sizeof(float));
  };
  using program::TensorSpec;
  program::ProgramBuilder b;
  auto x = b.input(TensorSpec::contiguous({batch, k}), "x");
  auto w = b.weight(TensorSpec::contiguous({n, k}), bytes(std::size_t(n * k)), "w");
  auto bias = b.weight(TensorSpec::contiguous({n}), bytes(std::size_t(n)), "bias");
  auto y = b.output(TensorSpec::contiguous({batch, n}), "y");
  b.matmul({.a = x, .b = w, .c = y, .bias = bias, .transpose_b = true, .epilogue = program::Epilogue::bias});
  auto built = b.build();
  if (!built) throw std::runtime_error(built.error().describe());
  return std::move(*built);
}

/// linear_program at each of `batches`, as a family whose batch dim (dim 0 of x and y) ranges 1..max.
inline program::ProgramFamily linear_family(const std::vector<int>& batches, int k, int n, bool pad) {
  program::ProgramFamily f;
  f.dims.push_back({"batch", 1, *std::max_element(batches.begin(), batches.end()), pad, {{0, 0}}, {{0, 0}}});
  for (int b : batches) f.members.push_back({{b}, linear_program(b, k, n)});
  return f;
}

/// Runs linear_program's one matmul on the CPU, counting its calls.
class CpuLinearRunner : public stitchcuda_server::Runner {
 public:
  explicit CpuLinearRunner(const program::Program& p) {
    const auto& mm = std::get<program::Matmul>(p.steps.at(0));
    auto floats = [&](program::BufferId id) {
      const auto& bytes = p.weights.at(id);
      std::vector<float> v(bytes.size() / sizeof(float));
      std::memcpy(v.data(), bytes.data(), bytes.size());
      return v;
    };
    w_ = floats(mm.b);
    bias_ = floats(*mm.bias);
    n_ = int(bias_.size());
    k_ = int(w_.size()) / n_;
  }
  /// One row of y for one row of x, as the server must answer it.
  std::vector<float> row(const float* x) const {
    std::vector<float> y(static_cast<std::size_t>(n_));
    for (int j = 0; j < n_; ++j) {
      float s = 0;
      for (int i = 0; i < k_; ++i) s += x[i] * w_[std::size_t(j * k_ + i)];
      y[std::size_t(j)] = s + bias_[std::size_t(j)];
    }
    return y;
  }
  std::string run(int, const std::vector<std::string>& inputs, std::vector<std::string>& outputs) override {
    calls++;
    const auto rows = inputs[0].size() / sizeof(float) / std::size_t(k_);
    std::string out;
    for (std::size_t r = 0; r < rows; ++r) {
      auto y = row(reinterpret_cast<const float*>(inputs[0].data()) + r * std::size_t(k_));
      out.append(reinterpret_cast<const char*>(y.data()), y.size() * sizeof(float));
    }
    outputs[0] = std::move(out);
    return {};
  }
  std::atomic<int> calls{0};

 private:
  std::vector<float> w_, bias_;
  int n_ = 0, k_ = 0;
};

}  // namespace stitchcuda_test
