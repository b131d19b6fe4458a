// NVRTC front end: validates options, compiles, maps diagnostics to the caller's lines,
// and reads the kernels' parameters back from the PTX so launches can be checked without a GPU.
#include <stitchcuda/jit.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>

#include <stitchcuda/detail/dynamic_library.hpp>
#include <stitchcuda/detail/sha256.hpp>
#include <stitchcuda/detail/cuda_driver.hpp>
#include "link.hpp"
#include "nvrtc.hpp"
#include "ptx.hpp"

namespace stitchcuda::jit {
namespace fs = std::filesystem;
namespace {

struct ProgramGuard {
  const detail::NvrtcApi* api;
  nvrtcProgram prog = nullptr;
  ~ProgramGuard() {
    if (prog) api->DestroyProgram(&prog);
  }
};

std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  std::string cur;
  for (char c : text) {
    if (c == '\n') {
      lines.push_back(cur);
      cur.clear();
    } else if (c != '\r') {
      cur += c;
    }
  }
  if (!cur.empty()) lines.push_back(cur);
  return lines;
}

bool is_identifier(std::string_view s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// NVRTC prints "file(LINE): severity[ #NNN-D]: message", then the line indented by two spaces and a caret.
std::vector<Diagnostic> parse_diagnostics(std::string_view log, std::string_view program_name, std::string_view source) {
  static const std::regex head(R"(^(.+)\((\d+)\): (catastrophic error|error|warning|remark)( #[0-9]+-D)?: (.*)$)");
  const auto source_lines = split_lines(source);
  const auto lines = split_lines(log);
  std::vector<Diagnostic> out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    if (!std::regex_match(lines[i], m, head)) continue;
    Diagnostic d;
    d.file = m[1];
    d.line = std::stoi(m[2]);
    d.severity = m[3] == "catastrophic error" ? "error" : std::string(m[3]);
    d.message = m[5];
    // Messages can continue on following lines until the excerpt.
    if (i + 2 < lines.size()) {
      const std::string& caret = lines[i + 2];
      auto pos = caret.find('^');
      if (pos != std::string::npos && caret.find_first_not_of(' ') == pos && pos >= 2) d.column = int(pos - 2 + 1);
    }
    if (d.file == program_name && d.line >= 1 && std::size_t(d.line) <= source_lines.size())
      d.source_line = source_lines[d.line - 1];
    out.push_back(std::move(d));
  }
  return out;
}

std::string strip_pch_notes(const std::string& log) {
  std::string out;
  for (auto& line : split_lines(log)) {
    if (line.find("precompiled header file") != std::string::npos) continue;
    out += line;
    out += '\n';
  }
  // An all-blank log is no log.
  if (out.find_first_not_of(" \n") == std::string::npos) return {};
  return out;
}

bool uses_cccl(std::string_view source, const CompileOptions& o) {
  static const std::regex inc(R"(#\s*include\s*[<"](cub/|cuda/|thrust/|cooperative_groups))");
  std::string s(source);
  if (std::regex_search(s, inc)) return true;
  for (auto& [name, text] : o.headers)
    if (std::regex_search(text, inc)) return true;
  return false;
}

Result<std::string> resolve_arch(const std::string& requested) {
  std::string arch = requested.empty() ? Compiler::default_arch() : requested;
  static const std::regex form(R"(^(sm|compute)_([0-9]+)([af]?)$)");
  std::smatch m;
  auto listed = Compiler::supported_archs();
  std::string supported;
  if (listed)
    for (auto& a : *listed) supported += (supported.empty() ? "" : ", ") + a;
  if (!std::regex_match(arch, m, form))
    return fail(ErrorCode::InvalidArgument, "architecture '" + arch +
                                                "' is not of the form sm_XY, sm_XYa or compute_XY; this NVRTC supports: " +
                                                supported);
  int number = std::stoi(m[2]);
  if (listed) {
    bool known = std::any_of(listed->begin(), listed->end(), [&](const std::string& a) { return a == "sm_" + m[2].str(); });
    bool suffix_ok = m[3] == "" || (m[3] == "a" && number >= 90) || (m[3] == "f" && number >= 100);
    if (!known || !suffix_ok)
      return fail(ErrorCode::InvalidArgument, "architecture '" + arch + "' is not supported by this NVRTC; supported: " +
                                                  supported + " (with an 'a' suffix from sm_90)");
  }
  return arch;
}

std::atomic<bool> g_confined{false};

}  // namespace

void confine_includes() noexcept { g_confined = true; }
bool includes_confined() noexcept { return g_confined; }

namespace {

Result<void> validate(std::string_view source, const CompileOptions& o, std::string_view program_name) {
  if (source.find_first_not_of(" \t\r\n") == std::string_view::npos)
    return fail(ErrorCode::InvalidArgument, "the CUDA source is empty: pass the program text to compile");
  if (o.confined || g_confined)
    if (auto ok = check_includes(source, o, program_name); !ok) return ok;
  if (o.cpp_standard != 17 && o.cpp_standard != 20)
    return fail(ErrorCode::InvalidArgument, "C++ standard " + std::to_string(o.cpp_standard) +
                                                " is not supported: use 17 or 20");
  if (o.max_registers < 0 || o.max_registers > 255)
    return fail(ErrorCode::InvalidArgument, "max_registers = " + std::to_string(o.max_registers) +
                                                " is out of range: use 0 (no cap) or 16..255");
  for (auto& [name, value] : o.defines)
    if (!is_identifier(name))
      return fail(ErrorCode::InvalidArgument, "define '" + name + "' is not a valid macro name");
  for (auto& p : o.include_paths)
    if (!fs::is_directory(p))
      return fail(ErrorCode::InvalidArgument, "include path '" + p + "' is not a folder");
  for (auto& e : o.name_expressions)
    if (e.empty()) return fail(ErrorCode::InvalidArgument, "a name expression is empty");
  return {};
}

// Everything that changes the compiler's output, in a canonical order.
std::vector<std::string> nvrtc_flags(const CompileOptions& o, const std::string& arch, bool pch) {
  std::vector<std::string> f;
  f.push_back("--gpu-architecture=" + arch);
  f.push_back("-std=c++" + std::to_string(o.cpp_standard));
  for (auto& p : o.include_paths) f.push_back("-I" + p);
  for (auto& p : Compiler::system_include_paths()) f.push_back("-I" + p);
  // Defines are normalized by name (stable, so a repeated name keeps its order): {A,B} and {B,A}
  // are one program and share one cache entry.
  auto defines = o.defines;
  std::stable_sort(defines.begin(), defines.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [name, value] : defines) f.push_back("-D" + name + (value.empty() ? "" : "=" + value));
  if (o.fast_math) f.push_back("--use_fast_math");
  if (o.line_info) f.push_back("-lineinfo");
  if (o.max_registers > 0) f.push_back("--maxrregcount=" + std::to_string(o.max_registers));
  if (pch) f.push_back("-pch");
  if (o.device_runtime) f.push_back("-rdc=true");
  for (auto& e : o.extra_flags) f.push_back(e);
  return f;
}

fs::path resolve_include(const std::string& name, const fs::path& from_dir, bool quoted,
                         const std::vector<std::string>& include_paths) {
  std::error_code ec;
  if (quoted && !from_dir.empty() && fs::is_regular_file(from_dir / name, ec)) return from_dir / name;
  for (auto& p : include_paths)
    if (fs::is_regular_file(fs::path(p) / name, ec)) return fs::path(p) / name;
  return {};
}

// Hashes the user's headers reachable from the source: a header edit must change the key. Toolkit
// headers are covered by the NVRTC version and the include folders.
void hash_user_headers(stitchcuda::detail::Sha256& h, std::string_view source, const CompileOptions& o) {
  static const std::regex inc(R"(#\s*include\s*([<"])([^>"]+)[>"])");
  std::set<std::string> seen;
  std::vector<std::pair<std::string, fs::path>> todo{{std::string(source), fs::path()}};
  std::set<std::string> memory_names;
  for (auto& [name, text] : o.headers) memory_names.insert(name);
  while (!todo.empty() && seen.size() < 2000) {
    auto [text, dir] = std::move(todo.back());
    todo.pop_back();
    for (std::sregex_iterator it(text.begin(), text.end(), inc), end; it != end; ++it) {
      std::string name = (*it)[2];
      if (memory_names.count(name)) continue;  // hashed with the options
      fs::path found = resolve_include(name, dir, (*it)[1] == "\"", o.include_paths);
      if (found.empty()) continue;
      std::error_code ec;
      auto canonical = fs::weakly_canonical(found, ec);
      std::string key = (ec ? found : canonical).string();
      if (!seen.insert(key).second) continue;
      std::ifstream in(found, std::ios::binary);
      std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      h.field(key).field(content);
      todo.push_back({content, found.parent_path()});
    }
  }
}

std::string key_for(std::string_view source, const CompileOptions& o, const std::string& arch,
                    std::string_view program_name, const detail::NvrtcApi& api) {
  stitchcuda::detail::Sha256 h;
  h.field("stitchcuda-jit-key/1").field(version());
  h.field(std::to_string(api.major) + "." + std::to_string(api.minor));
  h.field(program_name).field(source);
  for (auto& f : nvrtc_flags(o, arch, false)) h.field(f);
  for (auto& e : o.name_expressions) h.field("name:" + e);
  if (o.device_runtime) h.field("link:cudadevrt");  // -rdc=true alone is the unlinked object
  for (auto& [name, text] : o.headers) h.field("header:" + name).field(text);
  hash_user_headers(h, source, o);
  return h.hex();
}

}  // namespace

const KernelInfo* Binary::find_kernel(std::string_view name) const {
  for (auto& [expr, symbol] : lowered_names)
    if (expr == name)
      for (auto& k : kernels)
        if (k.name == symbol) return &k;
  for (auto& k : kernels)
    if (k.name == name) return &k;
  return nullptr;
}

bool Binary::cubin_runs_on(int cc_major, int cc_minor) const {
  // Machine code runs on later minor versions of the same major, except arch-specific ("a") code,
  // which runs only on its exact target, and family ("f") code, which runs within its family.
  if (cubin.empty() || arch.rfind("sm_", 0) != 0) return false;
  std::size_t end = 3;
  while (end < arch.size() && std::isdigit(static_cast<unsigned char>(arch[end]))) ++end;
  if (end == 3) return false;
  const int number = std::stoi(arch.substr(3, end - 3));
  const std::string suffix = arch.substr(end);
  const int major = number / 10, minor = number % 10;
  if (major != cc_major) return false;
  if (suffix == "a") return minor == cc_minor;
  return minor <= cc_minor;
}

Result<std::string> Compiler::nvrtc_version() {
  auto api = detail::nvrtc();
  if (!api) return tl::unexpected(api.error());
  return std::to_string((*api)->major) + "." + std::to_string((*api)->minor);
}

Result<std::string> Compiler::nvrtc_path() {
  auto api = detail::nvrtc();
  if (!api) return tl::unexpected(api.error());
  return (*api)->path;
}

Result<std::vector<std::string>> Compiler::supported_archs() {
  auto api = detail::nvrtc();
  if (!api) return tl::unexpected(api.error());
  int n = 0;
  (*api)->GetNumSupportedArchs(&n);
  std::vector<int> nums(std::size_t(std::max(n, 0)));
  if (n > 0) (*api)->GetSupportedArchs(nums.data());
  std::vector<std::string> out;
  for (int a : nums) {
    out.push_back("sm_" + std::to_string(a));
    if (a >= 90) out.push_back("sm_" + std::to_string(a) + "a");  // arch-specific features (wgmma, ...)
  }
  return out;
}

std::string Compiler::default_arch() {
  if (Driver::device_count() > 0) {
    int device = 0;
    if (auto api = detail::driver()) {
      CUcontext ctx = nullptr;
      CUdevice dev = 0;
      if ((*api)->CtxGetCurrent(&ctx) == CUDA_SUCCESS && ctx && (*api)->CtxGetDevice(&dev) == CUDA_SUCCESS)
        device = int(dev);
    }
    // Every cache lookup resolves the architecture, and a full device query costs far more than a
    // memory hit (docs/jit.md, Performance): remember the answer per device.
    static std::mutex mu;
    static std::map<int, std::string> known;
    {
      std::lock_guard lock(mu);
      if (auto it = known.find(device); it != known.end()) return it->second;
    }
    if (auto info = Driver::device(device)) {
      std::lock_guard lock(mu);
      return known[device] = info->arch();
    }
  }
  return "sm_90a";
}

std::vector<std::string> Compiler::system_include_paths() {
  static const std::vector<std::string> paths = [] {
    std::vector<fs::path> roots;
    for (const std::string& home : stitchcuda::detail::toolkit_folders())
      roots.emplace_back(fs::path(home) / "include");
    // A pip-installed NVRTC keeps its headers next to its lib folder.
    if (auto api = detail::nvrtc()) roots.push_back(fs::path((*api)->path).parent_path().parent_path() / "include");
    std::vector<std::string> out;
    std::error_code ec;
    for (auto& r : roots) {
      if (!fs::is_regular_file(r / "cuda_runtime.h", ec) && !fs::is_regular_file(r / "cuda_fp16.h", ec)) continue;
      out.push_back(r.string());
      if (fs::is_directory(r / "cccl", ec)) out.push_back((r / "cccl").string());
      break;
    }
    return out;
  }();
  return paths;
}

Result<std::string> Compiler::cache_key(std::string_view source, const CompileOptions& options,
                                        std::string_view program_name) {
  auto api = detail::nvrtc();
  if (!api) return tl::unexpected(api.error());
  if (auto ok = validate(source, options, program_name); !ok) return tl::unexpected(ok.error());
  auto arch = resolve_arch(options.arch);
  if (!arch) return tl::unexpected(arch.error());
  return key_for(source, options, *arch, program_name, **api);
}

Result<Binary> Compiler::compile(std::string_view source, const CompileOptions& options, std::string_view program_name) {
  auto loaded = detail::nvrtc();
  if (!loaded) return tl::unexpected(loaded.error());
  const auto& api = **loaded;
  if (auto ok = validate(source, options, program_name); !ok) return tl::unexpected(ok.error());
  auto arch = resolve_arch(options.arch);
  if (!arch) return tl::unexpected(arch.error());
  if (options.device_runtime && arch->rfind("sm_", 0) != 0)
    return fail(ErrorCode::InvalidArgument, "device_runtime needs a real architecture (sm_90a), not '" + *arch +
                                                "': relocatable code is linked for one GPU");

  const bool pch = options.pch == PchMode::On || (options.pch == PchMode::Auto && uses_cccl(source, options));
  auto flags = nvrtc_flags(options, *arch, pch);
  std::vector<const char*> flag_ptrs;
  for (auto& f : flags) flag_ptrs.push_back(f.c_str());
  std::vector<const char*> header_text, header_names;
  for (auto& [name, text] : options.headers) {
    header_names.push_back(name.c_str());
    header_text.push_back(text.c_str());
  }

  const std::string src(source);
  const std::string name(program_name);
  ProgramGuard guard{&api};
  auto t0 = std::chrono::steady_clock::now();
  if (nvrtcResult r = api.CreateProgram(&guard.prog, src.c_str(), name.c_str(), int(header_text.size()),
                                        header_text.data(), header_names.data());
      r != NVRTC_SUCCESS)
    return fail(ErrorCode::Internal, std::string("nvrtcCreateProgram failed: ") + api.GetErrorString(r));
  for (auto& e : options.name_expressions) api.AddNameExpression(guard.prog, e.c_str());
  nvrtcResult r = api.CompileProgram(guard.prog, int(flag_ptrs.size()), flag_ptrs.data());
  auto t1 = std::chrono::steady_clock::now();

  std::size_t log_size = 0;
  api.GetProgramLogSize(guard.prog, &log_size);
  std::string log(log_size, '\0');
  if (log_size) api.GetProgramLog(guard.prog, log.data());
  while (!log.empty() && log.back() == '\0') log.pop_back();
  log = strip_pch_notes(log);

  if (r == NVRTC_ERROR_INVALID_OPTION) {
    std::string bad;
    auto pos = log.find("option ");
    if (pos != std::string::npos) bad = log.substr(pos + 7, log.find(' ', pos + 7) - pos - 7);
    return fail(ErrorCode::InvalidArgument,
                "NVRTC rejected an option" + (bad.empty() ? std::string() : " '" + bad + "'") +
                    ": remove it from extra_flags or check its spelling",
                log);
  }
  if (r != NVRTC_SUCCESS) {
    Error e{ErrorCode::CompileError, {}, log, parse_diagnostics(log, program_name, source)};
    int errors = 0;
    const Diagnostic* first = nullptr;
    for (auto& d : e.diagnostics)
      if (d.severity == "error") {
        ++errors;
        if (!first) first = &d;
      }
    if (first) {
      e.message = first->file + ":" + std::to_string(first->line) + (first->column ? ":" + std::to_string(first->column) : "") +
                  ": error: " + first->message;
      if (!first->source_line.empty()) e.message += "\n  " + std::to_string(first->line) + " | " + first->source_line;
      if (errors > 1) e.message += "\n(" + std::to_string(errors - 1) + " more error(s) in the log)";
    } else {
      e.message = std::string("compilation of ") + name + " failed (" + api.GetErrorString(r) + ")";
    }
    return tl::unexpected(std::move(e));
  }

  Binary out;
  out.program_name = name;
  out.arch = *arch;
  out.log = log;
  out.compile_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  std::size_t n = 0;
  if (api.GetPTXSize(guard.prog, &n) == NVRTC_SUCCESS && n > 0) {
    out.ptx.resize(n);
    api.GetPTX(guard.prog, out.ptx.data());
    while (!out.ptx.empty() && out.ptx.back() == '\0') out.ptx.pop_back();
  }
  if (arch->rfind("sm_", 0) == 0 && api.GetCUBINSize(guard.prog, &n) == NVRTC_SUCCESS && n > 0) {
    out.cubin.resize(n);
    api.GetCUBIN(guard.prog, out.cubin.data());
  }
  if (options.device_runtime) {
    auto linked = detail::link_device_runtime(out.cubin, *arch);
    if (!linked) return tl::unexpected(linked.error());
    out.cubin = std::move(*linked);
  }
  for (auto& e : options.name_expressions) {
    const char* lowered = nullptr;
    if (api.GetLoweredName(guard.prog, e.c_str(), &lowered) == NVRTC_SUCCESS && lowered)
      out.lowered_names.emplace_back(e, lowered);
    else
      return fail(ErrorCode::CompileError, "name expression '" + e +
                                               "' does not name a __global__ function in the program: check the "
                                               "template arguments and spelling");
  }
  out.kernels = detail::parse_ptx_kernels(out.ptx);
  out.key = key_for(source, options, *arch, program_name, api);
  return out;
}

}  // namespace stitchcuda::jit
