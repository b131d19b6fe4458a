// Program IR and validation: dtypes and specs, op names, the graph IR, ProgramBuilder, and one
// test per validation rule checking that the error names the step, its kind and the problem.
#include <limits>
#include <string>

#include <stitchcuda/program.hpp>

#include "catch_shim.hpp"

using namespace stitchcuda;
using namespace stitchcuda::program;
using stitchcuda_test::contains;

namespace {

TensorSpec f32(std::vector<std::int64_t> shape) { return TensorSpec::contiguous(std::move(shape), DType::f32); }

// The error message of a program that must not validate.
std::string rejection(const Program& p) {
  auto ok = p.validate();
  REQUIRE_FALSE(ok.has_value());
  CHECK(ok.error().code == ErrorCode::InvalidArgument);
  INFO(ok.error().log);
  return ok.error().message;
}

KernelSource scale_kernel() {
  return KernelSource{"extern \"C\" __global__ void scale(const float* x, float* y, float s, int n) {}",
                      "scale", {}, {}, {}, {"const float*", "float*", "float", "int"}};
}

}  // namespace

TEST_CASE("dtypes have their sizes and names", "[program]") {
  CHECK(dtype_size(DType::f32) == 4);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK(dtype_size(DType::bf16) == 2);
  CHECK(dtype_size(DType::f64) == 8);
  CHECK(dtype_size(DType::i32) == 4);
  CHECK(dtype_size(DType::i64) == 8);
  CHECK(dtype_size(DType::u8) == 1);
  CHECK(dtype_size(DType::boolean) == 1);
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64, DType::u8, DType::boolean})
    CHECK(dtype_from_string(to_string(d)) == d);
  CHECK(std::string(to_string(DType::boolean)) == "bool");
  CHECK_FALSE(dtype_from_string("float32").has_value());
}

TEST_CASE("tensor specs default to row-major strides and count their storage", "[program]") {
  TensorSpec s = TensorSpec::contiguous({2, 3, 4}, DType::f16);
  CHECK(s.strides == std::vector<std::int64_t>{12, 4, 1});
  CHECK(s.numel() == 24);
  CHECK(s.storage_bytes() == 48);
  CHECK(s.is_contiguous());
  CHECK(s.describe() == "f16[2, 3, 4]");

  TensorSpec transposed{{4, 3}, {1, 4}, DType::f32};  // a [3, 4] tensor seen transposed
  CHECK_FALSE(transposed.is_contiguous());
  CHECK(transposed.storage_elements() == 12);
  CHECK(contains(transposed.describe(), "strides [1, 4]"));

  CHECK(TensorSpec::contiguous({}, DType::f64).storage_bytes() == 8);  // a scalar
  CHECK(TensorSpec::contiguous({0, 5}).storage_bytes() == 0);
}

TEST_CASE("op names are namespace::name with an optional overload", "[program]") {
  CHECK(is_well_formed_op_name("aten::add.Tensor"));
  CHECK(is_well_formed_op_name("aten::relu"));
  CHECK(is_well_formed_op_name("my_ns::op_2.out"));
  for (const char* bad : {"add", "aten::", "::add", "aten::add.", "aten:add", "aten::add.Tensor.x", "aten::2d",
                          "aten::add Tensor", ""})
    CHECK_FALSE(is_well_formed_op_name(bad));
}

TEST_CASE("the graph IR keeps nodes in order and rejects forward references", "[program]") {
  Graph g;
  ValueId x = g.add_input(f32({4, 8}));
  ValueId w = g.add_constant(f32({8}), std::string(32, '\0'));
  ValueId y = g.add_node("aten::mul.Tensor", {x, w}, {}, f32({4, 8}));
  ValueId z = g.add_node("aten::sum.dim_IntList", {y}, {{"dim", std::vector<std::int64_t>{1}}, {"keepdim", false}},
                         f32({4}));
  g.mark_output(z);
  REQUIRE(g.validate().has_value());
  CHECK(g.nodes().size() == 2);
  CHECK(g.values()[z].kind == Graph::ValueKind::node);
  CHECK(*g.values()[z].node == 1);
  CHECK(std::get<bool>(g.nodes()[1].attributes.at("keepdim")) == false);

  SECTION("an input defined after the node") {
    Graph bad;
    ValueId a = bad.add_input(f32({2}));
    bad.add_node("aten::neg", {a + 1}, {}, f32({2}));
    bad.add_input(f32({2}));
    auto r = bad.validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().message, "node 0 (aten::neg)"));
    CHECK(contains(r.error().message, "not defined before"));
  }
  SECTION("a malformed op name") {
    Graph bad;
    bad.add_node("relu", {}, {}, f32({2}));
    auto r = bad.validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().message, "malformed op name"));
  }
  SECTION("a constant whose bytes do not fit its spec") {
    Graph bad;
    bad.add_constant(f32({3}), "abc");
    auto r = bad.validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().message, "holds 3 bytes"));
  }
}

TEST_CASE("a program with every step kind builds and validates", "[program]") {
  ProgramBuilder b;
  BufferId x = b.input(f32({8, 16}), "x");
  BufferId w = b.weight(f32({16, 32}), std::string(16 * 32 * 4, '\1'), "w");
  BufferId bias = b.weight(f32({32}), {}, "bias");
  BufferId h = b.intermediate(f32({8, 32}), "h");
  BufferId s = b.intermediate(f32({8, 32}), "s");
  BufferId y = b.output(f32({256}), "y");
  std::uint32_t k = b.kernel(scale_kernel());
  b.matmul(Matmul{x, w, h, bias, false, false, 1, 1.0, 0.0, Epilogue::bias_gelu, ComputePrecision::fp32});
  b.launch(KernelLaunch{k, {1, 1, 1}, {256, 1, 1}, 0, {BufferArg{h, Access::read}, BufferArg{s, Access::write}, 0.5f, 256}});
  BufferId flat = b.view(ViewKind::reshape, s, f32({256}));
  b.aten("aten::relu.out", {flat}, {y}, {});
  auto built = b.build();
  if (!built) FAIL(built.error().describe());
  const Program& p = *built;
  CHECK(p.buffers.size() == 7);
  CHECK(p.steps.size() == 4);
  CHECK(std::string(step_kind(p.steps[0])) == "matmul");
  CHECK(std::string(step_kind(p.steps[1])) == "kernel");
  CHECK(std::string(step_kind(p.steps[2])) == "view");
  CHECK(std::string(step_kind(p.steps[3])) == "aten");
  CHECK(p.buffer(flat)->role == BufferRole::intermediate);
  CHECK(p.buffer(y)->name == "y");
  CHECK(p.weights.count(w) == 1);
  CHECK(p.weights.count(bias) == 0);  // bound later
  CHECK(p.buffer(999) == nullptr);
  CHECK(b.peek().steps.empty());  // build() hands the program over
}

TEST_CASE("validation names the step and the problem", "[program]") {
  ProgramBuilder b;
  BufferId x = b.input(f32({4, 8}), "x");
  BufferId w = b.weight(f32({8, 16}), {}, "w");
  BufferId h = b.intermediate(f32({4, 16}), "h");
  BufferId y = b.output(f32({4, 16}), "y");

  SECTION("a dangling buffer id") {
    b.aten("aten::relu", {h + 100}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (aten)"));
    CHECK(contains(msg, "buffer #102 does not exist"));
  }
  SECTION("a buffer read before any step writes it") {
    b.aten("aten::relu", {h}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (aten)"));
    CHECK(contains(msg, "reads intermediate buffer 'h' (#2) before any step writes it"));
  }
  SECTION("matmul inner dimensions differ") {
    BufferId w2 = b.weight(f32({9, 16}), {}, "w2");
    b.matmul(Matmul{x, w2, h});
    b.aten("aten::relu", {h}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (matmul)"));
    CHECK(contains(msg, "inner dimensions differ"));
    CHECK(contains(msg, "k = 8"));
    CHECK(contains(msg, "k = 9"));
  }
  SECTION("a transposed operand is checked as transposed") {
    BufferId wt = b.weight(f32({16, 8}), {}, "wt");
    b.matmul(Matmul{x, wt, h, std::nullopt, false, true});
    b.aten("aten::relu", {h}, {y});
    CHECK(b.peek().validate().has_value());
  }
  SECTION("matmul result of the wrong shape") {
    BufferId small = b.intermediate(f32({4, 15}));
    b.matmul(Matmul{x, w, small});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (matmul)"));
    CHECK(contains(msg, "the product is [4, 16]"));
  }
  SECTION("a bias epilogue without a bias, and a precision the policy forbids") {
    Matmul m{x, w, h};
    m.epilogue = Epilogue::bias_relu;
    m.precision = ComputePrecision::tf32;
    b.matmul(m);
    b.aten("aten::relu", {h}, {y});
    auto r = b.peek().validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().log, "epilogue 'bias_relu' needs a bias buffer"));
    CHECK(contains(r.error().log, "computes in tf32 but the program's precision policy allows at most fp32"));
    CHECK(contains(r.error().message, "1 more problems"));
    b.precision(PrecisionPolicy{ComputePrecision::bf16, true});
    CHECK(contains(b.peek().validate().error().log, "needs a bias buffer"));
    CHECK_FALSE(contains(b.peek().validate().error().log, "precision policy"));
  }
  SECTION("tf32x3 sits between fp32 and tf32 in the policy, and takes f32 operands only") {
    Matmul m{x, w, h};
    m.precision = ComputePrecision::tf32x3;
    b.matmul(m);
    b.aten("aten::relu", {h}, {y});
    CHECK(contains(rejection(b.peek()), "computes in tf32x3 but the program's precision policy allows at most fp32"));
    b.precision(PrecisionPolicy{ComputePrecision::tf32x3, true});
    CHECK(b.peek().validate().has_value());
    b.precision(PrecisionPolicy{ComputePrecision::tf32, true});
    CHECK(b.peek().validate().has_value());  // a lossier policy allows it too
  }
  SECTION("tf32x3 on half-precision operands names the fix") {
    ProgramBuilder hb;
    BufferId hx = hb.input(TensorSpec::contiguous({4, 8}, DType::f16), "x");
    BufferId hw = hb.weight(TensorSpec::contiguous({8, 16}, DType::f16), {}, "w");
    BufferId hy = hb.output(TensorSpec::contiguous({4, 16}, DType::f16), "y");
    Matmul m{hx, hw, hy};
    m.precision = ComputePrecision::tf32x3;
    hb.matmul(m);
    hb.precision(PrecisionPolicy{ComputePrecision::tf32x3, true});
    auto msg = rejection(hb.peek());
    CHECK(contains(msg, "tf32x3 splits fp32 operands into TF32 parts: a, b and c must be f32"));
    CHECK(contains(msg, "use fp32, or tf32/bf16 for other dtypes"));
  }
  SECTION("a reshape that changes the element count") {
    b.matmul(Matmul{x, w, h});
    b.view(ViewKind::reshape, h, f32({65}));
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 1 (view)"));
    CHECK(contains(msg, "changes the element count"));
  }
  SECTION("a slice outside its source") {
    b.matmul(Matmul{x, w, h});
    b.view(ViewKind::slice, h, f32({16}), 56);
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 1 (view)"));
    CHECK(contains(msg, "spans elements [56, 72) but its source has 64"));
  }
  SECTION("a kernel bound to fewer arguments than it declares") {
    std::uint32_t k = b.kernel(scale_kernel());
    b.launch(KernelLaunch{k, {1, 1, 1}, {64, 1, 1}, 0, {BufferArg{x}, BufferArg{y, Access::write}, 2.0f}});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (kernel)"));
    CHECK(contains(msg, "declares 4 parameters but 3 arguments are bound"));
  }
  SECTION("kernel arguments of the wrong kind or dtype") {
    BufferId xi = b.input(TensorSpec::contiguous({4, 8}, DType::i32), "xi");
    std::uint32_t k = b.kernel(scale_kernel());
    b.launch(KernelLaunch{k, {1, 1, 1}, {64, 1, 1}, 0, {BufferArg{xi}, BufferArg{y, Access::write}, 2.0, 3}});
    auto r = b.peek().validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().log, "points to f32 but 'xi' (#4) is i32"));
    CHECK(contains(r.error().log, "wants f32 but is bound to f64"));
  }
  SECTION("a kernel writing through a const pointer") {
    std::uint32_t k = b.kernel(scale_kernel());
    b.launch(KernelLaunch{k, {1, 1, 1}, {64, 1, 1}, 0, {BufferArg{y, Access::write}, BufferArg{h, Access::write}, 2.0f, 3}});
    CHECK(contains(rejection(b.peek()), "is const but the step says the kernel writes"));
  }
  SECTION("a kernel index outside the table") {
    b.launch(KernelLaunch{7, {1, 1, 1}, {1, 1, 1}, 0, {BufferArg{y, Access::write}}});
    CHECK(contains(rejection(b.peek()), "kernel index 7 is outside the kernel table"));
  }
  SECTION("a step writing a buffer it also reads through a view") {
    b.matmul(Matmul{x, w, h});
    BufferId hv = b.view(ViewKind::reshape, h, f32({64}));
    b.aten("aten::neg.out", {hv}, {h});
    b.aten("aten::relu", {h}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 2 (aten)"));
    CHECK(contains(msg, "shares its storage"));
  }
  SECTION("two outputs of one step aliasing") {
    b.matmul(Matmul{x, w, h});
    BufferId first = b.view(ViewKind::slice, h, f32({32}), 0);
    BufferId second = b.view(ViewKind::slice, h, f32({32}), 16);  // overlaps first's upper half
    b.aten("aten::split_copy.Tensor", {x}, {first, second});
    b.aten("aten::relu", {h}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 3 (aten)"));
    CHECK(contains(msg, "two outputs alias"));
  }
  SECTION("disjoint slices of one buffer may be written by one step") {
    b.matmul(Matmul{x, w, h});
    BufferId low = b.view(ViewKind::slice, h, f32({32}), 0);
    BufferId high = b.view(ViewKind::slice, h, f32({32}), 32);
    b.aten("aten::split_copy.Tensor", {x}, {low, high});
    b.aten("aten::neg.out", {low}, {high});  // reads one half, writes the other
    b.aten("aten::relu", {h}, {y});
    auto ok = b.peek().validate();
    if (!ok) FAIL(ok.error().describe());
  }
  SECTION("an output never written") {
    b.matmul(Matmul{x, w, h});
    CHECK(contains(rejection(b.peek()), "output buffer 'y' (#3) is never written"));
  }
  SECTION("a malformed op name") {
    b.aten("relu", {x}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (aten)"));
    CHECK(contains(msg, "malformed op name \"relu\""));
  }
  SECTION("a step writing an input") {
    b.aten("aten::relu_", {x}, {x});
    b.aten("aten::relu", {x}, {y});
    auto msg = rejection(b.peek());
    CHECK(contains(msg, "step 0 (aten)"));
    CHECK(contains(msg, "inputs and weights are read-only"));
  }
  SECTION("weight bytes that do not fit the spec") {
    BufferId small = b.weight(f32({2}), "abc", "small");
    (void)small;
    b.matmul(Matmul{x, w, y});
    CHECK(contains(rejection(b.peek()), "weight buffer 'small' (#4) holds 3 bytes but f32[2] needs 8"));
  }
  SECTION("negative or absurd extents stop validation before any arithmetic") {
    BufferId huge = b.intermediate(TensorSpec::contiguous({std::int64_t(1) << 41, 4}), "huge");
    BufferId negative = b.intermediate(TensorSpec{{-2}, {1}, DType::f32}, "negative");
    BufferId ragged = b.intermediate(TensorSpec{{2, 3}, {1}, DType::f32}, "ragged");
    b.matmul(Matmul{x, w, huge});
    b.aten("aten::relu", {negative}, {ragged});
    auto r = b.peek().validate();
    REQUIRE_FALSE(r.has_value());
    CHECK(contains(r.error().log, "'huge' (#4): shape [2199023255552, 4]"));
    CHECK(contains(r.error().log, "'negative' (#5)"));
    CHECK(contains(r.error().log, "'ragged' (#6): shape [2, 3] and strides [1] have different ranks"));
    CHECK_FALSE(contains(r.error().log, "step 0"));
  }
  SECTION("a view offset far outside its source") {
    b.matmul(Matmul{x, w, h});
    b.view(ViewKind::slice, h, f32({16}), std::numeric_limits<std::int64_t>::max() - 3);
    CHECK(contains(rejection(b.peek()), "step 1 (view): the view spans elements"));
  }
  SECTION("two buffers sharing an id") {
    Program p = b.peek();
    p.buffers.push_back(p.buffers.front());
    CHECK(contains(rejection(p), "buffer id 0 is used by two buffers"));
  }
  SECTION("build() reports the same error as validate()") {
    b.aten("aten::relu", {h}, {y});
    auto built = b.build();
    REQUIRE_FALSE(built.has_value());
    CHECK(contains(built.error().message, "step 0 (aten)"));
  }
}

TEST_CASE("batched matmuls check the batch count and broadcast", "[program]") {
  ProgramBuilder b;
  BufferId a = b.input(f32({3, 4, 8}));
  BufferId w = b.weight(f32({8, 5}));
  BufferId c = b.output(f32({3, 4, 5}));
  Matmul m{a, w, c};
  m.batch = 3;
  b.matmul(m);
  CHECK(b.peek().validate().has_value());  // b broadcasts over the batch

  Program wrong = b.peek();
  std::get<Matmul>(wrong.steps[0]).batch = 2;
  CHECK(contains(rejection(wrong), "batch count is 2 but c's leading dimensions hold 3"));
}
