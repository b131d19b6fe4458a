// The family runtime: one Executor per member, the members' equal weights uploaded once and shared, each
// call routed to the member that serves its sizes (padded and narrowed back where a larger one does), and
// the working memory of at most max_resident members, the least recently run released first.
#include <stitchcuda/family_executor.hpp>
#include <stitchcuda/jit.hpp>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>

#include "steps.hpp"

namespace stitchcuda::torch {

using namespace stitchcuda::program;
using detail::scalar_type;

namespace {

struct Member {
  std::vector<std::int64_t> sizes;
  std::shared_ptr<Executor> executor;
  std::vector<TensorSpec> inputs;  // in run order
  // Runs hold it shared; releasing the member's working memory holds it alone, so no run is in flight then.
  std::shared_mutex in_use;
  std::atomic<std::uint64_t> calls{0}, padded_calls{0};
  bool resident = false;        // guarded by Impl::lru_mu
  std::uint64_t last_run = 0;   // guarded by Impl::lru_mu
};

// One distinct weight on the device: its host bytes stay to recognise the same weight in a later member.
struct PooledWeight {
  TensorSpec spec;
  std::string bytes;
  at::Tensor tensor;
};

}  // namespace

struct FamilyExecutor::Impl {
  std::vector<DynamicDim> dims;
  ExecutorOptions options;
  FamilyOptions family_options;
  int device = 0;

  mutable std::shared_mutex members_mu;  // guards members, member_sizes and layout (add_member appends)
  std::vector<std::shared_ptr<Member>> members;
  std::vector<std::vector<std::int64_t>> member_sizes;
  std::vector<TensorSpec> reference_inputs;  // the first member's: every call's other extents
  // What check_member reads of the family: the dims, the first member's program (without weights) and
  // every member's sizes; the other members' programs live in their executors only.
  ProgramFamily layout;

  std::mutex pool_mu;
  std::vector<PooledWeight> pool;
  std::multimap<std::size_t, std::size_t> pool_by_bytes;
  std::size_t shared_weight_bytes = 0;  // guarded by pool_mu
  std::set<const void*> shared_seen;    // the caller's tensors counted once

  std::mutex lru_mu;
  std::uint64_t clock = 0;
  std::atomic<std::uint64_t> runs{0}, padded_runs{0}, releases{0};

  at::TensorOptions options_for(const TensorSpec& s) const {
    return at::TensorOptions().dtype(scalar_type(s.dtype)).device(at::kCUDA, c10::DeviceIndex(device));
  }
  Result<std::shared_ptr<Member>> prepare(std::vector<std::int64_t> sizes, Program program,
                                          const std::map<BufferId, at::Tensor>& shared);
  void make_resident(Member& m);
  Result<std::vector<at::Tensor>> pad(const Member& m, const std::vector<std::int64_t>& sizes,
                                      const std::vector<at::Tensor>& inputs) const;
};

// An Executor for one member whose weights come from the pool (uploaded there when new) or the caller.
Result<std::shared_ptr<Member>> FamilyExecutor::Impl::prepare(std::vector<std::int64_t> sizes, Program program,
                                                              const std::map<BufferId, at::Tensor>& shared) {
  std::map<BufferId, at::Tensor> from;
  try {
    c10::cuda::CUDAGuard guard{c10::DeviceIndex(device)};
    std::lock_guard<std::mutex> lock(pool_mu);
    for (auto& [id, tensor] : shared)
      if (tensor.defined() && shared_seen.insert(tensor.data_ptr()).second) shared_weight_bytes += tensor.nbytes();
    for (auto it = program.weights.begin(); it != program.weights.end();) {
      const Buffer* b = program.buffer(it->first);
      if (shared.count(it->first) || !b || it->second.empty()) {  // the caller's, not a weight (validated), or bound later
        ++it;
        continue;
      }
      std::optional<std::size_t> found;
      for (auto [p, end] = pool_by_bytes.equal_range(it->second.size()); p != end && !found; ++p)
        if (pool[p->second].spec == b->spec && pool[p->second].bytes == it->second) found = p->second;
      if (!found) {
        auto dev = at::empty_strided(b->spec.shape, b->spec.strides, options_for(b->spec));
        auto host = at::from_blob(it->second.data(), b->spec.shape, b->spec.strides,
                                  at::TensorOptions().dtype(scalar_type(b->spec.dtype)));
        dev.copy_(host);
        found = pool.size();
        pool.push_back({b->spec, std::move(it->second), dev});
        pool_by_bytes.emplace(pool.back().bytes.size(), *found);
      }
      from[it->first] = pool[*found].tensor;
      it = program.weights.erase(it);  // the executor reads the pooled tensor: no host copy per member
    }
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError, std::string("uploading the family's weights failed: ") + e.what_without_backtrace());
  }
  for (const auto& [id, tensor] : shared) from[id] = tensor;
  auto m = std::make_shared<Member>();
  m->sizes = std::move(sizes);
  for (const Buffer* b : io_buffers(program, BufferRole::input)) m->inputs.push_back(b->spec);
  ExecutorOptions o = options;
  o.device = device;
  auto ex = Executor::create(std::move(program), o, from);
  if (!ex) return tl::unexpected(ex.error());
  m->executor = std::move(*ex);
  return m;
}

Result<std::shared_ptr<FamilyExecutor>> FamilyExecutor::create(ProgramFamily family, ExecutorOptions options,
                                                               FamilyOptions family_options) {
  return create(std::move(family), options, family_options, {});
}

Result<std::shared_ptr<FamilyExecutor>> FamilyExecutor::create(ProgramFamily family, ExecutorOptions options,
                                                               FamilyOptions family_options,
                                                               const std::vector<std::map<BufferId, at::Tensor>>& shared) {
  if (auto ok = family.validate(); !ok) return tl::unexpected(ok.error());
  if (family_options.max_resident < 1)
    return fail(ErrorCode::InvalidArgument, "max_resident is 0: at least the member running needs its working memory");
  if (!shared.empty() && shared.size() != family.members.size())
    return fail(ErrorCode::InvalidArgument, "shared holds " + std::to_string(shared.size()) + " map(s) for " +
                                                std::to_string(family.members.size()) + " members: one a member, or none");
  if (jit::Driver::device_count() == 0)
    return fail(ErrorCode::Unavailable, "no CUDA device: a family runs on a GPU (it can be built, validated and saved "
                                        "without one)");
  auto impl = std::make_unique<Impl>();
  Impl& x = *impl;
  x.dims = family.dims;
  x.options = options;
  x.family_options = family_options;
  try {
    x.device = options.device >= 0 ? options.device : int(c10::cuda::current_device());
  } catch (const c10::Error& e) {
    return fail(ErrorCode::Unavailable, std::string("PyTorch sees no CUDA device: ") + e.what_without_backtrace());
  }
  x.layout.dims = family.dims;
  for (const Buffer* b : io_buffers(family.members[0].program, BufferRole::input)) x.reference_inputs.push_back(b->spec);
  for (std::size_t i = 0; i < family.members.size(); ++i) {
    FamilyMember& fm = family.members[i];
    x.layout.members.push_back({fm.sizes, {}});
    auto m = x.prepare(fm.sizes, std::move(fm.program), shared.empty() ? std::map<BufferId, at::Tensor>{} : shared[i]);
    if (!m) {
      Error e = m.error();
      std::string sizes;
      for (std::size_t d = 0; d < x.dims.size(); ++d)
        sizes += (d ? ", " : "") + x.dims[d].name + "=" + std::to_string(fm.sizes[d]);
      e.message = "members[" + std::to_string(i) + "] (" + sizes + "): " + e.message;
      return tl::unexpected(std::move(e));
    }
    if (i == 0) {  // its executor's copy holds no pooled weight: copying it copies no model's weights
      x.layout.members[0].program = (*m)->executor->program();
      x.layout.members[0].program.weights.clear();
    }
    x.member_sizes.push_back((*m)->sizes);
    x.members.push_back(std::move(*m));
  }
  return std::make_shared<FamilyExecutor>(std::move(impl));
}

Result<std::shared_ptr<FamilyExecutor>> FamilyExecutor::load(const std::string& path, ExecutorOptions options,
                                                             FamilyOptions family_options) {
  auto family = ProgramFamily::load(path);
  if (!family) return tl::unexpected(family.error());
  return create(std::move(*family), options, family_options);
}

FamilyExecutor::FamilyExecutor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FamilyExecutor::~FamilyExecutor() = default;

// Marks `m` the most recently run and, past max_resident, releases the least recently run others. A member
// running on another thread is left resident (its release would wait for that run); a later call retries.
void FamilyExecutor::Impl::make_resident(Member& m) {
  std::vector<std::shared_ptr<Member>> victims;
  {
    // Lock order everywhere: members_mu, then a member's in_use, then lru_mu.
    std::shared_lock<std::shared_mutex> list(members_mu);
    std::lock_guard<std::mutex> lock(lru_mu);
    m.last_run = ++clock;
    if (m.resident) return;
    m.resident = true;
    std::size_t resident = 0;
    for (const auto& other : members) resident += other->resident;
    while (resident > family_options.max_resident) {
      std::shared_ptr<Member> oldest;
      for (const auto& other : members)
        if (other->resident && other.get() != &m && (!oldest || other->last_run < oldest->last_run)) oldest = other;
      if (!oldest) break;
      oldest->resident = false;
      victims.push_back(oldest);
      --resident;
    }
  }
  for (const auto& v : victims) {
    std::unique_lock<std::shared_mutex> idle(v->in_use, std::try_to_lock);
    if (idle && v->executor->release()) {
      releases++;
      continue;
    }
    std::lock_guard<std::mutex> lock(lru_mu);
    v->resident = true;
  }
}

Result<std::vector<at::Tensor>> FamilyExecutor::Impl::pad(const Member& m, const std::vector<std::int64_t>& sizes,
                                                          const std::vector<at::Tensor>& inputs) const {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const TensorSpec& s = m.inputs[i];
    const at::Tensor& t = inputs[i];
    const std::string which = "input " + std::to_string(i);
    if (t.scalar_type() != scalar_type(s.dtype))
      return fail(ErrorCode::InvalidArgument, which + " is " + c10::toString(t.scalar_type()) + " but the family's programs "
                                              "take " + to_string(s.dtype) + ": convert it first");
    if (!t.is_cuda() || t.get_device() != device)
      return fail(ErrorCode::InvalidArgument, which + " is on " + t.device().str() + " but the family runs on cuda:" +
                                                  std::to_string(device) + ": move it with .to('cuda:" + std::to_string(device) + "')");
    at::Tensor padded = at::empty_strided(s.shape, s.strides, options_for(s)).zero_();
    at::Tensor window = padded;
    for (std::size_t d = 0; d < dims.size(); ++d)
      for (const auto& [input, axis] : dims[d].inputs)
        if (input == i) window = window.narrow(std::int64_t(axis), 0, sizes[d]);
    window.copy_(t);
    out.push_back(std::move(padded));
  }
  return out;
}

Result<std::vector<at::Tensor>> FamilyExecutor::run(const std::vector<at::Tensor>& inputs, void* stream) {
  Impl& x = *impl_;
  std::vector<std::vector<std::int64_t>> shapes;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) return fail(ErrorCode::InvalidArgument, "input " + std::to_string(i) + " is an undefined tensor");
    shapes.push_back(inputs[i].sizes().vec());
  }
  std::shared_ptr<Member> m;
  std::vector<std::int64_t> sizes;
  {
    std::shared_lock<std::shared_mutex> lock(x.members_mu);
    auto got = call_sizes(x.dims, x.reference_inputs, shapes);
    if (!got) return tl::unexpected(got.error());
    auto chosen = select_member(x.dims, x.member_sizes, *got);
    if (!chosen) return tl::unexpected(chosen.error());
    m = x.members[*chosen];
    sizes = std::move(*got);
  }
  x.make_resident(*m);
  std::shared_lock<std::shared_mutex> running(m->in_use);
  if (sizes == m->sizes) {
    auto out = m->executor->run(inputs, stream);
    if (out) m->calls++, x.runs++;
    return out;
  }
  try {
    // The padding and the narrowed copies run on the program's stream, before and after it.
    c10::cuda::CUDAGuard device_guard(c10::DeviceIndex(x.device));
    std::optional<c10::cuda::CUDAStreamGuard> on;
    if (stream)
      on.emplace(c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), c10::DeviceIndex(x.device)));
    auto padded = x.pad(*m, sizes, inputs);
    if (!padded) return tl::unexpected(padded.error());
    auto out = m->executor->run(*padded, stream);
    if (!out) return out;
    for (std::size_t d = 0; d < x.dims.size(); ++d)
      for (const auto& [o, axis] : x.dims[d].outputs)
        if (sizes[d] != m->sizes[d]) (*out)[o] = (*out)[o].narrow(std::int64_t(axis), 0, sizes[d]);
    for (at::Tensor& t : *out)
      if (!t.is_contiguous()) t = t.contiguous();
    m->calls++, m->padded_calls++, x.runs++, x.padded_runs++;
    return out;
  } catch (const c10::Error& e) {
    return fail(ErrorCode::CudaError,
                std::string("padding the call to the member's sizes failed: ") + e.what_without_backtrace());
  }
}

Result<void> FamilyExecutor::add_member(std::vector<std::int64_t> sizes, Program program,
                                        const std::map<BufferId, at::Tensor>& shared) {
  Impl& x = *impl_;
  {
    std::shared_lock<std::shared_mutex> lock(x.members_mu);
    FamilyMember candidate{sizes, std::move(program)};
    auto ok = x.layout.check_member(candidate);
    program = std::move(candidate.program);
    if (!ok) return ok;
  }
  // Built outside the lock: loading kernels may take a while, and runs go on meanwhile.
  auto m = x.prepare(sizes, std::move(program), shared);
  if (!m) return tl::unexpected(m.error());
  std::unique_lock<std::shared_mutex> lock(x.members_mu);
  for (const auto& have : x.member_sizes)
    if (have == sizes)
      return fail(ErrorCode::InvalidArgument, "a member of these sizes was added meanwhile (by another thread): one "
                                              "program per sizes");
  x.layout.members.push_back({sizes, {}});
  x.member_sizes.push_back(std::move(sizes));
  x.members.push_back(std::move(*m));
  return {};
}

Result<void> FamilyExecutor::release() {
  Impl& x = *impl_;
  std::vector<std::shared_ptr<Member>> members;
  {
    std::shared_lock<std::shared_mutex> lock(x.members_mu);
    members = x.members;
  }
  for (const auto& m : members) {
    std::unique_lock<std::shared_mutex> idle(m->in_use);
    if (auto ok = m->executor->release(); !ok) return ok;
    std::lock_guard<std::mutex> lock(x.lru_mu);
    m->resident = false;
  }
  return {};
}

const std::vector<DynamicDim>& FamilyExecutor::dims() const { return impl_->dims; }
int FamilyExecutor::device() const { return impl_->device; }

std::vector<std::vector<std::int64_t>> FamilyExecutor::member_sizes() const {
  std::shared_lock<std::shared_mutex> lock(impl_->members_mu);
  return impl_->member_sizes;
}

std::vector<std::string> FamilyExecutor::warnings() const {
  std::shared_lock<std::shared_mutex> lock(impl_->members_mu);
  std::vector<std::string> out;
  for (const auto& m : impl_->members)
    for (const std::string& w : m->executor->warnings())
      if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  return out;
}

FamilyStats FamilyExecutor::stats() const {
  Impl& x = *impl_;
  FamilyStats s;
  s.runs = x.runs, s.padded_runs = x.padded_runs, s.releases = x.releases;
  {
    std::lock_guard<std::mutex> lock(x.pool_mu);
    for (const PooledWeight& w : x.pool) s.weight_bytes += w.spec.storage_bytes();
    s.shared_weight_bytes = x.shared_weight_bytes;
  }
  std::shared_lock<std::shared_mutex> lock(x.members_mu);
  for (const auto& m : x.members) {
    FamilyMemberStats ms;
    ms.sizes = m->sizes;
    ms.calls = m->calls, ms.padded_calls = m->padded_calls;
    ms.executor = m->executor->stats();
    s.weight_bytes += ms.executor.weight_bytes;  // weights a member uploaded itself (bound later: zeros)
    {
      std::lock_guard<std::mutex> l(x.lru_mu);
      ms.resident = m->resident;
    }
    s.resident += ms.resident;
    s.members.push_back(std::move(ms));
  }
  return s;
}

}  // namespace stitchcuda::torch
