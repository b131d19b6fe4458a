// DecodePrograms (decode.hpp): the prefill + decode pair's checks and its file, in the program layer's
// container (detail/container.hpp) with the two programs' weights pooled.
#include <stitchcuda/decode.hpp>
#include <stitchcuda/family.hpp>

#include <limits>
#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include <stitchcuda/detail/container.hpp>

namespace stitchcuda::program {
namespace {

using nlohmann::json;
using detail::Field;

const detail::ContainerKind kDecodeFile{{'S', 'T', 'I', 'T', 'C', 'H', 'D', '\x01'}, kDecodeArtifactVersion,
                                        "stitchcuda.decode", "decode pair file", "not a valid prefill + decode file",
                                        "a single program's .stitch file loads with Program::load / Executor::load"};
constexpr std::int64_t kMaxLength = std::numeric_limits<std::int32_t>::max();

tl::unexpected<Error> invalid(std::string message) { return fail(ErrorCode::InvalidArgument, std::move(message)); }

bool is_integer(DType d) { return d == DType::i64 || d == DType::i32; }
bool is_floating(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::f64; }

std::string label(const char* program, const char* role, const Buffer& b) {
  std::string s = std::string(program) + "'s " + role + ' ';
  s += b.name.empty() ? std::to_string(b.id) : '\'' + b.name + '\'';
  return s;
}

// One program's inputs and logits: (ids [batch, tokens], positions [tokens]) -> logits [batch, tokens, vocab].
Result<void> check_io(const Program& p, const char* which) {
  const auto inputs = io_buffers(p, BufferRole::input), outputs = io_buffers(p, BufferRole::output);
  const std::string form = ": both programs compute forward(input_ids [batch, tokens], cache_position [tokens]) -> "
                           "logits [batch, tokens (or the last ones), vocab] (docs/decode.md)";
  if (inputs.size() != 2)
    return invalid(std::string(which) + " takes " + std::to_string(inputs.size()) + " input(s), not 2" + form);
  if (outputs.size() != 1)
    return invalid(std::string(which) + " has " + std::to_string(outputs.size()) + " output(s), not 1" + form);
  const TensorSpec &ids = inputs[0]->spec, &positions = inputs[1]->spec, &logits = outputs[0]->spec;
  if (ids.shape.size() != 2 || !is_integer(ids.dtype) || !ids.is_contiguous())
    return invalid(label(which, "input", *inputs[0]) + " is " + ids.describe() + ", not the token ids (contiguous "
                   "i64 or i32 [batch, tokens])" + form);
  if (positions.shape != std::vector<std::int64_t>{ids.shape[1]} || !is_integer(positions.dtype))
    return invalid(label(which, "input", *inputs[1]) + " is " + positions.describe() + ", not the cache positions (i64 or "
                   "i32 [" + std::to_string(ids.shape[1]) + "], one per token)" + form);
  // The logits of every token, or of the last ones only (a model asked for the last position's logits).
  if (logits.shape.size() != 3 || logits.shape[0] != ids.shape[0] || logits.shape[1] < 1 ||
      logits.shape[1] > ids.shape[1] || !is_floating(logits.dtype))
    return invalid(label(which, "output", *outputs[0]) + " is " + logits.describe() + ", not the logits (floating point [" +
                   std::to_string(ids.shape[0]) + ", 1.." + std::to_string(ids.shape[1]) + ", vocab]: the last positions')" +
                   form);
  if (ids.shape[0] < 1) return invalid(std::string(which) + "'s batch is 0: nothing to generate");
  return {};
}

// The program's states by name; an error for a state without a name or with another's.
Result<std::map<std::string, const Buffer*>> states_by_name(const Program& p, const char* which) {
  std::map<std::string, const Buffer*> out;
  for (const Buffer* b : io_buffers(p, BufferRole::state)) {
    if (b->name.empty())
      return invalid(std::string(which) + "'s state " + std::to_string(b->id) + " has no name: the two programs' states "
                     "are paired by name (the model's buffer names, as optimize() gives them)");
    if (!out.emplace(b->name, b).second)
      return invalid(std::string(which) + " has two states named '" + b->name + "': the two programs' states are paired "
                     "by name, so each name is one state");
  }
  return out;
}

// Extent `axis` of the first input or output of `role`, or 0 where the program has no such thing (unvalidated).
std::int64_t extent(const Program& p, BufferRole role, std::size_t axis) {
  const auto buffers = io_buffers(p, role);
  return buffers.empty() || buffers[0]->spec.shape.size() <= axis ? 0 : buffers[0]->spec.shape[axis];
}

}  // namespace

bool is_decode_artifact(std::string_view bytes) noexcept { return detail::has_magic(kDecodeFile, bytes); }

std::int64_t DecodePrograms::batch() const { return extent(prefill, BufferRole::input, 0); }
std::int64_t DecodePrograms::prompt_length() const { return extent(prefill, BufferRole::input, 1); }
std::int64_t DecodePrograms::vocab() const { return extent(prefill, BufferRole::output, 2); }

Result<void> DecodePrograms::validate() const {
  if (max_length < 2 || max_length > kMaxLength)
    return invalid("max_length = " + std::to_string(max_length) + " is outside 2.." + std::to_string(kMaxLength) +
                   ": the cache holds a prompt and at least one new token");
  for (auto [p, which] : {std::pair{&prefill, "prefill"}, std::pair{&decode, "decode"}}) {
    if (auto ok = p->validate(); !ok) return invalid(std::string(which) + " does not validate: " + ok.error().message);
    if (auto ok = check_io(*p, which); !ok) return ok;
  }
  if (const std::int64_t tokens = extent(decode, BufferRole::input, 1); tokens != 1)
    return invalid("decode takes " + std::to_string(tokens) + " tokens per sequence, not 1: build it for "
                   "one token ([batch, 1] and one position)");
  if (const std::int64_t b = extent(decode, BufferRole::input, 0); b != batch())
    return invalid("decode's batch is " + std::to_string(b) + ", prefill's is " + std::to_string(batch()) +
                   ": both run over one cache, built for one batch");
  if (prompt_length() >= max_length)
    return invalid("prefill takes prompts of " + std::to_string(prompt_length()) + " tokens but the cache holds " +
                   std::to_string(max_length) + " positions (max_length): no new token would fit");
  if (const std::int64_t v = extent(decode, BufferRole::output, 2); v != vocab())
    return invalid("decode's logits have a vocabulary of " + std::to_string(v) + ", prefill's of " + std::to_string(vocab()) +
                   ": build both programs from one model");
  auto mine = states_by_name(prefill, "prefill");
  if (!mine) return tl::unexpected(mine.error());
  auto theirs = states_by_name(decode, "decode");
  if (!theirs) return tl::unexpected(theirs.error());
  if (mine->empty())
    return invalid("prefill has no state: the decode reads the cache the prefill writes, so both programs need the model's "
                   "cache buffers as states (a static cache written in place, docs/decode.md)");
  for (auto [a, b, first, second] : {std::tuple{&*mine, &*theirs, "prefill", "decode"},
                                     std::tuple{&*theirs, &*mine, "decode", "prefill"}})
    for (const auto& [name, buffer] : *a) {
      auto other = b->find(name);
      if (other == b->end())
        return invalid(std::string(first) + " has a state '" + name + "' and " + second + " has none of that name: the two "
                       "programs share their states, so build both from one model (StaticCacheGenerator)");
      if (!(other->second->spec == buffer->spec))
        return invalid(std::string(first) + "'s state '" + name + "' is " + buffer->spec.describe() + " but " + second +
                       "'s is " + other->second->spec.describe() + ": a shared state has one layout");
    }
  return {};
}

std::vector<std::pair<BufferId, BufferId>> DecodePrograms::state_pairs() const {
  std::map<std::string, BufferId> decode_ids;
  for (const Buffer* b : io_buffers(decode, BufferRole::state)) decode_ids.emplace(b->name, b->id);
  std::vector<std::pair<BufferId, BufferId>> out;
  for (const Buffer* b : io_buffers(prefill, BufferRole::state))
    if (auto it = decode_ids.find(b->name); it != decode_ids.end()) out.emplace_back(b->id, it->second);
  return out;
}

std::string DecodePrograms::serialize() const {
  const detail::PooledPrograms pooled = detail::pool_weights({&prefill, &decode});
  std::vector<std::pair<std::string, std::string_view>> sections{{"program.prefill", pooled.programs[0]},
                                                                  {"program.decode", pooled.programs[1]}};
  pooled.add_weight_sections(sections);
  json manifest{{"max_length", max_length},
                {"programs", {{"prefill", {{"weights", pooled.weights[0]}}}, {"decode", {{"weights", pooled.weights[1]}}}}}};
  return detail::write_container(kDecodeFile, std::move(manifest), sections);
}

Result<DecodePrograms> DecodePrograms::deserialize(std::string_view bytes) {
  return detail::read_checked<DecodePrograms>(kDecodeFile, bytes, "pair", [](const detail::Container& file) {
    Field manifest(file.manifest, "manifest");
    DecodePrograms pair;
    pair.max_length = manifest["max_length"].integer(0, kMaxLength);
    std::set<std::string> used;
    pair.prefill = detail::read_pooled_program(file, "program.prefill", manifest["programs"]["prefill"]["weights"], used);
    pair.decode = detail::read_pooled_program(file, "program.decode", manifest["programs"]["decode"]["weights"], used);
    detail::require_all_used(file, used, "belongs to neither program");
    return pair;
  });
}

Result<void> DecodePrograms::save(const std::string& path) const { return detail::save_checked(kDecodeFile, path, *this); }

Result<DecodePrograms> DecodePrograms::load(const std::string& path) {
  return detail::load_container_file(kDecodeFile, path, &DecodePrograms::deserialize);
}

}  // namespace stitchcuda::program
