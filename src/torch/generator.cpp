// Generator (generator.hpp): the token loop over a prefill + decode pair. The prefill executor owns the
// cache (its states, zero-filled); the decode executor is created over those very tensors, so a step reads
// what the prefill and the steps before it wrote. Tokens stay on the device: the chosen token (argmax, or a
// seeded draw) is written into the next step's input in place, the position advances in place, and the
// decode step replays its CUDA graph; an eos check reads the device once every kEosCheckEvery tokens.
#include <stitchcuda/generator.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include <stitchcuda/family.hpp>
#include "steps.hpp"

namespace stitchcuda::torch {

using program::BufferId;
using program::BufferRole;

namespace {

std::string number(double v) {
  std::ostringstream text;
  text << v;
  return text.str();
}

// Python's next_tokens (graph/decode.py), operation for operation: seeded alike, both draw the same tokens.
at::Tensor choose_tokens(const at::Tensor& logits, const SamplingOptions& o, const at::Generator& generator) {
  if (!o.do_sample) return logits.argmax(-1);
  constexpr double inf = std::numeric_limits<double>::infinity();
  at::Tensor scores = logits.to(at::kFloat) / o.temperature;
  if (o.top_k > 0 && o.top_k < scores.size(-1)) {
    at::Tensor kth = std::get<0>(scores.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    scores = scores.masked_fill(scores < kth, -inf);
  }
  if (o.top_p < 1.0) {
    auto [ordered, order] = scores.sort(-1, /*descending=*/true);
    at::Tensor probs = ordered.softmax(-1);
    // A token is dropped where the likelier ones already reach top_p: the likeliest always stays.
    at::Tensor drop = (probs.cumsum(-1) - probs) >= o.top_p;
    scores = scores.scatter(-1, order, ordered.masked_fill(drop, -inf));
  }
  std::optional<at::Generator> from;
  if (generator.defined()) from = generator;
  return at::multinomial(scores.softmax(-1), 1, /*replacement=*/false, from).select(-1, 0);
}

// A random generator of `device`'s kind started at `seed`: torch.Generator(device).manual_seed(seed).
at::Generator seeded_generator(c10::Device device, std::uint64_t seed) {
  at::Generator generator = device.is_cuda() ? at::cuda::detail::createCUDAGenerator(device.index())
                                             : at::detail::createCPUGenerator(seed);
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(seed);  // as torch.Generator.manual_seed: the seed, and the counter at 0
  return generator;
}

}  // namespace

Result<void> check_sampling(const SamplingOptions& o) {
  auto bad = [](std::string message) { return fail(ErrorCode::InvalidArgument, std::move(message)); };
  if (!std::isfinite(o.temperature))
    return bad("temperature must be a finite number (the logits are divided by it), not " + number(o.temperature));
  if (o.eos_token_id < -1)
    return bad("eos_token_id is one token id (>= 0) or -1 (none), not " + std::to_string(o.eos_token_id));
  if (!o.do_sample) {
    if (o.temperature != 1.0 || o.top_k != 0 || o.top_p != 1.0)
      return bad("temperature, top_k and top_p shape sampling, and do_sample=false decodes greedily (the argmax of "
                 "the logits): set do_sample to sample, or leave them at their defaults (1, 0, 1)");
    return {};
  }
  if (o.temperature == 0)
    return bad("do_sample with a temperature of 0 is greedy decoding: set do_sample=false (the argmax), or a "
               "temperature above 0 to sample");
  if (o.temperature < 0)
    return bad("temperature must be above 0 (the logits are divided by it), not " + number(o.temperature));
  if (o.top_k < 0)
    return bad("top_k must be >= 1 (sample among the k likeliest tokens) or 0 (all), not " + std::to_string(o.top_k));
  if (!(o.top_p > 0 && o.top_p <= 1))
    return bad("top_p must be a number in (0, 1] (sample among the fewest likeliest tokens whose probability reaches "
               "it; 1: all), not " + number(o.top_p));
  return {};
}

Result<at::Tensor> next_tokens(const at::Tensor& logits, const SamplingOptions& options) {
  if (auto ok = check_sampling(options); !ok) return tl::unexpected(ok.error());
  if (!logits.defined() || logits.dim() != 2 || !at::isFloatingType(logits.scalar_type()))
    return fail(ErrorCode::InvalidArgument,
                "the logits must be a floating-point [rows, vocab] tensor, not " +
                    (logits.defined() ? std::string(c10::toString(logits.scalar_type())) + " " + c10::str(logits.sizes())
                                      : std::string("an undefined tensor")));
  try {
    return choose_tokens(logits, options, seeded_generator(logits.device(), options.seed));
  } catch (const c10::Error& e) {  // a generator of another device than the logits', among others
    return fail(ErrorCode::InvalidArgument, std::string("choosing the next tokens failed: ") + e.what_without_backtrace());
  }
}

struct Generator::Impl {
  // The pair's shape (its programs, weights included, live on in the executors alone).
  std::int64_t batch = 0, prompt_length = 0, max_length = 0, vocab = 0;
  program::TensorSpec ids, positions;  // the prefill's inputs
  std::shared_ptr<Executor> prefill, decode;
  std::vector<BufferId> states;  // the prefill's state ids: the cache, zeroed before each sequence
  std::mutex mu;                 // one sequence at a time: the cache is one
  std::atomic<std::uint64_t> sequences{0}, tokens{0};
};

Generator::Generator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Generator::~Generator() = default;

Result<std::unique_ptr<Generator>> Generator::create(program::DecodePrograms programs, GeneratorOptions options) {
  if (auto ok = programs.validate(); !ok) return tl::unexpected(ok.error());
  auto impl = std::make_unique<Impl>();
  impl->batch = programs.batch(), impl->prompt_length = programs.prompt_length();
  impl->max_length = programs.max_length, impl->vocab = programs.vocab();
  const auto inputs = program::io_buffers(programs.prefill, BufferRole::input);
  impl->ids = inputs[0]->spec, impl->positions = inputs[1]->spec;
  const auto pairs = programs.state_pairs();
  ExecutorOptions prefill_options;
  prefill_options.device = options.device;
  if (!options.graphs) prefill_options.graphs = false;  // else the program's measured choice: it runs once a sequence
  auto prefill = Executor::create(std::move(programs.prefill), prefill_options);
  if (!prefill) {
    Error e = prefill.error();
    e.message = "the prefill program: " + e.message;
    return tl::unexpected(std::move(e));
  }
  std::map<BufferId, at::Tensor> shared;
  for (const auto& [mine, theirs] : pairs) {
    auto state = (*prefill)->state(mine);
    if (!state) return tl::unexpected(state.error());
    shared.emplace(theirs, *state);
    impl->states.push_back(mine);
  }
  ExecutorOptions decode_options;
  decode_options.device = (*prefill)->device();
  decode_options.graphs = options.graphs;
  auto decode = Executor::create(std::move(programs.decode), decode_options, shared);
  if (!decode) {
    Error e = decode.error();
    e.message = "the decode program: " + e.message;
    return tl::unexpected(std::move(e));
  }
  impl->prefill = std::move(*prefill);
  impl->decode = std::move(*decode);
  return std::make_unique<Generator>(std::move(impl));
}

Result<std::unique_ptr<Generator>> Generator::load(const std::string& path, GeneratorOptions options) {
  auto programs = program::DecodePrograms::load(path);
  if (!programs) return tl::unexpected(programs.error());
  return create(std::move(*programs), options);
}

Result<at::Tensor> Generator::generate(const at::Tensor& prompt, std::int64_t max_new_tokens,
                                       const SamplingOptions& options, void* stream) {
  Impl& x = *impl_;
  const std::int64_t batch = this->batch(), length = prompt_length(), cache = max_length();
  if (!prompt.defined() || prompt.dim() != 2 || !c10::isIntegralType(prompt.scalar_type(), /*includeBool=*/false) ||
      prompt.size(0) != batch || prompt.size(1) != length) {
    std::string got = prompt.defined() ? std::string(c10::toString(prompt.scalar_type())) + " " + c10::str(prompt.sizes())
                                       : "an undefined tensor";
    return fail(ErrorCode::InvalidArgument, "the prompt must be integer token ids [" + std::to_string(batch) + ", " +
                                                std::to_string(length) + "] (the batch and prompt length the prefill "
                                                "program was built for) but is " + got +
                                                ": pad or cut the prompts, or save a generator built for this shape");
  }
  if (max_new_tokens < 1)
    return fail(ErrorCode::InvalidArgument, "max_new_tokens must be at least 1, not " + std::to_string(max_new_tokens));
  // The last new token is returned, never written to the cache: the prompt and max_new_tokens - 1 are.
  if (length + max_new_tokens - 1 > cache)
    return fail(ErrorCode::InvalidArgument, "a prompt of " + std::to_string(length) + " tokens and " +
                                                std::to_string(max_new_tokens) + " new ones needs positions 0.." +
                                                std::to_string(length + max_new_tokens - 2) + " but the cache holds " +
                                                std::to_string(cache) + " (max_length): ask for fewer tokens");
  if (auto ok = check_sampling(options); !ok) return tl::unexpected(ok.error());
  if (options.eos_token_id >= vocab())
    return fail(ErrorCode::InvalidArgument, "eos_token_id " + std::to_string(options.eos_token_id) +
                                                " is past the vocabulary 0.." + std::to_string(vocab() - 1));
  try {  // an id past the embedding table would fault on the device: checked here (one read of two numbers)
    if (const auto range = at::aminmax(prompt); std::get<0>(range).item<std::int64_t>() < 0 ||
                                                std::get<1>(range).item<std::int64_t>() >= vocab())
      return fail(ErrorCode::InvalidArgument, "the prompt holds token ids from " +
                                                  std::to_string(std::get<0>(range).item<std::int64_t>()) + " to " +
                                                  std::to_string(std::get<1>(range).item<std::int64_t>()) +
                                                  " but the vocabulary is 0.." + std::to_string(vocab() - 1));
  } catch (const c10::Error& e) {
    return fail(ErrorCode::InvalidArgument, std::string("reading the prompt failed: ") + e.what_without_backtrace());
  }
  std::lock_guard<std::mutex> lock(x.mu);
  try {
    const auto device = c10::Device(at::kCUDA, c10::DeviceIndex(x.prefill->device()));
    c10::cuda::CUDAGuard device_guard(device);
    auto on = stream ? c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device.index())
                     : c10::cuda::getCurrentCUDAStream(device.index());
    c10::cuda::CUDAStreamGuard stream_guard(on);
    void* raw = on.stream();
    auto on_device = [&](const program::TensorSpec& s) { return at::TensorOptions().device(device).dtype(detail::scalar_type(s.dtype)); };

    // A new sequence starts from a zeroed cache (a cache that counts its own writes would append otherwise).
    for (BufferId id : x.states) {
      auto state = x.prefill->state(id);
      if (!state) return tl::unexpected(state.error());
      state->zero_();
    }
    std::vector<at::Tensor> prefill_in{prompt.to(on_device(x.ids)).contiguous(), at::arange(length, on_device(x.positions))};
    auto logits = x.prefill->run(prefill_in, raw);
    if (!logits) return tl::unexpected(logits.error());

    at::Tensor out = at::empty({batch, max_new_tokens}, at::TensorOptions().device(device).dtype(at::kLong));
    // The decode step's own input and output tensors (its graph's static buffers): argmax writes the next
    // token ids into the input, the position advances in place, and a replay copies nothing.
    auto step_in = x.decode->static_inputs(raw);
    auto step_out = x.decode->static_outputs(raw);
    if (!step_in) return tl::unexpected(step_in.error());
    if (!step_out) return tl::unexpected(step_out.error());
    at::Tensor& ids = (*step_in)[0];
    at::Tensor& position = (*step_in)[1];
    // Each call draws from its own generator at options.seed: one prompt and seed, one answer.
    const at::Generator draws = options.do_sample ? seeded_generator(device, options.seed) : at::Generator();
    const std::int64_t eos = options.eos_token_id;
    at::Tensor done;  // [batch] bool on the device: the sequences that produced eos (which then repeat it)
    // The logits of the last position: [batch, vocab] -> the next token of each sequence.
    auto choose = [&](const at::Tensor& all, std::int64_t i) {
      at::Tensor token = choose_tokens(all.select(1, all.size(1) - 1), options, draws);
      if (eos >= 0) {
        if (done.defined()) {
          token = at::where(done, at::Scalar(eos), token);
          done.logical_or_(token == eos);
        } else {
          done = token == eos;
        }
      }
      out.select(1, i).copy_(token);
      ids.copy_(token.view({batch, 1}));
    };
    choose((*logits)[0], 0);
    position.fill_(length);
    std::int64_t made = max_new_tokens;
    for (std::int64_t i = 1; i < max_new_tokens; ++i) {
      // The flags are read (a wait for every step queued) once every kEosCheckEvery tokens, not per token.
      if (eos >= 0 && i % kEosCheckEvery == 0 && done.all().item<bool>()) {
        made = i;
        break;
      }
      if (auto ran = x.decode->run(*step_in, *step_out, raw); !ran) return tl::unexpected(ran.error());
      choose((*step_out)[0], i);
      position.add_(1);
    }
    if (eos >= 0) {  // up to the first column where every sequence shows eos: exact, as a finished one repeats it
      at::Tensor ended = out.narrow(1, 0, made).eq(eos).all(0).nonzero();
      if (ended.size(0) > 0) made = ended[0][0].item<std::int64_t>() + 1;
    }
    x.sequences++;
    x.tokens += std::uint64_t(made);
    return made == max_new_tokens ? out : out.narrow(1, 0, made).contiguous();
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("generating failed: ") + e.what_without_backtrace());
  }
}

Result<std::vector<std::int64_t>> Generator::generate(const std::vector<std::int64_t>& prompt, std::int64_t max_new_tokens,
                                                      const SamplingOptions& options) {
  if (std::int64_t(prompt.size()) != batch() * prompt_length())
    return fail(ErrorCode::InvalidArgument, "the prompt holds " + std::to_string(prompt.size()) + " token ids but the "
                                                "prefill program takes " + std::to_string(batch()) + " x " +
                                                std::to_string(prompt_length()) + " (batch x prompt length, row-major)");
  try {
    at::Tensor ids = at::from_blob(const_cast<std::int64_t*>(prompt.data()), {batch(), prompt_length()}, at::kLong);
    auto tokens = generate(ids, max_new_tokens, options);
    if (!tokens) return tl::unexpected(tokens.error());
    at::Tensor host = tokens->cpu();  // waits for the loop
    return std::vector<std::int64_t>(host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel());
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("generating failed: ") + e.what_without_backtrace());
  }
}

std::int64_t Generator::batch() const { return impl_->batch; }
std::int64_t Generator::prompt_length() const { return impl_->prompt_length; }
std::int64_t Generator::max_length() const { return impl_->max_length; }
std::int64_t Generator::vocab() const { return impl_->vocab; }
int Generator::device() const { return impl_->prefill->device(); }

GeneratorStats Generator::stats() const {
  return {impl_->sequences.load(), impl_->tokens.load(), impl_->prefill->stats(), impl_->decode->stats()};
}

std::vector<std::string> Generator::warnings() const {
  std::vector<std::string> out = impl_->prefill->warnings();
  for (const std::string& w : impl_->decode->warnings())
    if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  return out;
}

}  // namespace stitchcuda::torch
