// Python face of stitchcuda::llm (thin; stitchcuda/llm.py shapes the API): connect, Python callables
// as backends through a trampoline, calls waited for with the GIL released and Ctrl-C watched.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include <stitchcuda/llm.hpp>

#include "errors.hpp"
#include "interrupt.hpp"

namespace py = pybind11;
using namespace stitchcuda;

namespace stitchcuda::bindings {
namespace {


std::vector<llm::Message> to_messages(const py::handle& seq) {
  if (!py::isinstance<py::sequence>(seq) || py::isinstance<py::str>(seq))
    invalid("messages must be a list of {'role': ..., 'content': ...} dicts");
  std::vector<llm::Message> out;
  for (auto item : seq.cast<py::sequence>()) {
    if (!py::isinstance<py::dict>(item)) invalid("each message must be a dict with 'role' and 'content'");
    auto d = item.cast<py::dict>();
    if (!d.contains("role") || !d.contains("content")) invalid("each message needs 'role' and 'content'");
    out.push_back({d["role"].cast<std::string>(), d["content"].cast<std::string>()});
  }
  return out;
}

llm::Options to_options(const py::dict& d) {
  check_keys(d,
             {"temperature", "top_p", "max_tokens", "stop", "seed", "json_schema", "extra", "stream", "allow_truncated",
              "connect_timeout", "timeout", "cancel"},
             "completion option");
  llm::Options o;
  for (auto [k, v] : d) {
    if (v.is_none()) continue;
    const std::string key = py::str(k);
    if (key == "temperature") o.temperature = v.cast<double>();
    else if (key == "top_p") o.top_p = v.cast<double>();
    else if (key == "max_tokens") o.max_tokens = v.cast<int>();
    else if (key == "stop") o.stop = v.cast<std::vector<std::string>>();
    else if (key == "seed") o.seed = v.cast<std::int64_t>();
    else if (key == "json_schema") o.json_schema = v.cast<std::string>();
    else if (key == "extra") o.extra_json = v.cast<std::string>();
    else if (key == "stream") o.stream = v.cast<bool>();
    else if (key == "allow_truncated") o.allow_truncated = v.cast<bool>();
    else if (key == "connect_timeout") o.connect_timeout_s = v.cast<double>();
    else if (key == "timeout") o.timeout_s = v.cast<double>();
    else if (key == "cancel") o.cancel = v.cast<llm::CancelToken>();
  }
  return o;
}

llm::ConnectOptions to_connect_options(const py::dict& d) {
  check_keys(d,
             {"api_key_env", "api_key", "organization", "headers", "anthropic_version", "max_reply_bytes",
              "replay_match", "max_attempts", "initial_backoff", "max_backoff", "jitter", "max_retry_after",
              "requests_per_minute", "tokens_per_minute", "prompt_price", "completion_price", "record"},
             "connect option");
  llm::ConnectOptions o;
  auto& server = o.server;
  auto& retry = o.reliability.retry;
  for (auto [k, v] : d) {
    if (v.is_none()) continue;
    const std::string key = py::str(k);
    if (key == "api_key_env") server.api_key_env = v.cast<std::string>();
    else if (key == "api_key") server.api_key = v.cast<std::string>();
    else if (key == "organization") server.organization = v.cast<std::string>();
    else if (key == "headers")
      for (auto [name, value] : v.cast<py::dict>()) server.headers.emplace_back(py::str(name), py::str(value));
    else if (key == "anthropic_version") server.anthropic_version = v.cast<std::string>();
    else if (key == "max_reply_bytes") server.max_reply_bytes = v.cast<std::size_t>();
    else if (key == "replay_match") {
      const auto match = v.cast<std::string>();
      if (match != "hash" && match != "order") invalid("replay_match = '" + match + "' is not one of 'hash', 'order'");
      o.replay_match = match == "hash" ? llm::ReplayMatch::Hash : llm::ReplayMatch::Order;
    } else if (key == "max_attempts") retry.max_attempts = v.cast<int>();
    else if (key == "initial_backoff") retry.initial_backoff_s = v.cast<double>();
    else if (key == "max_backoff") retry.max_backoff_s = v.cast<double>();
    else if (key == "jitter") retry.jitter = v.cast<double>();
    else if (key == "max_retry_after") retry.max_retry_after_s = v.cast<double>();
    else if (key == "requests_per_minute") o.reliability.limits.requests_per_minute = v.cast<double>();
    else if (key == "tokens_per_minute") o.reliability.limits.tokens_per_minute = v.cast<double>();
    else if (key == "prompt_price") o.reliability.prices.prompt_per_million = v.cast<double>();
    else if (key == "completion_price") o.reliability.prices.completion_per_million = v.cast<double>();
    else if (key == "record") o.reliability.record_path = v.cast<std::string>();
  }
  return o;
}

py::dict usage_dict(const llm::Usage& u) {
  py::dict d;
  d["prompt_tokens"] = u.prompt_tokens;
  d["completion_tokens"] = u.completion_tokens;
  d["total_tokens"] = u.total_tokens;
  return d;
}

py::dict completion_dict(const llm::Completion& c) {
  py::dict d;
  d["text"] = c.text;
  d["finish_reason"] = c.finish_reason;
  d["usage"] = usage_dict(c.usage);
  d["latency_ms"] = c.latency_ms;
  d["model"] = c.model;
  d["id"] = c.id;
  d["attempts"] = c.attempts;
  return d;
}

// The options a Python backend sees: the ones that were set.
py::dict options_dict(const llm::Options& o) {
  py::dict d;
  if (o.temperature) d["temperature"] = *o.temperature;
  if (o.top_p) d["top_p"] = *o.top_p;
  if (o.max_tokens) d["max_tokens"] = *o.max_tokens;
  if (!o.stop.empty()) d["stop"] = o.stop;
  if (o.seed) d["seed"] = *o.seed;
  if (!o.json_schema.empty()) d["json_schema"] = o.json_schema;
  if (!o.extra_json.empty()) d["extra"] = o.extra_json;
  return d;
}

std::int64_t int_or_zero(const py::dict& d, const char* key) {
  return d.contains(key) && !d[key].is_none() ? d[key].cast<std::int64_t>() : 0;
}

std::string text_or_empty(const py::dict& d, const char* key) {
  return d.contains(key) && !d[key].is_none() ? py::str(d[key]).cast<std::string>() : std::string();
}

// The trampoline: a Python callable as a Backend. stitchcuda/llm.py normalizes what the user gave
// into fn(messages: list[dict], options: dict) -> str | dict.
class PythonBackend final : public llm::Backend {
 public:
  PythonBackend(py::object fn, std::string name) : Backend(std::move(name)), fn_(std::move(fn)) {}

  ~PythonBackend() override {
    py::gil_scoped_acquire gil;  // the last reference may be dropped by a thread without the GIL
    fn_ = py::object();
  }

  Result<llm::Completion> complete(const std::vector<llm::Message>& messages, const llm::Options& options,
                                   const llm::TextCallback& on_text) override {
    const auto start = std::chrono::steady_clock::now();
    llm::Completion c;
    {
      py::gil_scoped_acquire gil;
      try {
        py::list list;
        for (const auto& m : messages) {
          py::dict d;
          d["role"] = m.role;
          d["content"] = m.content;
          list.append(d);
        }
        py::object out = fn_(list, options_dict(options));
        if (py::isinstance<py::str>(out)) {
          c.text = out.cast<std::string>();
          c.finish_reason = "stop";
        } else if (py::isinstance<py::dict>(out)) {
          auto d = out.cast<py::dict>();
          if (!d.contains("text") && !d.contains("content"))
            return fail(ErrorCode::LlmError, "the Python backend " + name() +
                                                 " returned a dict without 'text'; return a str, or a dict with "
                                                 "'text' (and optionally finish_reason, usage, model, id)");
          c.text = text_or_empty(d, d.contains("text") ? "text" : "content");
          c.finish_reason = d.contains("finish_reason") ? text_or_empty(d, "finish_reason") : "stop";
          if (d.contains("usage") && py::isinstance<py::dict>(d["usage"])) {
            auto u = d["usage"].cast<py::dict>();
            c.usage.prompt_tokens = int_or_zero(u, "prompt_tokens");
            c.usage.completion_tokens = int_or_zero(u, "completion_tokens");
            c.usage.total_tokens = u.contains("total_tokens") ? int_or_zero(u, "total_tokens")
                                                              : c.usage.prompt_tokens + c.usage.completion_tokens;
          }
          c.model = text_or_empty(d, "model");
          c.id = text_or_empty(d, "id");
        } else {
          return fail(ErrorCode::LlmError, "the Python backend " + name() + " returned " +
                                               std::string(py::str(py::type::handle_of(out).attr("__name__"))) +
                                               "; return a str, or a dict with 'text'");
        }
      } catch (py::error_already_set& e) {
        std::string trace;
        try {
          auto lines = py::module_::import("traceback").attr("format_exception")(e.type(), e.value(), e.trace());
          trace = py::str("").attr("join")(lines).cast<std::string>();
        } catch (py::error_already_set&) {
          trace = e.what();
        }
        return fail(ErrorCode::LlmError, "the Python backend " + name() + " raised " +
                                             std::string(py::str(e.type().attr("__name__"))) + ": " +
                                             std::string(py::str(e.value())),
                    trace);
      } catch (const std::exception& e) {  // a value that does not convert, e.g. usage counts that are not ints
        return fail(ErrorCode::LlmError,
                    "the Python backend " + name() + " returned a reply that cannot be read: " + e.what());
      }
    }
    if (options.stream && on_text && !c.text.empty()) on_text(c.text);  // outside the GIL: it takes it itself
    c.latency_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return c;
  }

 private:
  py::object fn_;
};

// The call runs off this thread (run_interruptible) so that Ctrl-C is seen while the GIL is released;
// a signal or an exception from on_text cancels it and is raised here.
py::dict complete(llm::Backend& backend, const py::handle& messages, const py::dict& options, py::object on_text) {
  const auto list = to_messages(messages);
  llm::Options opts = to_options(options);  // Ctrl-C and a failing callback cancel through opts.cancel
  PendingError pending;
  pending.cancel = opts.cancel;
  llm::TextCallback callback;
  if (!on_text.is_none()) {
    callback = [&](std::string_view piece) {
      py::gil_scoped_acquire gil;
      if (pending.set()) return;
      try {
        on_text(py::str(piece.data(), piece.size()));
      } catch (py::error_already_set& e) {
        pending.keep(std::move(e));  // cancels the call through opts.cancel
      }
    };
  }
  Result<llm::Completion> result =
      run_interruptible<llm::Completion>([&] { return backend.complete(list, opts, callback); }, pending, "the model call");
  pending.raise();
  return completion_dict(unwrap(std::move(result)));
}

py::dict totals_dict(const llm::Totals& t) {
  py::dict d;
  d["calls"] = t.calls;
  d["attempts"] = t.attempts;
  d["retries"] = t.retries;
  d["failures"] = t.failures;
  d["usage"] = usage_dict(t.usage);
  d["cost_usd"] = t.cost_usd;
  return d;
}

}  // namespace

void bind_llm(py::module_& m) {
  py::class_<llm::CancelToken>(m, "LlmCancelToken")
      .def(py::init<>())
      .def("cancel", &llm::CancelToken::cancel)
      .def_property_readonly("cancelled", &llm::CancelToken::cancelled);

  py::class_<llm::ReliableBackend, std::shared_ptr<llm::ReliableBackend>>(m, "LlmBackend")
      .def_property_readonly("name", [](const llm::ReliableBackend& b) { return b.name(); })
      .def("complete", [](llm::ReliableBackend& b, py::handle messages, const py::dict& options,
                          py::object on_text) { return complete(b, messages, options, std::move(on_text)); },
           py::arg("messages"), py::arg("options") = py::dict(), py::arg("on_text") = py::none())
      .def("totals", [](const llm::ReliableBackend& b) { return totals_dict(b.totals()); });

  m.def("llm_connect", [](const std::string& spec, const py::dict& options) {
    return unwrap(llm::connect(spec, to_connect_options(options)));
  }, py::arg("spec"), py::arg("options") = py::dict());
  m.def("llm_connect_callable", [](py::object fn, const std::string& name, const py::dict& options) {
    auto o = to_connect_options(options);
    return unwrap(llm::ReliableBackend::wrap(std::make_shared<PythonBackend>(std::move(fn), name), o.reliability));
  }, py::arg("fn"), py::arg("name"), py::arg("options") = py::dict());
  m.def("llm_scripted", [](const std::vector<std::pair<std::string, std::vector<std::string>>>& rules,
                           const std::string& name, const py::dict& options) {
    std::vector<llm::ScriptRule> script;
    for (const auto& [pattern, replies] : rules) script.push_back({pattern, replies});
    auto inner = unwrap(llm::scripted_backend(std::move(script), name));
    return unwrap(llm::ReliableBackend::wrap(std::move(inner), to_connect_options(options).reliability));
  }, py::arg("rules"), py::arg("name") = "scripted", py::arg("options") = py::dict());
  m.def("llm_parse_spec", [](const std::string& spec) {
    auto s = unwrap(llm::parse_spec(spec));
    return py::make_tuple(s.provider, s.model, s.base_url);
  }, py::arg("spec"));
  m.def("llm_known_providers", &llm::known_providers);
  m.def("llm_request_hash", [](py::handle messages, const py::dict& options) {
    return llm::request_hash(to_messages(messages), to_options(options));
  }, py::arg("messages"), py::arg("options") = py::dict());
}

}  // namespace stitchcuda::bindings
