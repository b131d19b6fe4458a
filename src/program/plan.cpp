// Liveness planning: each intermediate storage lives from the step that first writes it to the
// step that last touches it (through any view); storages whose lifetimes overlap get disjoint
// ranges of one arena, the others may share bytes. A storage an ATen step writes first stays out of
// the arena: the op returns a tensor of its own, which the executor keeps until the last use. So does a
// large one (BufferPlan::large_storage_bytes), which the executor allocates for its lifetime: the
// program's memory then follows its live set step by step, ATen results included.
#include <stitchcuda/program.hpp>

#include <algorithm>
#include <limits>
#include <unordered_map>

#include <stitchcuda/detail/settings.hpp>
#include <stitchcuda/detail/step_access.hpp>

namespace stitchcuda::program {
namespace {

std::size_t align_up(std::size_t n) {
  return (n + BufferPlan::alignment - 1) / BufferPlan::alignment * BufferPlan::alignment;
}

struct Storage {
  BufferId id = 0;
  std::size_t bytes = 0;  // aligned
  int first = 0, last = 0;
  std::size_t offset = 0;
  bool arena = true;       // false: an ATen step's own result (it writes the storage first), or large
  bool allocated = false;  // outside the arena because it is large: the executor allocates it
};

bool lifetimes_overlap(const Storage& a, const Storage& b) { return a.first <= b.last && b.first <= a.last; }

// BufferPlan::large_storage_bytes, or STITCHCUDA_LARGE_STORAGE_BYTES when it is a count (0: every storage a
// kernel writes first stays in the arena), for measuring what the rule saves and ruling it out.
std::size_t large_storage_bytes() {
  const auto v = stitchcuda::detail::count_setting(stitchcuda::detail::Setting::large_storage_bytes);
  if (!v) return BufferPlan::large_storage_bytes;
  return *v == 0 ? std::numeric_limits<std::size_t>::max() : std::size_t(*v);
}

// First fit in the given order: each storage goes to the lowest offset clear of every storage
// already placed whose lifetime overlaps its own. Returns the arena size.
std::size_t place_first_fit(std::vector<Storage>& items) {
  std::vector<const Storage*> placed;
  std::size_t arena = 0;
  for (Storage& s : items) {
    std::vector<const Storage*> conflicts;
    for (const Storage* p : placed)
      if (lifetimes_overlap(*p, s) && p->bytes > 0) conflicts.push_back(p);
    std::sort(conflicts.begin(), conflicts.end(), [](auto* x, auto* y) { return x->offset < y->offset; });
    std::size_t offset = 0;
    for (const Storage* c : conflicts) {
      if (c->offset >= offset + s.bytes) break;  // the gap below c fits
      offset = std::max(offset, c->offset + c->bytes);
    }
    s.offset = offset;
    arena = std::max(arena, offset + s.bytes);
    placed.push_back(&s);
  }
  return arena;
}

}  // namespace

Result<BufferPlan> Program::plan() const {
  if (auto ok = validate(); !ok) return tl::unexpected(ok.error());

  // Each view's storage owner and its byte offset inside that owner.
  std::unordered_map<BufferId, std::pair<BufferId, std::size_t>> view_of;
  auto root = [&](BufferId id) {
    auto it = view_of.find(id);
    return it == view_of.end() ? std::pair<BufferId, std::size_t>{id, 0} : it->second;
  };

  std::unordered_map<BufferId, Storage> storages;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (auto* v = std::get_if<View>(&steps[i])) {
      auto [owner, offset] = root(v->source);
      view_of[v->result] = {owner, offset + std::size_t(v->storage_offset) * dtype_size(buffer(v->source)->spec.dtype)};
    }
    detail::StepAccess acc = detail::access_of(steps[i]);
    for (auto* list : {&acc.writes, &acc.reads})
      for (BufferId id : *list) {
        BufferId owner = root(id).first;
        const Buffer* b = buffer(owner);
        if (b->role != BufferRole::intermediate) continue;
        auto [it, fresh] = storages.try_emplace(owner, Storage{owner, align_up(b->spec.storage_bytes()), int(i), int(i), 0});
        if (!fresh) it->second.last = int(i);  // validation guarantees a write came first
        else if (std::holds_alternative<AtenOp>(steps[i]) && owner == id) it->second.arena = false;
      }
  }

  std::vector<Storage> items, outside;
  const std::size_t large = large_storage_bytes();
  for (auto& [id, s] : storages) {
    if (s.arena && s.bytes >= large) {
      s.arena = false;
      s.allocated = true;
    }
    (s.arena ? items : outside).push_back(s);
  }
  // Big storages first packs tightly; earliest first is optimal when sizes are equal. Keep the better.
  auto by_size = items, by_start = items;
  auto tie = [](const Storage& a, const Storage& b) { return a.id < b.id; };
  std::sort(by_size.begin(), by_size.end(), [&](auto& a, auto& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.first != b.first ? a.first < b.first : tie(a, b);
  });
  std::sort(by_start.begin(), by_start.end(), [&](auto& a, auto& b) {
    return a.first != b.first ? a.first < b.first : a.bytes != b.bytes ? a.bytes > b.bytes : tie(a, b);
  });
  std::size_t arena_size = place_first_fit(by_size);
  std::size_t arena_start = place_first_fit(by_start);
  const std::vector<Storage>& chosen = arena_size <= arena_start ? by_size : by_start;

  BufferPlan plan;
  plan.arena_bytes = std::min(arena_size, arena_start);
  std::unordered_map<BufferId, const Storage*> placed;
  for (const Storage& s : chosen) {
    placed[s.id] = &s;
    plan.unshared_bytes += s.bytes;
  }
  for (const Storage& s : outside) placed[s.id] = &s;
  for (std::size_t t = 0; t < steps.size(); ++t) {
    std::size_t live = 0;
    for (const Storage& s : chosen)
      if (s.first <= int(t) && int(t) <= s.last) live += s.bytes;
    if (live > plan.live_bound_bytes) {
      plan.live_bound_bytes = live;
      plan.widest_step = int(t);
    }
  }
  for (const Buffer& b : buffers) {
    auto [owner, offset] = root(b.id);
    auto it = placed.find(owner);
    if (it == placed.end()) continue;  // caller-bound, weight, or never touched
    const Storage& s = *it->second;
    plan.placements.push_back(Placement{b.id, owner, s.arena ? s.offset + offset : 0, b.spec.storage_bytes(), s.first,
                                        s.last, s.arena, s.allocated});
  }
  return plan;
}

}  // namespace stitchcuda::program
