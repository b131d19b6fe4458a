// Bindings of the agents layer: retrieval over the documentation corpus.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stitchcuda/agents.hpp>

#include "errors.hpp"

namespace py = pybind11;

namespace stitchcuda::bindings {

void bind_agents(py::module_& m) {
  using stitchcuda::agents::Retriever;
  using stitchcuda::agents::Snippet;
  py::module_ am = m.def_submodule("agents", "retrieval for the Planner and Coder");
  auto as_dict = [](const Snippet& s) {
    py::dict d;
    d["id"] = s.id, d["title"] = s.title, d["text"] = s.text, d["score"] = s.score;
    return d;
  };
  py::class_<Retriever>(am, "Retriever")
      .def_static("from_folder", [](const std::string& dir) { return unwrap(Retriever::from_folder(dir)); })
      .def_static("from_documents", [](std::vector<std::pair<std::string, std::string>> docs) {
        return Retriever::from_documents(std::move(docs));
      })
      .def("search", [as_dict](const Retriever& r, const std::string& query, std::size_t k) {
        py::list out;
        for (const Snippet& s : r.search(query, k)) out.append(as_dict(s));
        return out;
      }, py::arg("query"), py::arg("k") = 3)
      .def("snippets", [as_dict](const Retriever& r) {
        py::list out;
        for (const Snippet& s : r.snippets()) out.append(as_dict(s));
        return out;
      })
      .def_static("tokenize", &Retriever::tokenize);
}

}  // namespace stitchcuda::bindings
