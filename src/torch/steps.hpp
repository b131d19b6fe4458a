// The executor's step runners that need more than a kernel launch: cuBLASLt matmuls and ATen ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <memory>
#include <string>
#include <vector>

#include <stitchcuda/program.hpp>

namespace stitchcuda::torch::detail {

// The steps are the program layer's (Matmul, AtenOp, TensorSpec...).
using namespace stitchcuda::program;

/// The ATen element type of a program dtype.
inline c10::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::f32: return c10::kFloat;
    case DType::f16: return c10::kHalf;
    case DType::bf16: return c10::kBFloat16;
    case DType::f64: return c10::kDouble;
    case DType::i32: return c10::kInt;
    case DType::i64: return c10::kLong;
    case DType::u8: return c10::kByte;
    case DType::boolean: return c10::kBool;
  }
  return c10::kFloat;
}

// ---- cuBLASLt (libcublasLt.so.13, the one PyTorch loaded) ----

/// A matmul step with its descriptors and algorithm chosen once per instance.
class PreparedMatmul {
 public:
  /// Builds the descriptors for `m` on `device` and picks an algorithm with `workspace_bytes`.
  static Result<std::unique_ptr<PreparedMatmul>> create(const Matmul& m, const Program& program,
                                                        std::size_t workspace_bytes);
  /// Enqueues c = epilogue(alpha * op(a) @ op(b) + beta * c [+ bias]) on `stream`; a tf32x3 matmul
  /// splits its operands into `scratch` (scratch_bytes() of device memory, unused otherwise).
  Result<void> run(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor* bias,
                   void* workspace, std::size_t workspace_bytes, void* stream, void* scratch = nullptr) const;
  /// Device memory a run needs beside the workspace: the split operands of a tf32x3 matmul (0 otherwise).
  std::size_t scratch_bytes() const;
  /// The most cuBLASLt workspace any of its chosen algorithms uses (at most create()'s workspace_bytes).
  std::size_t workspace_needed() const;
  ~PreparedMatmul();
  PreparedMatmul(const PreparedMatmul&) = delete;
  PreparedMatmul& operator=(const PreparedMatmul&) = delete;

  struct Descriptors;

 private:
  PreparedMatmul() = default;
  std::unique_ptr<Descriptors> d_;
};

// ---- ATen ops through the dispatcher ----

/// An ATen op resolved in the dispatcher, with its non-tensor arguments converted once.
class BoundAtenOp {
 public:
  /// Resolves `op.op`, matches inputs and attributes to its schema; errors name the argument.
  static Result<BoundAtenOp> bind(const AtenOp& op, const Program& program);
  /// Calls the op on `inputs` and returns its tensor results, flattened.
  std::vector<at::Tensor> call(const std::vector<at::Tensor>& inputs) const;

 private:
  // One schema argument: a tensor from the inputs (or a list of them), or a fixed value.
  struct Slot {
    enum Kind { tensor, tensor_list, optional_tensor_list, optional_absent, value } kind = value;
    std::size_t first = 0, count = 0;  // inputs used by tensor / tensor_list / optional_tensor_list
    std::vector<bool> present;         // optional_tensor_list: per entry, whether it is the next input or absent
    c10::IValue constant;              // for value
  };
  std::shared_ptr<c10::OperatorHandle> handle_;
  std::vector<Slot> slots_;
};

}  // namespace stitchcuda::torch::detail
