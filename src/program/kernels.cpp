// compile_kernels: fills a program's kernel table with CUBINs for one architecture, so an artifact
// loads on a serving machine of that architecture without NVRTC.
#include <stitchcuda/program.hpp>
#include <stitchcuda/jit.hpp>

namespace stitchcuda::program {

Result<void> compile_kernels(Program& program, const std::string& arch) {
  std::string target = arch;
  if (target.empty()) target = jit::Compiler::default_arch();
  for (std::size_t i = 0; i < program.kernels.size(); ++i) {
    KernelSource& ks = program.kernels[i];
    if (!ks.cubin.empty() && ks.arch == target && !ks.signature.empty()) continue;
    jit::CompileOptions options;
    options.arch = target;
    options.extra_flags = ks.options;
    options.confined = true;  // kernels may come from an LLM or a file: the include rule applies
    bool plain = !ks.name.empty() && ks.name.find_first_of("<>:(), ") == std::string::npos;
    if (!plain) options.name_expressions.push_back(ks.name);
    auto module = jit::build(ks.source, options, ks.name + ".cu");
    if (!module) {
      Error e = module.error();
      e.message = "kernel " + std::to_string(i) + " ('" + ks.name + "'): " + e.message;
      return tl::unexpected(std::move(e));
    }
    const jit::Binary& binary = (*module)->binary();
    if (binary.cubin.empty())
      return fail(ErrorCode::InvalidArgument, "kernel '" + ks.name + "': architecture '" + target +
                                                  "' yields PTX only; give a real architecture such as sm_90a");
    if (!binary.find_kernel(ks.name)) {
      std::string names;
      for (const auto& k : binary.kernels) names += " " + k.name;
      return fail(ErrorCode::NotFound, "kernel '" + ks.name + "' is not in its source (entry points:" + names + ")");
    }
    ks.cubin = binary.cubin;
    ks.arch = binary.arch;
    if (plain) ks.signature = jit::declared_signature(ks.source, ks.name);
  }
  return {};
}

}  // namespace stitchcuda::program
