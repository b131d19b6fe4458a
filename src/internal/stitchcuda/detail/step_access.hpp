// What each step reads and writes: the program layer's validation and liveness planning, and the executor.
#pragma once

#include <vector>

#include <stitchcuda/program.hpp>

namespace stitchcuda::program::detail {

/// The buffers a step reads and the buffers it writes (a View "writes" its result: it defines it).
struct StepAccess {
  std::vector<BufferId> reads;
  std::vector<BufferId> writes;
};

inline StepAccess access_of(const Step& step) {
  StepAccess a;
  if (auto* k = std::get_if<KernelLaunch>(&step)) {
    for (const KernelArg& arg : k->args)
      if (auto* b = std::get_if<BufferArg>(&arg)) {
        if (b->access != Access::write) a.reads.push_back(b->buffer);
        if (b->access != Access::read) a.writes.push_back(b->buffer);
      }
  } else if (auto* m = std::get_if<Matmul>(&step)) {
    a.reads = {m->a, m->b};
    if (m->bias) a.reads.push_back(*m->bias);
    if (m->beta != 0.0) a.reads.push_back(m->c);
    a.writes = {m->c};
  } else if (auto* op = std::get_if<AtenOp>(&step)) {
    a.reads = op->inputs;
    a.writes = op->outputs;
  } else if (auto* v = std::get_if<View>(&step)) {
    a.reads = {v->source};
    a.writes = {v->result};
  }
  return a;
}

}  // namespace stitchcuda::program::detail
