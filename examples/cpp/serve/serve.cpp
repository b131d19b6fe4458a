// serve: a C++ inference server's core loop without Python. Loads a .stitch artifact (or, given none,
// builds a small MLP program with ProgramBuilder and saves it first), then answers requests from
// several threads, each on its own CUDA stream, replaying the program's CUDA graph. Every answer is
// compared with an eager (no graph) executor of the same artifact; the host time per forward is printed.
// `serve generate` runs the token loop of a saved prefill + decode pair (StaticCacheGenerator.save):
// prompt token ids in, greedy or sampled tokens out.
//
//   serve [artifact.stitch] [--threads N] [--requests N]     (serve --help says more)
//   serve generate PAIR.stitch --prompt 1,2,3 [--new-tokens N] [--do-sample --temperature T --top-k K
//                  --top-p P --seed S] [--eos ID]
//
// Prints "ok ..." on success, "no GPU: built only (...)" where no GPU is present; exits 1 on any error,
// 2 on bad usage.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <stitchcuda/executor.hpp>
#include <stitchcuda/generator.hpp>
#include <stitchcuda/program.hpp>

namespace program = stitchcuda::program;

static int failed(const char* what, const stitchcuda::Error& e) {
  std::fprintf(stderr, "error: %s: %s\n", what, e.describe().c_str());
  return 1;
}

// x[batch, 256] -> linear+bias+ReLU (cuBLASLt epilogue) -> [batch, 512] -> linear+bias -> y[batch, 128].
static program::Program demo_program(int batch) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto bytes_of = [&](std::size_t n, float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng) * scale;
    return std::string(reinterpret_cast<const char*>(v.data()), n * sizeof(float));
  };
  using program::TensorSpec;
  program::ProgramBuilder b;
  auto x = b.input(TensorSpec::contiguous({batch, 256}), "x");
  auto w1 = b.weight(TensorSpec::contiguous({512, 256}), bytes_of(512 * 256, 1.0f / 16), "w1");
  auto b1 = b.weight(TensorSpec::contiguous({512}), bytes_of(512, 1.0f), "b1");
  auto w2 = b.weight(TensorSpec::contiguous({128, 512}), bytes_of(128 * 512, 1.0f / 22), "w2");
  auto b2 = b.weight(TensorSpec::contiguous({128}), bytes_of(128, 1.0f), "b2");
  auto h = b.intermediate(TensorSpec::contiguous({batch, 512}), "h");
  auto y = b.output(TensorSpec::contiguous({batch, 128}), "y");
  program::Matmul first{.a = x, .b = w1, .c = h, .bias = b1, .transpose_b = true, .epilogue = program::Epilogue::bias_relu};
  program::Matmul second{.a = h, .b = w2, .c = y, .bias = b2, .transpose_b = true, .epilogue = program::Epilogue::bias};
  b.matmul(first).matmul(second);
  auto built = b.build();
  if (!built) {
    std::fprintf(stderr, "error: the demo program does not validate: %s\n", built.error().describe().c_str());
    std::exit(1);
  }
  return std::move(*built);
}

static constexpr const char* kUsage =
    "usage: serve [ARTIFACT.stitch] [--threads N] [--requests N]\n"
    "       serve generate PAIR.stitch --prompt IDS [--new-tokens N] [--do-sample [--temperature T] [--top-k K]\n"
    "                      [--top-p P] [--seed S]] [--eos ID]\n"
    "Loads a .stitch artifact (given none, builds and saves a small MLP program first) and answers N requests\n"
    "from several threads, each on its own CUDA stream, checking every answer against an eager executor.\n"
    "  --threads N    threads serving requests (default 4)\n"
    "  --requests N   requests in all (default 100)\n"
    "generate: tokens from a saved prefill + decode pair (StaticCacheGenerator.save in Python), greedy unless\n"
    "--do-sample:\n"
    "  --prompt IDS     the prompt's token ids, comma-separated; sequences of a batch separated by ';'\n"
    "  --new-tokens N   tokens to generate per sequence (default 16)\n"
    "  --do-sample      draw each token from the softmax of the logits instead of taking the argmax\n"
    "  --temperature T  divide the logits by T > 0 before drawing (default 1)\n"
    "  --top-k K        draw among the K likeliest tokens (default 0: all)\n"
    "  --top-p P        draw among the fewest likeliest tokens whose probability reaches P, 0 < P <= 1 (default 1)\n"
    "  --seed S         the draws' seed: one prompt and seed, one answer (default 0)\n"
    "  --eos ID         a sequence that produces token ID repeats it; generation ends once all have\n"
    "Prints 'ok ...' on success, 'no GPU: built only (...)' without a GPU; exits 1 on an error, 2 on bad usage.\n";

// A count after a flag, or 0 when it is missing or not a positive number.
static int count_after(int argc, char** argv, int& i) {
  if (i + 1 >= argc) return 0;
  char* end = nullptr;
  const long v = std::strtol(argv[++i], &end, 10);
  return *end == '\0' && v > 0 && v <= 1 << 20 ? int(v) : 0;
}

// "1,2,3;4,5,6" -> rows of token ids, or nothing when it is not that.
static std::optional<std::vector<std::vector<std::int64_t>>> token_rows(const std::string& text) {
  std::vector<std::vector<std::int64_t>> rows(1);
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t end = text.find_first_of(",;", at);
    const std::string item = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    char* stop = nullptr;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (item.empty() || *stop != '\0' || v < 0) return std::nullopt;
    rows.back().push_back(v);
    if (end == std::string::npos) break;
    if (text[end] == ';') rows.emplace_back();
    at = end + 1;
  }
  for (const auto& row : rows)
    if (row.size() != rows[0].size()) return std::nullopt;
  return rows;
}

// The number after a flag (all of the text a number), or nothing.
static std::optional<double> number_after(int argc, char** argv, int& i) {
  if (i + 1 >= argc) return std::nullopt;
  char* end = nullptr;
  const char* text = argv[++i];
  const double v = std::strtod(text, &end);
  return *text != '\0' && *end == '\0' ? std::optional<double>(v) : std::nullopt;
}

// serve generate PAIR --prompt IDS [--new-tokens N] [sampling flags]: the C++ token loop of a saved pair.
static int generate_main(int argc, char** argv) {
  std::string path, prompt_text;
  int new_tokens = 16;
  stitchcuda::torch::SamplingOptions options;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    // A flag taking a whole number (a token id, a count, a seed) of at least `least`.
    const char* given = i + 1 < argc ? argv[i + 1] : "";  // the value after the flag, for the message
    auto whole = [&](const char* what, double least) -> std::optional<double> {
      auto v = number_after(argc, argv, i);
      if (!v || *v != std::floor(*v) || *v < least || *v > 9.0e15) {
        std::fprintf(stderr, "serve generate: %s needs a whole number >= %.0f, not '%s'\n%s", what, least, given,
                     kUsage);
        return std::nullopt;
      }
      return v;
    };
    if (arg == "--prompt" && i + 1 < argc) {
      prompt_text = argv[++i];
    } else if (arg == "--new-tokens") {
      if (!(new_tokens = count_after(argc, argv, i))) {
        std::fprintf(stderr, "serve generate: --new-tokens needs a positive number\n%s", kUsage);
        return 2;
      }
    } else if (arg == "--do-sample") {
      options.do_sample = true;
    } else if (arg == "--temperature" || arg == "--top-p") {
      const auto v = number_after(argc, argv, i);
      if (!v) {
        std::fprintf(stderr, "serve generate: %s needs a number, not '%s'\n%s", arg.c_str(), given, kUsage);
        return 2;
      }
      (arg == "--temperature" ? options.temperature : options.top_p) = *v;
    } else if (arg == "--top-k" || arg == "--seed" || arg == "--eos") {
      const auto v = whole(arg.c_str(), 0);
      if (!v) return 2;
      if (arg == "--top-k") options.top_k = std::int64_t(*v);
      if (arg == "--seed") options.seed = std::uint64_t(*v);
      if (arg == "--eos") options.eos_token_id = std::int64_t(*v);
    } else if (arg.rfind("-", 0) != 0 && path.empty()) {
      path = arg;
    } else {
      std::fprintf(stderr, "serve generate: unexpected argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }
  const auto rows = token_rows(prompt_text);
  if (path.empty() || !rows) {
    std::fprintf(stderr, "serve generate: give PAIR.stitch and --prompt with token ids (non-negative integers, ',' between "
                         "tokens, ';' between sequences of equal length)\n%s", kUsage);
    return 2;
  }
  if (auto ok = stitchcuda::torch::check_sampling(options); !ok) {  // before a file is read or a GPU touched
    std::fprintf(stderr, "serve generate: %s\n%s", ok.error().message.c_str(), kUsage);
    return 2;
  }
  auto pair = program::DecodePrograms::load(path);
  if (!pair) return failed(("loading " + path).c_str(), pair.error());
  std::printf("pair %s: batch %lld, prompts of %lld tokens, %lld cache positions, vocabulary %lld\n", path.c_str(),
              (long long)pair->batch(), (long long)pair->prompt_length(), (long long)pair->max_length,
              (long long)pair->vocab());
  auto generator = stitchcuda::torch::Generator::create(std::move(*pair));
  if (!generator) {
    if (generator.error().code == stitchcuda::ErrorCode::Unavailable) {
      std::printf("no GPU: built only (%s)\n", generator.error().message.c_str());
      return 0;
    }
    return failed("creating the generator", generator.error());
  }
  for (const auto& w : (*generator)->warnings()) std::fprintf(stderr, "warning: %s\n", w.c_str());
  std::vector<std::int64_t> prompt;
  for (const auto& row : *rows) prompt.insert(prompt.end(), row.begin(), row.end());
  auto first = (*generator)->generate(prompt, new_tokens, options);  // the decode step captured here
  if (!first) return failed("generating", first.error());
  const auto t0 = std::chrono::steady_clock::now();
  auto tokens = (*generator)->generate(prompt, new_tokens, options);  // timed: prefill + the replayed steps
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (!tokens) return failed("generating", tokens.error());
  const std::size_t made = tokens->size() / rows->size();  // fewer than new_tokens where --eos ended them all
  for (std::size_t r = 0; r < rows->size(); ++r) {
    std::printf("tokens[%zu]:", r);
    for (std::size_t t = 0; t < made; ++t) std::printf(" %lld", (long long)(*tokens)[r * made + t]);
    std::printf("\n");
  }
  const auto stats = (*generator)->stats();
  // Greedy, or sampled from one seed: a sequence's tokens do not depend on the run.
  const bool same = *first == *tokens;
  std::printf("%s sequences=%zu new_tokens=%zu ms=%.3f tokens_per_s=%.1f decode_replays=%llu decode_captures=%llu\n",
              same ? "ok" : "FAILED (two runs of one prompt differ)", rows->size(), made, ms,
              double(rows->size() * made) / (ms / 1000.0), (unsigned long long)stats.decode.replays,
              (unsigned long long)stats.decode.captures);
  return same ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "generate") return generate_main(argc, argv);
  std::string path;
  int threads = 4, requests = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    int* count = arg == "--threads" ? &threads : arg == "--requests" ? &requests : nullptr;
    if (count && !(*count = count_after(argc, argv, i))) {
      std::fprintf(stderr, "serve: %s needs a positive number\n%s", arg.c_str(), kUsage);
      return 2;
    }
    if (count) continue;
    if (arg.rfind("-", 0) == 0 || !path.empty()) {
      std::fprintf(stderr, "serve: unexpected argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
    path = arg;
  }
  if (path.empty()) {
    path = (std::filesystem::temp_directory_path() / "stitchcuda-serve-demo.stitch").string();
    if (auto saved = demo_program(32).save(path); !saved) return failed("saving the demo program", saved.error());
  }
  auto loaded = program::Program::load(path);
  if (!loaded) return failed(("loading " + path).c_str(), loaded.error());
  std::printf("artifact %s: %zu buffers, %zu steps, %zu kernels\n", path.c_str(), loaded->buffers.size(),
              loaded->steps.size(), loaded->kernels.size());
  // A state (a KV cache) is updated in place by every run: the threads' concurrent runs would share it.
  for (const auto& b : loaded->buffers)
    if (b.role == program::BufferRole::state) {
      std::fprintf(stderr, "error: the program has a state, '%s' (%s), updated in place by every run: its runs cannot be "
                   "answered from several threads at once; for a saved prefill + decode pair use `serve generate`\n",
                   b.name.c_str(), b.spec.describe().c_str());
      return 1;
    }

  auto served = program::Executor::create(*loaded);
  if (!served) {
    if (served.error().code == stitchcuda::ErrorCode::Unavailable) {
      std::printf("no GPU: built only (%s)\n", served.error().message.c_str());
      return 0;
    }
    return failed("creating the executor", served.error());
  }
  auto eager = program::Executor::create(*loaded, {.graphs = false});
  if (!eager) return failed("creating the eager executor", eager.error());
  auto& ex = **served;

  // Inputs as the artifact declares them: random values, one set per request.
  auto make_inputs = [&](std::uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<at::Tensor> in;
    for (auto id : ex.inputs()) {
      const auto& spec = ex.program().buffer(id)->spec;
      in.push_back(at::randn(spec.shape, gen, at::kFloat).to(at::kCUDA));
    }
    return in;
  };

  std::atomic<int> mismatches{0};
  std::atomic<int> errors{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      c10::cuda::CUDAGuard device(c10::DeviceIndex(ex.device()));
      auto stream = c10::cuda::getStreamFromPool(false, c10::DeviceIndex(ex.device()));
      c10::cuda::CUDAStreamGuard on_stream(stream);
      for (int r = 0; r < requests; ++r) {
        auto in = make_inputs(std::uint64_t(t) * 100003u + std::uint64_t(r));
        auto got = ex.run(in, stream.stream());
        auto want = (*eager)->run(in, stream.stream());
        if (!got || !want) {
          std::fprintf(stderr, "error: thread %d request %d: %s\n", t, r,
                       (!got ? got.error() : want.error()).describe().c_str());
          errors++;
          return;
        }
        for (std::size_t o = 0; o < got->size(); ++o)
          if (!at::equal((*got)[o], (*want)[o])) mismatches++;
      }
      stream.synchronize();
    });
  for (auto& th : pool) th.join();
  if (errors) return 1;

  // Host cost of one forward: the graph's static buffers (no copies), each call timed alone.
  auto stream = c10::cuda::getStreamFromPool(false, c10::DeviceIndex(ex.device()));
  auto in = ex.static_inputs(stream.stream());
  auto out = ex.static_outputs(stream.stream());
  if (!in || !out) return failed("static buffers", !in ? in.error() : out.error());
  std::vector<double> host_us;
  for (int i = 0; i < 300; ++i) {
    stream.synchronize();
    auto t0 = std::chrono::steady_clock::now();
    if (auto r = ex.run(*in, *out, stream.stream()); !r) return failed("timed run", r.error());
    host_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  stream.synchronize();
  // Raw device pointers, as a server holding its own allocations would call it.
  std::vector<const void*> raw_in;
  std::vector<void*> raw_out;
  for (auto& t : *in) raw_in.push_back(t.data_ptr());
  auto fresh = ex.run(*in, stream.stream());
  for (auto& t : *fresh) raw_out.push_back(t.data_ptr());
  std::vector<at::Tensor> expected;
  for (auto& t : *out) expected.push_back(t.clone());
  if (auto r = ex.run(raw_in, raw_out, stream.stream()); !r) return failed("raw-pointer run", r.error());
  stream.synchronize();
  for (std::size_t o = 0; o < fresh->size(); ++o)
    if (!at::equal((*fresh)[o], expected[o])) mismatches++;

  std::nth_element(host_us.begin(), host_us.begin() + long(host_us.size() / 2), host_us.end());
  auto stats = ex.stats();
  std::printf("%s threads=%d requests=%d mismatches=%d replays=%llu captures=%llu host_us_per_forward=%.2f\n",
              mismatches ? "FAILED" : "ok", threads, threads * requests, mismatches.load(),
              static_cast<unsigned long long>(stats.replays), static_cast<unsigned long long>(stats.captures),
              host_us[host_us.size() / 2]);
  return mismatches ? 1 : 0;
}
