// Bindings of the program layer: ProgramBuilder, Program (validate, plan, save/load), the Executor,
// ProgramFamily with its FamilyExecutor (one program per member size of a dynamic range), and DecodePrograms
// with its Generator (a prefill + decode pair's C++ token loop).
// The Pythonic surface (stitchcuda.Program, stitchcuda.load) is in python/stitchcuda/program.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <stitchcuda/decode.hpp>
#include <stitchcuda/executor.hpp>
#include <stitchcuda/family.hpp>
#include <stitchcuda/family_executor.hpp>
#include <stitchcuda/generator.hpp>
#include <stitchcuda/program.hpp>

#include "errors.hpp"

namespace py = pybind11;

namespace stitchcuda::bindings {
namespace {

using namespace stitchcuda::program;

DType dtype_of(const std::string& name) {
  auto d = dtype_from_string(name);
  if (!d) invalid("unknown dtype '" + name + "': use f32, f16, bf16, f64, i32, i64, u8 or bool");
  return *d;
}

TensorSpec spec_of(const std::vector<std::int64_t>& shape, const std::string& dtype,
                   const std::optional<std::vector<std::int64_t>>& strides) {
  TensorSpec s = TensorSpec::contiguous(shape, dtype_of(dtype));
  if (strides) {
    if (strides->size() != shape.size())
      invalid("strides has " + std::to_string(strides->size()) + " entries for a shape of rank " + std::to_string(shape.size()));
    s.strides = *strides;
  }
  return s;
}

template <class E>
E enum_of(const std::string& name, std::initializer_list<E> values, const char* what) {
  std::string known;
  for (E v : values) {
    if (name == to_string(v)) return v;
    known += std::string(known.empty() ? "" : ", ") + to_string(v);
  }
  invalid(std::string("unknown ") + what + " '" + name + "': use one of " + known);
}

Attribute attribute_of(const std::string& key, const py::handle& v) {
  if (py::isinstance<py::bool_>(v)) return v.cast<bool>();
  if (py::isinstance<py::int_>(v)) return v.cast<std::int64_t>();
  if (py::isinstance<py::float_>(v)) return v.cast<double>();
  if (py::isinstance<py::str>(v)) return v.cast<std::string>();
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    auto seq = v.cast<py::sequence>();
    bool all_int = true;
    for (auto item : seq) all_int &= py::isinstance<py::int_>(item) && !py::isinstance<py::bool_>(item);
    if (all_int) return seq.cast<std::vector<std::int64_t>>();
    return seq.cast<std::vector<double>>();
  }
  invalid("attribute '" + key + "' has a value of type " + std::string(py::str(py::type::handle_of(v).attr("__name__"))) +
          ": use int, float, bool, str or a list of numbers");
}

py::object attribute_to_py(const Attribute& a) {
  return std::visit([](const auto& v) -> py::object { return py::cast(v); }, a);
}

// ("in"|"out"|"inout", id) or ("i32"|"i64"|"f32"|"f64", value).
KernelArg kernel_arg(const py::handle& h) {
  auto t = h.cast<py::tuple>();
  if (t.size() != 2) invalid("a kernel argument is a pair: ('in'|'out'|'inout', buffer) or ('i32'|'i64'|'f32'|'f64', value)");
  auto kind = t[0].cast<std::string>();
  if (kind == "in") return BufferArg{t[1].cast<BufferId>(), Access::read};
  if (kind == "out") return BufferArg{t[1].cast<BufferId>(), Access::write};
  if (kind == "inout") return BufferArg{t[1].cast<BufferId>(), Access::read_write};
  if (kind == "i32") return t[1].cast<std::int32_t>();
  if (kind == "i64") return t[1].cast<std::int64_t>();
  if (kind == "f32") return t[1].cast<float>();
  if (kind == "f64") return t[1].cast<double>();
  invalid("unknown kernel argument kind '" + kind + "': use in, out, inout, i32, i64, f32 or f64");
}

std::array<std::uint32_t, 3> dim3(const std::vector<std::uint32_t>& v, const char* what) {
  if (v.empty() || v.size() > 3) invalid(std::string(what) + " takes 1 to 3 extents");
  std::array<std::uint32_t, 3> out{1, 1, 1};
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i];
  return out;
}

py::dict spec_dict(const TensorSpec& s) {
  py::dict d;
  d["shape"] = s.shape;
  d["strides"] = s.strides;
  d["dtype"] = to_string(s.dtype);
  return d;
}

py::dict step_dict(const Step& step) {
  py::dict d;
  d["kind"] = step_kind(step);
  if (auto* k = std::get_if<KernelLaunch>(&step)) {
    d["kernel"] = k->kernel;
    d["grid"] = std::vector<std::uint32_t>(k->grid.begin(), k->grid.end());
    d["block"] = std::vector<std::uint32_t>(k->block.begin(), k->block.end());
    d["shared_mem"] = k->shared_mem_bytes;
    py::list args;
    for (const KernelArg& a : k->args) {
      if (auto* b = std::get_if<BufferArg>(&a))
        args.append(py::make_tuple(b->access == Access::read ? "in" : b->access == Access::write ? "out" : "inout", b->buffer));
      else if (auto* v = std::get_if<std::int32_t>(&a)) args.append(py::make_tuple("i32", *v));
      else if (auto* v = std::get_if<std::int64_t>(&a)) args.append(py::make_tuple("i64", *v));
      else if (auto* v = std::get_if<float>(&a)) args.append(py::make_tuple("f32", *v));
      else if (auto* v = std::get_if<double>(&a)) args.append(py::make_tuple("f64", *v));
    }
    d["args"] = args;
  } else if (auto* m = std::get_if<Matmul>(&step)) {
    d["a"] = m->a, d["b"] = m->b, d["c"] = m->c;
    d["bias"] = m->bias ? py::cast(*m->bias) : py::none();
    d["transpose_a"] = m->transpose_a, d["transpose_b"] = m->transpose_b, d["batch"] = m->batch;
    d["alpha"] = m->alpha, d["beta"] = m->beta;
    d["epilogue"] = to_string(m->epilogue), d["precision"] = to_string(m->precision);
  } else if (auto* op = std::get_if<AtenOp>(&step)) {
    d["op"] = op->op, d["inputs"] = op->inputs, d["outputs"] = op->outputs;
    py::dict attrs;
    for (const auto& [k, v] : op->attributes) attrs[py::str(k)] = attribute_to_py(v);
    d["attributes"] = attrs;
  } else if (auto* v = std::get_if<View>(&step)) {
    d["view"] = to_string(v->kind), d["source"] = v->source, d["result"] = v->result;
    d["storage_offset"] = v->storage_offset;
  }
  return d;
}

std::vector<at::Tensor> tensors_of(const py::sequence& seq, const char* what) {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < seq.size(); ++i) {
    py::object item = seq[i];
    if (!THPVariable_Check(item.ptr()))
      invalid(std::string(what) + " " + std::to_string(i) + " is a " + std::string(py::str(py::type::handle_of(item).attr("__name__"))) +
              ", not a torch.Tensor");
    out.push_back(THPVariable_Unpack(item.ptr()));
  }
  return out;
}

py::list to_py(const std::vector<at::Tensor>& ts) {
  py::list out;
  for (const at::Tensor& t : ts) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
  return out;
}

void* stream_of(std::uintptr_t s) { return reinterpret_cast<void*>(s); }

// {buffer id: torch.Tensor}: weights an executor reads in place, states it reads and updates in place.
std::map<BufferId, at::Tensor> shared_of(const py::dict& shared) {
  std::map<BufferId, at::Tensor> tensors;
  for (const auto& [key, value] : shared) {
    if (!THPVariable_Check(value.ptr())) invalid("shared weights and states map buffer ids to torch.Tensor values");
    tensors.emplace(key.cast<BufferId>(), THPVariable_Unpack(value.ptr()));
  }
  return tensors;
}

py::dict executor_stats(const ExecutorStats& s) {
  py::dict d;
  d["runs"] = s.runs, d["eager_runs"] = s.eager_runs, d["replays"] = s.replays, d["captures"] = s.captures;
  d["copies_skipped"] = s.copies_skipped, d["instances"] = s.instances, d["arena_bytes"] = s.arena_bytes;
  d["workspace_bytes"] = s.workspace_bytes;
  d["device_launches"] = s.device_launches, d["host_replay_note"] = s.host_replay_note;
  d["weight_bytes"] = s.weight_bytes, d["shared_weight_bytes"] = s.shared_weight_bytes;
  d["state_bytes"] = s.state_bytes, d["shared_state_bytes"] = s.shared_state_bytes;
  return d;
}

// [(index, axis), ...] of a dim's inputs or outputs.
std::vector<std::pair<std::uint32_t, std::uint32_t>> axes_of(const py::handle& list, const std::string& what) {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
  for (auto item : list.cast<py::sequence>()) {
    auto pair = py::reinterpret_borrow<py::sequence>(item);
    if (pair.size() != 2) invalid(what + " holds (index, axis) pairs");
    out.emplace_back(pair[0].cast<std::uint32_t>(), pair[1].cast<std::uint32_t>());
  }
  return out;
}

// dict(name=, min=, max=, pad=False, inputs=[(i, a)], outputs=[(i, a)]).
DynamicDim dim_of(const py::handle& h, std::size_t index) {
  const std::string at = "dims[" + std::to_string(index) + "]";
  if (!py::isinstance<py::dict>(h)) invalid(at + " is not a dict(name=, min=, max=, pad=, inputs=, outputs=)");
  auto d = h.cast<py::dict>();
  check_keys(d, {"name", "min", "max", "pad", "inputs", "outputs"}, "dim field");
  for (const char* key : {"name", "min", "max", "inputs"})
    if (!d.contains(key)) invalid(at + " lacks '" + key + "'");
  DynamicDim dim;
  dim.name = d["name"].cast<std::string>();
  dim.min = d["min"].cast<std::int64_t>(), dim.max = d["max"].cast<std::int64_t>();
  dim.pad = d.contains("pad") && d["pad"].cast<bool>();
  dim.inputs = axes_of(d["inputs"], at + ".inputs");
  if (d.contains("outputs")) dim.outputs = axes_of(d["outputs"], at + ".outputs");
  return dim;
}

py::dict dim_dict(const DynamicDim& dim) {
  py::dict d;
  d["name"] = dim.name, d["min"] = dim.min, d["max"] = dim.max, d["pad"] = dim.pad;
  d["inputs"] = dim.inputs, d["outputs"] = dim.outputs;
  return d;
}


// ProgramFamily and FamilyExecutor (stitchcuda.ProgramFamily / FamilyExecutor wrap them).
void bind_family(py::module_& pm) {
  py::class_<ProgramFamily>(pm, "ProgramFamily")
      .def(py::init([](const py::sequence& dims, const py::sequence& members) {
        ProgramFamily f;
        for (std::size_t d = 0; d < dims.size(); ++d) f.dims.push_back(dim_of(dims[d], d));
        for (std::size_t i = 0; i < members.size(); ++i) {
          auto pair = members[i].cast<py::sequence>();
          if (pair.size() != 2) invalid("members[" + std::to_string(i) + "] is not a (sizes, Program) pair");
          f.members.push_back({pair[0].cast<std::vector<std::int64_t>>(), pair[1].cast<Program>()});
        }
        return f;
      }), py::arg("dims"), py::arg("members"))
      .def("validate", [](const ProgramFamily& f) { unwrap(f.validate()); })
      .def("check_member", [](const ProgramFamily& f, std::vector<std::int64_t> sizes, const Program& p) {
        unwrap(f.check_member({std::move(sizes), p}));
      })
      .def("serialize", [](const ProgramFamily& f) { return py::bytes(f.serialize()); })
      .def_static("deserialize", [](const py::bytes& b) { return unwrap(ProgramFamily::deserialize(std::string(b))); })
      .def("save", [](const ProgramFamily& f, const std::string& path) { unwrap(f.save(path)); })
      .def_static("load", [](const std::string& path) { return unwrap(ProgramFamily::load(path)); })
      .def_property_readonly("dims", [](const ProgramFamily& f) {
        py::list out;
        for (const DynamicDim& d : f.dims) out.append(dim_dict(d));
        return out;
      })
      .def_property_readonly("member_sizes", &ProgramFamily::member_sizes)
      .def("program", [](const ProgramFamily& f, std::size_t i) {
        if (i >= f.members.size()) invalid("member " + std::to_string(i) + " of " + std::to_string(f.members.size()));
        return f.members[i].program;  // a copy: the Python Program owns it
      });
  pm.def("is_family_artifact", [](const py::bytes& b) { return is_family_artifact(std::string(b)); });
  // The member choice on the dims and sizes alone: no program is copied to answer it.
  pm.def("select_member", [](const py::sequence& dims, const std::vector<std::vector<std::int64_t>>& member_sizes,
                             const std::vector<std::int64_t>& sizes) {
    std::vector<DynamicDim> ds;
    for (std::size_t d = 0; d < dims.size(); ++d) ds.push_back(dim_of(dims[d], d));
    return unwrap(select_member(ds, member_sizes, sizes));
  });
  pm.def("call_sizes", [](const py::sequence& dims, const std::vector<py::dict>& reference,
                          const std::vector<std::vector<std::int64_t>>& shapes) {
    std::vector<DynamicDim> ds;
    for (std::size_t d = 0; d < dims.size(); ++d) ds.push_back(dim_of(dims[d], d));
    std::vector<TensorSpec> specs;
    for (const py::dict& r : reference)  // a buffer dict of Program.buffers
      specs.push_back(spec_of(r["shape"].cast<std::vector<std::int64_t>>(), r["dtype"].cast<std::string>(),
                              r["strides"].cast<std::vector<std::int64_t>>()));
    return unwrap(call_sizes(ds, specs, shapes));
  });

  py::class_<FamilyExecutor, std::shared_ptr<FamilyExecutor>>(pm, "FamilyExecutor")
      .def(py::init([](const ProgramFamily& f, std::optional<bool> graphs, int device, std::size_t max_resident,
                       const py::sequence& shared) {
        ExecutorOptions o;
        o.graphs = graphs, o.device = device;
        std::vector<std::map<BufferId, at::Tensor>> maps;
        for (auto m : shared) maps.push_back(shared_of(m.cast<py::dict>()));
        Result<std::shared_ptr<FamilyExecutor>> r;
        {
          py::gil_scoped_release release;
          r = FamilyExecutor::create(f, o, {max_resident}, maps);
        }
        return unwrap(std::move(r));
      }), py::arg("family"), py::arg("graphs") = py::none(), py::arg("device") = -1, py::arg("max_resident") = 4,
          py::arg("shared") = py::list())
      .def("run", [](FamilyExecutor& e, const py::sequence& inputs, std::uintptr_t stream) {
        auto in = tensors_of(inputs, "input");
        Result<std::vector<at::Tensor>> r;
        {
          py::gil_scoped_release release;
          r = e.run(in, stream_of(stream));
        }
        return to_py(unwrap(std::move(r)));
      }, py::arg("inputs"), py::arg("stream") = 0)
      .def("add_member", [](FamilyExecutor& e, std::vector<std::int64_t> sizes, const Program& p, const py::dict& shared) {
        auto tensors = shared_of(shared);
        Result<void> r;
        {
          py::gil_scoped_release release;
          r = e.add_member(std::move(sizes), p, tensors);
        }
        unwrap(std::move(r));
      }, py::arg("sizes"), py::arg("program"), py::arg("shared") = py::dict())
      .def("release", [](FamilyExecutor& e) {
        Result<void> r;
        {
          py::gil_scoped_release release;
          r = e.release();
        }
        unwrap(std::move(r));
      })
      .def_property_readonly("dims", [](const FamilyExecutor& e) {
        py::list out;
        for (const DynamicDim& d : e.dims()) out.append(dim_dict(d));
        return out;
      })
      .def_property_readonly("member_sizes", &FamilyExecutor::member_sizes)
      .def_property_readonly("device", &FamilyExecutor::device)
      .def_property_readonly("warnings", &FamilyExecutor::warnings)
      .def("stats", [](const FamilyExecutor& e) {
        FamilyStats s = e.stats();
        py::dict d;
        d["runs"] = s.runs, d["padded_runs"] = s.padded_runs, d["releases"] = s.releases, d["resident"] = s.resident;
        d["weight_bytes"] = s.weight_bytes, d["shared_weight_bytes"] = s.shared_weight_bytes;
        py::list members;
        for (const FamilyMemberStats& m : s.members) {
          py::dict md;
          md["sizes"] = m.sizes, md["calls"] = m.calls, md["padded_calls"] = m.padded_calls, md["resident"] = m.resident;
          md["executor"] = executor_stats(m.executor);
          members.append(md);
        }
        d["members"] = members;
        return d;
      });
}

// DecodePrograms and Generator (stitchcuda.program.DecodePrograms / LoadedGenerator wrap them).
void bind_decode(py::module_& pm) {
  py::class_<DecodePrograms>(pm, "DecodePrograms")
      .def(py::init([](const Program& prefill, const Program& decode, std::int64_t max_length) {
        return DecodePrograms{prefill, decode, max_length};
      }), py::arg("prefill"), py::arg("decode"), py::arg("max_length"))
      .def("validate", [](const DecodePrograms& d) { unwrap(d.validate()); })
      .def("serialize", [](const DecodePrograms& d) { return py::bytes(d.serialize()); })
      .def_static("deserialize", [](const py::bytes& b) { return unwrap(DecodePrograms::deserialize(std::string(b))); })
      .def("save", [](const DecodePrograms& d, const std::string& path) { unwrap(d.save(path)); })
      .def_static("load", [](const std::string& path) { return unwrap(DecodePrograms::load(path)); })
      .def_property_readonly("prefill", [](const DecodePrograms& d) { return d.prefill; })  // copies: Python owns them
      .def_property_readonly("decode", [](const DecodePrograms& d) { return d.decode; })
      .def_readonly("max_length", &DecodePrograms::max_length)
      .def_property_readonly("state_pairs", &DecodePrograms::state_pairs);
  pm.def("is_decode_artifact", [](const py::bytes& b) { return is_decode_artifact(std::string(b)); });

  // SamplingOptions as keywords (registered before Generator.generate, whose default is one).
  using stitchcuda::torch::SamplingOptions;
  py::class_<SamplingOptions>(pm, "SamplingOptions")
      .def(py::init([](bool do_sample, double temperature, std::int64_t top_k, double top_p, std::uint64_t seed,
                       std::int64_t eos_token_id) {
        return SamplingOptions{do_sample, temperature, top_k, top_p, seed, eos_token_id};
      }), py::arg("do_sample") = false, py::arg("temperature") = 1.0, py::arg("top_k") = 0, py::arg("top_p") = 1.0,
         py::arg("seed") = 0, py::arg("eos_token_id") = -1)
      .def("check", [](const SamplingOptions& o) { unwrap(stitchcuda::torch::check_sampling(o)); });

  py::class_<stitchcuda::torch::Generator>(pm, "Generator")
      .def(py::init([](const DecodePrograms& d, bool graphs, int device) {
        Result<std::unique_ptr<stitchcuda::torch::Generator>> r;
        {
          py::gil_scoped_release release;
          r = stitchcuda::torch::Generator::create(d, {device, graphs});
        }
        return unwrap(std::move(r));
      }), py::arg("programs"), py::arg("graphs") = true, py::arg("device") = -1)
      .def("generate", [](stitchcuda::torch::Generator& g, const py::object& prompt, std::int64_t max_new_tokens,
                          std::uintptr_t stream, const stitchcuda::torch::SamplingOptions& options) {
        if (!THPVariable_Check(prompt.ptr())) invalid("the prompt is a torch.Tensor of token ids");
        at::Tensor ids = THPVariable_Unpack(prompt.ptr());
        Result<at::Tensor> r;
        {
          py::gil_scoped_release release;
          r = g.generate(ids, max_new_tokens, options, stream_of(stream));
        }
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(unwrap(std::move(r))));
      }, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("stream") = 0,
         py::arg("options") = stitchcuda::torch::SamplingOptions{})
      .def_property_readonly("batch", &stitchcuda::torch::Generator::batch)
      .def_property_readonly("prompt_length", &stitchcuda::torch::Generator::prompt_length)
      .def_property_readonly("max_length", &stitchcuda::torch::Generator::max_length)
      .def_property_readonly("vocab", &stitchcuda::torch::Generator::vocab)
      .def_property_readonly("device", &stitchcuda::torch::Generator::device)
      .def_property_readonly("warnings", &stitchcuda::torch::Generator::warnings)
      .def("stats", [](const stitchcuda::torch::Generator& g) {
        auto s = g.stats();
        py::dict d;
        d["sequences"] = s.sequences, d["tokens"] = s.tokens;
        d["prefill"] = executor_stats(s.prefill), d["decode"] = executor_stats(s.decode);
        return d;
      });

  // next_tokens draws from a generator of the logits' device started at options.seed (the CPU's too).
  pm.def("next_tokens", [](const py::object& logits, const SamplingOptions& options) {
    if (!THPVariable_Check(logits.ptr())) invalid("the logits are a torch.Tensor [rows, vocab]");
    at::Tensor l = THPVariable_Unpack(logits.ptr());
    Result<at::Tensor> r;
    {
      py::gil_scoped_release release;
      r = stitchcuda::torch::next_tokens(l, options);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(unwrap(std::move(r))));
  }, py::arg("logits"), py::arg("options"));
}

}  // namespace

void bind_program(py::module_& m) {
  py::module_ pm = m.def_submodule("program", "the stitched program: builder, artifact, executor");

  py::class_<Program>(pm, "Program")
      .def("validate", [](const Program& p) { unwrap(p.validate()); })
      .def("plan", [](const Program& p) {
        BufferPlan plan = unwrap(p.plan());
        py::dict d;
        d["arena_bytes"] = plan.arena_bytes, d["live_bound_bytes"] = plan.live_bound_bytes;
        d["widest_step"] = plan.widest_step, d["unshared_bytes"] = plan.unshared_bytes;
        py::list places;
        for (const Placement& pl : plan.placements) {
          py::dict e;
          e["buffer"] = pl.buffer, e["storage"] = pl.storage, e["offset"] = pl.offset, e["bytes"] = pl.bytes;
          e["first_step"] = pl.first_step, e["last_step"] = pl.last_step, e["in_arena"] = pl.in_arena;
          e["allocated"] = pl.allocated;
          places.append(e);
        }
        d["placements"] = places;
        return d;
      })
      .def("has_weight_data", [](const Program& p, BufferId id) {
        auto it = p.weights.find(id);
        return it != p.weights.end() && !it->second.empty();
      })
      .def("set_weight_data", [](Program& p, BufferId id, const py::bytes& data) { p.weights[id] = std::string(data); })
      .def("drop_weight_data", [](Program& p, BufferId id) { p.weights.erase(id); })
      .def("serialize", [](const Program& p) { return py::bytes(p.serialize()); })
      .def_static("deserialize", [](const py::bytes& b) { return unwrap(Program::deserialize(std::string(b))); })
      .def("save", [](const Program& p, const std::string& path) { unwrap(p.save(path)); })
      .def_static("load", [](const std::string& path) { return unwrap(Program::load(path)); })
      .def("compile_kernels", [](Program& p, const std::string& arch) {
        py::gil_scoped_release release;
        auto r = compile_kernels(p, arch);
        py::gil_scoped_acquire acquire;
        unwrap(std::move(r));
      }, py::arg("arch") = "")
      .def_property_readonly("buffers", [](const Program& p) {
        py::list out;
        for (const Buffer& b : p.buffers) {
          py::dict d = spec_dict(b.spec);
          d["id"] = b.id, d["role"] = to_string(b.role), d["name"] = b.name;
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("steps", [](const Program& p) {
        py::list out;
        for (const Step& s : p.steps) out.append(step_dict(s));
        return out;
      })
      .def_property_readonly("kernels", [](const Program& p) {
        py::list out;
        for (const KernelSource& k : p.kernels) {
          py::dict d;
          d["name"] = k.name, d["source"] = k.source, d["options"] = k.options, d["arch"] = k.arch;
          d["signature"] = k.signature, d["cubin_bytes"] = k.cubin.size();
          out.append(d);
        }
        return out;
      })
      .def_property_readonly("precision", [](const Program& p) {
        py::dict d;
        d["matmul"] = to_string(p.precision.matmul), d["cudnn_tf32"] = p.precision.cudnn_tf32;
        return d;
      })
      .def_property_readonly("verified_on", [](const Program& p) {
        py::dict d;
        d["device"] = p.verified_on.device, d["arch"] = p.verified_on.arch, d["driver"] = p.verified_on.driver;
        d["cuda"] = p.verified_on.cuda, d["torch"] = p.verified_on.torch;
        return d;
      })
      .def_property_readonly("replay", [](const Program& p) {
        py::dict d;
        d["mode"] = to_string(p.replay.mode), d["reason"] = p.replay.reason;
        return d;
      })
      .def("set_replay", [](Program& p, const std::string& mode, std::string reason) {
        p.replay = {enum_of(mode, {Replay::unmeasured, Replay::graph, Replay::direct}, "replay mode"), std::move(reason)};
      }, py::arg("mode"), py::arg("reason") = "");

  py::class_<ProgramBuilder>(pm, "ProgramBuilder")
      .def(py::init<>())
      .def("input", [](ProgramBuilder& b, std::vector<std::int64_t> shape, const std::string& dtype,
                       std::optional<std::vector<std::int64_t>> strides, std::string name) {
        return b.input(spec_of(shape, dtype, strides), std::move(name));
      }, py::arg("shape"), py::arg("dtype") = "f32", py::arg("strides") = py::none(), py::arg("name") = "")
      .def("output", [](ProgramBuilder& b, std::vector<std::int64_t> shape, const std::string& dtype,
                        std::optional<std::vector<std::int64_t>> strides, std::string name) {
        return b.output(spec_of(shape, dtype, strides), std::move(name));
      }, py::arg("shape"), py::arg("dtype") = "f32", py::arg("strides") = py::none(), py::arg("name") = "")
      .def("intermediate", [](ProgramBuilder& b, std::vector<std::int64_t> shape, const std::string& dtype,
                              std::optional<std::vector<std::int64_t>> strides, std::string name) {
        return b.intermediate(spec_of(shape, dtype, strides), std::move(name));
      }, py::arg("shape"), py::arg("dtype") = "f32", py::arg("strides") = py::none(), py::arg("name") = "")
      .def("state", [](ProgramBuilder& b, std::vector<std::int64_t> shape, const std::string& dtype,
                       std::optional<std::vector<std::int64_t>> strides, std::string name) {
        return b.state(spec_of(shape, dtype, strides), std::move(name));
      }, py::arg("shape"), py::arg("dtype") = "f32", py::arg("strides") = py::none(), py::arg("name") = "")
      .def("weight", [](ProgramBuilder& b, std::vector<std::int64_t> shape, const std::string& dtype,
                        std::optional<py::bytes> data, std::optional<std::vector<std::int64_t>> strides, std::string name) {
        TensorSpec s = spec_of(shape, dtype, strides);
        std::string bytes = data ? std::string(*data) : std::string();
        if (!bytes.empty() && bytes.size() != s.storage_bytes())
          invalid("weight '" + name + "' is " + s.describe() + " (" + std::to_string(s.storage_bytes()) + " bytes) but " +
                  std::to_string(bytes.size()) + " bytes were given");
        return b.weight(std::move(s), std::move(bytes), std::move(name));
      }, py::arg("shape"), py::arg("dtype") = "f32", py::arg("data") = py::none(), py::arg("strides") = py::none(),
         py::arg("name") = "")
      .def("kernel", [](ProgramBuilder& b, std::string source, std::string name, std::vector<std::string> options,
                        std::vector<std::string> signature) {
        KernelSource k;
        k.source = std::move(source), k.name = std::move(name), k.options = std::move(options);
        k.signature = std::move(signature);
        return b.kernel(std::move(k));
      }, py::arg("source"), py::arg("name"), py::arg("options") = std::vector<std::string>{},
         py::arg("signature") = std::vector<std::string>{})
      .def("launch", [](ProgramBuilder& b, std::uint32_t kernel, std::vector<std::uint32_t> grid,
                        std::vector<std::uint32_t> block, const py::sequence& args, std::uint32_t shared_mem) {
        KernelLaunch l;
        l.kernel = kernel, l.grid = dim3(grid, "grid"), l.block = dim3(block, "block"), l.shared_mem_bytes = shared_mem;
        for (auto a : args) l.args.push_back(kernel_arg(a));
        b.launch(std::move(l));
      }, py::arg("kernel"), py::arg("grid"), py::arg("block"), py::arg("args"), py::arg("shared_mem") = 0)
      .def("matmul", [](ProgramBuilder& b, BufferId a, BufferId bb, BufferId c, std::optional<BufferId> bias,
                        bool ta, bool tb, std::int64_t batch, double alpha, double beta, const std::string& epilogue,
                        const std::string& precision) {
        Matmul mm;
        mm.a = a, mm.b = bb, mm.c = c, mm.bias = bias, mm.transpose_a = ta, mm.transpose_b = tb;
        mm.batch = batch, mm.alpha = alpha, mm.beta = beta;
        mm.epilogue = enum_of(epilogue, {Epilogue::none, Epilogue::relu, Epilogue::gelu, Epilogue::bias,
                                         Epilogue::bias_relu, Epilogue::bias_gelu}, "epilogue");
        mm.precision = enum_of(precision, {ComputePrecision::fp32, ComputePrecision::tf32x3, ComputePrecision::tf32,
                                                  ComputePrecision::bf16}, "precision");
        b.matmul(std::move(mm));
      }, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("bias") = py::none(), py::arg("transpose_a") = false,
         py::arg("transpose_b") = false, py::arg("batch") = 1, py::arg("alpha") = 1.0, py::arg("beta") = 0.0,
         py::arg("epilogue") = "none", py::arg("precision") = "fp32")
      .def("aten", [](ProgramBuilder& b, std::string op, std::vector<BufferId> inputs, std::vector<BufferId> outputs,
                      const py::dict& attributes) {
        Attributes attrs;
        for (auto [k, v] : attributes) {
          std::string key = py::str(k);
          attrs[key] = attribute_of(key, v);
        }
        b.aten(std::move(op), std::move(inputs), std::move(outputs), std::move(attrs));
      }, py::arg("op"), py::arg("inputs"), py::arg("outputs"), py::arg("attributes") = py::dict())
      .def("view", [](ProgramBuilder& b, const std::string& kind, BufferId source, std::vector<std::int64_t> shape,
                      std::optional<std::vector<std::int64_t>> strides, std::int64_t storage_offset) {
        const Buffer* src = b.peek().buffer(source);
        if (!src) invalid("view of buffer " + std::to_string(source) + ", which does not exist");
        return b.view(enum_of(kind, {ViewKind::reshape, ViewKind::permute, ViewKind::slice}, "view kind"), source,
                      spec_of(shape, to_string(src->spec.dtype), strides), storage_offset);
      }, py::arg("kind"), py::arg("source"), py::arg("shape"), py::arg("strides") = py::none(),
         py::arg("storage_offset") = 0)
      .def("precision", [](ProgramBuilder& b, const std::string& matmul, bool cudnn_tf32) {
        b.precision({enum_of(matmul, {ComputePrecision::fp32, ComputePrecision::tf32x3, ComputePrecision::tf32,
                                      ComputePrecision::bf16}, "precision"),
                     cudnn_tf32});
      }, py::arg("matmul") = "fp32", py::arg("cudnn_tf32") = true)
      .def("verified_on", [](ProgramBuilder& b, std::string device, std::string arch, std::string driver, std::string cuda,
                             std::string torch) {
        b.verified_on({std::move(device), std::move(arch), std::move(driver), std::move(cuda), std::move(torch)});
      }, py::arg("device") = "", py::arg("arch") = "", py::arg("driver") = "", py::arg("cuda") = "", py::arg("torch") = "")
      .def("build", [](ProgramBuilder& b) { return unwrap(b.build()); });

  py::class_<Executor, std::shared_ptr<Executor>>(pm, "Executor")
      .def(py::init([](const Program& p, std::optional<bool> graphs, int device, std::size_t workspace, bool device_launch,
                       std::size_t min_nodes, const py::dict& shared) {
        ExecutorOptions o;
        o.graphs = graphs, o.device = device, o.workspace_bytes = workspace, o.device_launch = device_launch;
        o.device_launch_min_nodes = min_nodes;
        return unwrap(Executor::create(p, o, shared_of(shared)));
      }), py::arg("program"), py::arg("graphs") = py::none(), py::arg("device") = -1, py::arg("workspace_bytes") = 32u << 20,
          py::arg("device_launch") = true, py::arg("device_launch_min_nodes") = 128, py::arg("shared") = py::dict())
      .def("run", [](Executor& e, const py::sequence& inputs, std::optional<py::sequence> outputs, std::uintptr_t stream) {
        auto in = tensors_of(inputs, "input");
        std::vector<at::Tensor> out;
        if (outputs) {
          out = tensors_of(*outputs, "output");
          Result<void> r;
          {
            py::gil_scoped_release release;
            r = e.run(in, out, stream_of(stream));
          }
          unwrap(std::move(r));
          return to_py(out);
        }
        Result<std::vector<at::Tensor>> r;
        {
          py::gil_scoped_release release;
          r = e.run(in, stream_of(stream));
        }
        return to_py(unwrap(std::move(r)));
      }, py::arg("inputs"), py::arg("outputs") = py::none(), py::arg("stream") = 0)
      .def("static_inputs", [](Executor& e, std::uintptr_t s) { return to_py(unwrap(e.static_inputs(stream_of(s)))); },
           py::arg("stream") = 0)
      .def("static_outputs", [](Executor& e, std::uintptr_t s) { return to_py(unwrap(e.static_outputs(stream_of(s)))); },
           py::arg("stream") = 0)
      .def("set_weight", [](Executor& e, BufferId id, const py::object& value) {
        if (!THPVariable_Check(value.ptr())) invalid("set_weight takes a torch.Tensor");
        unwrap(e.set_weight(id, THPVariable_Unpack(value.ptr())));
      })
      .def("release", [](Executor& e) {
        Result<void> r;
        {
          py::gil_scoped_release release;
          r = e.release();
        }
        unwrap(std::move(r));
      })
      .def("state", [](const Executor& e, BufferId id) {
        return py::reinterpret_steal<py::object>(THPVariable_Wrap(unwrap(e.state(id))));
      })
      .def("reset_states", [](Executor& e) {
        Result<void> r;
        {
          py::gil_scoped_release release;
          r = e.reset_states();
        }
        unwrap(std::move(r));
      })
      .def_property_readonly("states", &Executor::states)
      .def_property_readonly("inputs", &Executor::inputs)
      .def_property_readonly("outputs", &Executor::outputs)
      .def_property_readonly("device", &Executor::device)
      .def_property_readonly("warnings", &Executor::warnings)
      .def_property_readonly("program", &Executor::program, py::return_value_policy::reference_internal)
      .def("stats", [](const Executor& e) { return executor_stats(e.stats()); });

  bind_family(pm);
  bind_decode(pm);
}

}  // namespace stitchcuda::bindings
