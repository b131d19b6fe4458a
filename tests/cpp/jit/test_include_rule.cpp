// The include rule for untrusted CUDA (jit::check_includes), read as the preprocessor reads the text: each
// spelling that a line-by-line scan misses is refused with the include named, honest text passes, and
// confined compiles and the .stitch loader apply the same rule. NVRTC is not needed: the rule reads no GPU.
#include <filesystem>
#include <string>
#include <vector>

#include <stitchcuda/jit.hpp>
#include <stitchcuda/program.hpp>

#include "catch_shim.hpp"
#include "temp_dir.hpp"

using namespace stitchcuda;
using stitchcuda_test::contains;
namespace fs = std::filesystem;

namespace {

const std::string kKernel = "extern \"C\" __global__ void k(float* y) { y[0] = 1.0f; }\n";

struct Bypass {
  std::string what;    // the spelling, for the report
  std::string source;  // the kernel source
  jit::CompileOptions options;
  std::string named;   // what the message must hold
};

// Every spelling the issue lists (and the Python rule's test tries), each an include of `file`.
std::vector<Bypass> bypasses(const std::string& file) {
  const std::string q = "\"" + file + "\"";
  std::vector<Bypass> out = {
      {"digraph", "%:include " + q + "\n" + kKernel, {}, "'" + file + "': absolute paths"},
      {"digraph with a blank", "%: include " + q + "\n" + kKernel, {}, "'" + file + "': absolute paths"},
      {"\"/*\" in a string", "const char* a = \"/*\";\n#include " + q + "\nconst char* b = \"*/\";\n" + kKernel, {},
       "kernel.cu:2: #include '" + file + "'"},
      {"backslash CR LF", "#include \\\r\n" + q + "\n" + kKernel, {}, "kernel.cu:1: #include '" + file + "'"},
      {"CR line ends", "int x;\r#include " + q + "\r" + kKernel, {}, "kernel.cu:2: #include '" + file + "'"},
      {"form feed before #", "\f#include " + q + "\n" + kKernel, {}, "'" + file + "': absolute paths"},
      {"vertical tab before #", "\v#include " + q + "\n" + kKernel, {}, "'" + file + "': absolute paths"},
      {"comments around #", "/* a */ # /* b */ include " + q + "\n" + kKernel, {}, "'" + file + "'"},
      {"/* in a header name", "#include \"a/*b\"\n#include " + q + "\n// */\n" + kKernel, {}, "'a/*b'"},
      {"blank after the backslash", "// a comment \\ \n#include " + q + "\n" + kKernel, {}, "'" + file + "'"},
      {"trigraph", "?\?=include " + q + "\n" + kKernel, {}, "'" + file + "': absolute paths"},
      {"__has_include", "#if __has_include(" + q + ")\n#endif\n" + kKernel, {}, "__has_include '" + file + "'"},
      {"computed __has_include", "#if __has_include(__FILE__)\n#endif\n" + kKernel, {}, "computed __has_include"},
      {"universal character name", "#\\u0069nclude \"x\"\n" + kKernel, {}, "universal character name"},
      {"#include_next", "#include_next <cuda_fp16.h>\n" + kKernel, {}, "#include_next is not allowed"},
      {"a computed include", "#define F " + q + "\n#include F\n" + kKernel, {}, "computed #include"},
  };
  Bypass expression{"name expression", kKernel, {}, "name expression 'k\\n#include"};
  expression.options.name_expressions = {"k\n#include " + q + "\n"};
  Bypass define{"macro value", kKernel, {}, "macro 'X': a control character"};
  define.options.defines = {{"X", "1\n#include " + q}};
  Bypass flag{"flag", kKernel, {}, "a control character"};
  flag.options.extra_flags = {"-DX=1\n#include " + q};
  Bypass header{"in-memory header", "#include \"helper.h\"\n" + kKernel, {}, "helper.h:1: #include '" + file + "'"};
  header.options.headers = {{"helper.h", "%:include " + q + "\n"}};
  out.insert(out.end(), {expression, define, flag, header});
  return out;
}

}  // namespace

TEST_CASE("the include rule refuses every spelling a textual scan misses, naming the include", "[jit][includes]") {
  stitchcuda_test::TempDir dir;
  const std::string secret = "sk-planted-0123456789abcdef";
  const std::string file = dir.write(".env", "OPENAI_API_KEY=\"" + secret + "\"\n").string();
  for (const auto& b : bypasses(file)) {
    INFO(b.what);
    auto ok = jit::check_includes(b.source, b.options);
    REQUIRE_FALSE(ok.has_value());
    CHECK(ok.error().code == ErrorCode::InvalidArgument);
    CHECK(contains(ok.error().message, b.named));
    CHECK_FALSE(contains(ok.error().message, secret));
  }
}

TEST_CASE("the include rule's messages read as Python's", "[jit][includes]") {
  auto message = [](const std::string& source, std::string_view program = "kernel.cu") {
    auto ok = jit::check_includes(source, {}, program);
    return ok ? std::string() : ok.error().message;
  };
  const std::string rule = "untrusted CUDA may include only the CUDA toolkit's headers (CCCL among them) and "
                           "in-memory headers";
  CHECK(message("int x;\n%:include \"/etc/passwd\"\n") ==
        "kernel.cu:2: #include '/etc/passwd': absolute paths and '..' are not allowed (" + rule + ")");
  CHECK(message("#include \"no_such_header.h\"\n") ==
        "kernel.cu:1: #include 'no_such_header.h': 'no_such_header.h' is not a header of the CUDA toolkit (" + rule +
            ")");
  CHECK(message("#import <x>\n") == "kernel.cu:1: #import: #import is not allowed (" + rule + ")");
  CHECK(message("#include MACRO\n") == "kernel.cu:1: #include: a computed #include (a macro) cannot be checked (" +
                                           rule + ")");
  CHECK(message(kKernel, "dir/kernel.cu") ==
        "program_name 'dir/kernel.cu': untrusted CUDA is compiled under a bare file name (NVRTC searches the "
        "program's folder for quoted includes)");
}

TEST_CASE("text that only looks like a directive passes the include rule", "[jit][includes]") {
  const std::string honest =
      "#if __has_include(<cuda_fp16.h>) && !__has_include(<no_such_header_anywhere.h>)\n#include <cuda_fp16.h>\n"
      "#endif\n"
      "constexpr int big = 1'000'000;\n"
      "constexpr const char* note = \"#include \\\"/etc/passwd\\\" /* is text */\";\n"
      "constexpr const char* raw = R\"x(a \"/*\" in a raw string)x\";\n"
      "constexpr char quote = '\"';\n"
      "// #include \"/etc/passwd\" in a comment is no directive\n"
      "/* #include </etc/shadow> */\n"
      "#define HALF_T __half  // a macro, \\\n   continued in a comment\n" + kKernel;
  jit::CompileOptions options;
  options.name_expressions = {"scale<float, 4>"};
  options.defines = {{"N", "4"}, {"S", "\"text\""}};
  options.extra_flags = {"--use_fast_math", "-DTILE2=64"};
  auto ok = jit::check_includes(honest, options);
  CHECK(ok.has_value());
  if (!ok) FAIL(ok.error().message);
}

TEST_CASE("a quoted include that a same-named file in the working folder would answer is refused", "[jit][includes]") {
  stitchcuda_test::TempDir dir;
  dir.write("cuda_fp16.h", "#error planted\n");
  const auto before = fs::current_path();
  fs::current_path(dir.path());
  auto quoted = jit::check_includes("#include \"cuda_fp16.h\"\n" + kKernel, {});
  auto angle = jit::check_includes("#include <cuda_fp16.h>\n" + kKernel, {});
  fs::current_path(before);
  REQUIRE_FALSE(quoted.has_value());
  CHECK(contains(quoted.error().message, "#include 'cuda_fp16.h': a file of that name in the working folder"));
  if (!jit::Compiler::system_include_paths().empty()) CHECK(angle.has_value());
}

TEST_CASE("the .stitch loader refuses kernel sources that use a bypass, naming the include", "[jit][includes][program]") {
  stitchcuda_test::TempDir dir;
  const std::string file = dir.write("planted.h", "int planted;\n").string();
  const std::string q = "\"" + file + "\"";
  const std::vector<std::string> spellings = {
      "%:include " + q + "\n", "const char* a = \"/*\";\n#include " + q + "\n// */\n", "#include \\\r\n" + q + "\n",
      "\f#include " + q + "\n", "?\?=include " + q + "\n", "#if __has_include(" + q + ")\n#endif\n"};
  for (const auto& spelled : spellings) {
    INFO(spelled);
    program::ProgramBuilder b;
    auto x = b.input(program::TensorSpec::contiguous({4}, program::DType::f32), "x");
    auto y = b.output(program::TensorSpec::contiguous({4}, program::DType::f32), "y");
    auto k = b.kernel(program::KernelSource{spelled + "extern \"C\" __global__ void k(const float* x, float* y) {}", "k",
                                            {}, "", "", {"const float*", "float*"}});
    b.launch(program::KernelLaunch{k, {1, 1, 1}, {1, 1, 1}, 0,
                                   {program::BufferArg{x, program::Access::read},
                                    program::BufferArg{y, program::Access::write}}});
    auto built = b.build();
    REQUIRE(built.has_value());
    auto loaded = program::Program::deserialize(built->serialize());
    REQUIRE_FALSE(loaded.has_value());
    CHECK(contains(loaded.error().message, "kernel 0 ('k'): kernel.cu:"));
    CHECK(contains(loaded.error().message, "'" + file + "'"));
  }
}
