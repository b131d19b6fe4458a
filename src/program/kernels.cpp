// compile_kernels: fills a program's kernel table with CUBINs for one architecture, so an artifact
// loads on a serving machine of that architecture without NVRTC. Kernels compile concurrently (NVRTC
// and the kernel cache are thread-safe), one worker per hardware thread.
#include <stitchcuda/program.hpp>
#include <stitchcuda/jit.hpp>

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

namespace stitchcuda::program {
namespace {

// One kernel's CUBIN and signature, or why it has none.
Result<void> compile_one(KernelSource& ks, std::size_t i, const std::string& target) {
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
  return {};
}

}  // namespace

Result<void> compile_kernels(Program& program, const std::string& arch) {
  std::string target = arch;
  if (target.empty()) target = jit::Compiler::default_arch();
  std::vector<std::size_t> todo;
  for (std::size_t i = 0; i < program.kernels.size(); ++i) {
    const KernelSource& ks = program.kernels[i];
    if (ks.cubin.empty() || ks.arch != target || ks.signature.empty()) todo.push_back(i);
  }
  std::vector<std::optional<Error>> errors(todo.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t n; (n = next++) < todo.size();)
      if (auto r = compile_one(program.kernels[todo[n]], todo[n], target); !r) errors[n] = r.error();
  };
  std::size_t workers = std::min<std::size_t>(todo.size(), std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    work();
  } else {
    std::vector<std::thread> threads;
    threads.reserve(workers - 1);
    for (std::size_t t = 1; t < workers; ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
  }
  for (auto& e : errors)  // the first kernel at fault, as a serial compile would report it
    if (e) return tl::unexpected(std::move(*e));
  return {};
}

}  // namespace stitchcuda::program
