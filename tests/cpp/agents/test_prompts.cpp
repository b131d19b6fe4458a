// Prompts: version lines, one-pass rendering (placeholders, conditional sections, values never re-read as
// syntax), load-time checks, override folders, and the shipped templates rendered with exactly the
// placeholders the agents pass.
#include "catch_shim.hpp"
#include "temp_dir.hpp"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include <stitchcuda/agents.hpp>

using stitchcuda::ErrorCode;
using stitchcuda::agents::PromptLibrary;
using stitchcuda_test::contains;

namespace {

/// Every required prompt, with `extra` replacing or adding some.
std::vector<std::pair<std::string, std::string>> texts(std::map<std::string, std::string> extra = {}) {
  std::map<std::string, std::string> all;
  for (const auto& name : PromptLibrary::required_names()) all[name] = "<!-- version: 2 -->\n" + name + ": {{reference}}\n";
  for (auto& [name, text] : extra) all[name] = text;
  return {all.begin(), all.end()};
}

std::string render(const std::string& tmpl, const std::map<std::string, std::string>& values) {
  auto lib = PromptLibrary::from_texts(texts({{"planner", tmpl}}));
  REQUIRE(lib);
  auto out = lib->render("planner", values);
  REQUIRE(out);
  return *out;
}

}  // namespace

TEST_CASE("the version line is read and taken off; the hash is of the text", "[agents]") {
  auto lib = PromptLibrary::from_texts(texts({{"verifier", "<!-- version: 7 -->\r\nSay {{x}}.\r\n"},
                                              {"coder_plan", "Say {{x}}.\n"},
                                              {"tight", "<!--version: 3-->\nSay {{x}}.\n"},
                                              {"extra", "<!-- revision: 3 -->\nSay {{x}}.\n"}}));
  REQUIRE(lib);
  const auto& p = lib->prompts();
  CHECK(p.at("verifier").version == "7");
  CHECK(p.at("verifier").text == "Say {{x}}.\n");  // version line gone, CRLF normalised
  CHECK(p.at("coder_plan").version == "0");        // no version line
  CHECK(p.at("tight").version == "3");            // spaces inside the comment are optional
  CHECK(p.at("extra").version == "0");             // another comment is text, not a version
  CHECK(contains(p.at("extra").text, "<!-- revision: 3 -->"));
  CHECK(p.at("verifier").sha256.size() == 64);
  CHECK(p.at("verifier").sha256 == p.at("coder_plan").sha256);  // same text, different version line
  CHECK(p.at("verifier").sha256 != p.at("planner").sha256);
  CHECK(p.at("verifier").path.empty());
}

TEST_CASE("render fills placeholders and keeps sections only for non-empty values", "[agents]") {
  const std::string tmpl =
      "Task: {{task}}\n"
      "{{#profile}}\n"
      "Profile:\n{{profile}}\n"
      "{{/profile}}\n"
      "Docs{{#docs}} ({{docs}}){{/docs}}.\n";
  CHECK(render(tmpl, {{"task", "gelu"}, {"profile", "k1 71%"}, {"docs", "tiling"}}) ==
        "Task: gelu\nProfile:\nk1 71%\nDocs (tiling).\n");
  // An empty value drops the section, its standalone tag lines included.
  CHECK(render(tmpl, {{"task", "gelu"}, {"profile", ""}, {"docs", ""}}) == "Task: gelu\nDocs.\n");
  // Sections of different keys nest; a tag is "alone on its line" only on a real line of the template.
  const std::string nested = "{{#a}}\n  A\n  {{#b}}\n  B\n  {{/b}}\n{{/a}}\nend";
  CHECK(render(nested, {{"a", "1"}, {"b", "1"}}) == "  A\n  B\nend");
  CHECK(render(nested, {{"a", "1"}, {"b", ""}}) == "  A\nend");
  CHECK(render(nested, {{"a", ""}, {"b", "1"}}) == "end");
  CHECK(render("{{#a}}{{#b}}\nB\n{{/b}}{{/a}}", {{"a", "1"}, {"b", "1"}}) == "\nB\n");
}

TEST_CASE("values are inserted verbatim, never read as template syntax", "[agents]") {
  const std::string code = "f'{{x}}' and {{#a}}{{/b}} and {{missing}}";
  CHECK(render("<{{reference}}>", {{"reference", code}}) == "<" + code + ">");
  // A value's final newline is not doubled where the template ends the line too.
  CHECK(render("```\n{{reference}}\n```", {{"reference", "x = 1\n"}}) == "```\nx = 1\n```");
  CHECK(render("{{reference}}!", {{"reference", "x\n"}}) == "x\n!");
  // Braces that are not a tag stay literal text.
  CHECK(render("{{ x }} {{\"k\": 1}} {{x-y}} {{reference}}", {{"reference", "r"}}) == "{{ x }} {{\"k\": 1}} {{x-y}} r");
}

TEST_CASE("render names every placeholder without a value", "[agents]") {
  auto lib = PromptLibrary::from_texts(texts({{"planner", "{{a}} {{#b}}{{c}}{{/b}} {{a}}"}}));
  REQUIRE(lib);
  auto out = lib->render("planner", {});
  REQUIRE_FALSE(out);
  CHECK(out.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(out.error().message, "'planner'"));
  CHECK(contains(out.error().message, "a, b, c"));  // all of them, even inside a section
  auto partly = lib->render("planner", {{"a", "1"}, {"b", ""}});
  REQUIRE_FALSE(partly);  // a dropped section's placeholders still need a value
  CHECK(contains(partly.error().message, "value for c ("));
  CHECK_FALSE(contains(partly.error().message, "a,"));
  auto unknown = lib->render("nope", {});
  REQUIRE_FALSE(unknown);
  CHECK(unknown.error().code == ErrorCode::NotFound);
  CHECK(contains(unknown.error().message, "coder_feedback, coder_plan, planner, replanner, verifier"));
}

TEST_CASE("malformed sections and missing prompts are load errors", "[agents]") {
  auto unclosed = PromptLibrary::from_texts(texts({{"planner", "x {{#profile}} y"}}));
  REQUIRE_FALSE(unclosed);
  CHECK(unclosed.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(unclosed.error().message, "planner"));
  CHECK(contains(unclosed.error().message, "{{#profile}}"));
  auto stray = PromptLibrary::from_texts(texts({{"planner", "x {{/profile}}"}}));
  REQUIRE_FALSE(stray);
  CHECK(contains(stray.error().message, "not open"));
  auto crossed = PromptLibrary::from_texts(texts({{"planner", "{{#a}}{{#b}}{{/a}}{{/b}}"}}));
  REQUIRE_FALSE(crossed);
  CHECK(crossed.error().code == ErrorCode::InvalidArgument);
  auto twice = PromptLibrary::from_texts(texts({{"planner", "{{#a}}{{#a}}{{/a}}{{/a}}"}}));
  REQUIRE_FALSE(twice);
  CHECK(contains(twice.error().message, "nested inside itself"));

  auto missing = PromptLibrary::from_texts({{"planner", "p"}, {"verifier", "v"}});
  REQUIRE_FALSE(missing);
  CHECK(missing.error().code == ErrorCode::NotFound);
  CHECK(contains(missing.error().message,
                 "coder_plan.md, coder_feedback.md, answer_model_new.md, answer_kernel_step.md, replanner.md"));
  CHECK_FALSE(contains(missing.error().message, "planner.md,"));
}

TEST_CASE("load reads a folder; an override folder replaces and adds prompts", "[agents]") {
  stitchcuda_test::TempDir shipped, custom;
  for (const auto& [name, text] : texts()) shipped.write(name + ".md", text);
  shipped.write("README.md", "not a prompt {{#broken}}");
  shipped.write("notes.txt", "ignored");
  custom.write("verifier.md", "<!-- version: 9 -->\nMine: {{candidate}}\n");
  custom.write("judge.md", "Judge {{candidate}}\n");

  auto base = PromptLibrary::load(shipped.str());
  REQUIRE(base);
  CHECK(base->prompts().size() == PromptLibrary::required_names().size());
  CHECK((*base->get("verifier"))->version == "2");
  CHECK((*base->get("verifier"))->path == (shipped.path() / "verifier.md").string());

  auto lib = PromptLibrary::load(shipped.str(), custom.str());
  REQUIRE(lib);
  CHECK(lib->prompts().size() == PromptLibrary::required_names().size() + 1);  // judge.md added
  auto verifier = lib->get("verifier");
  REQUIRE(verifier);
  CHECK((*verifier)->version == "9");
  CHECK((*verifier)->path == (custom.path() / "verifier.md").string());
  CHECK(lib->render("verifier", {{"candidate", "c"}}).value() == "Mine: c\n");
  CHECK(lib->render("judge", {{"candidate", "c"}}).value() == "Judge c\n");
  CHECK((*lib->get("planner"))->path == (shipped.path() / "planner.md").string());

  auto no_dir = PromptLibrary::load((shipped.path() / "nope").string());
  REQUIRE_FALSE(no_dir);
  CHECK(no_dir.error().code == ErrorCode::NotFound);
  CHECK(contains(no_dir.error().message, "nope"));
  auto no_override = PromptLibrary::load(shipped.str(), (custom.path() / "gone").string());
  REQUIRE_FALSE(no_override);
  CHECK(no_override.error().code == ErrorCode::NotFound);

  stitchcuda_test::TempDir partial;
  partial.write("planner.md", "p");
  auto incomplete = PromptLibrary::load(partial.str(), custom.str());
  REQUIRE_FALSE(incomplete);
  CHECK(incomplete.error().code == ErrorCode::NotFound);
  CHECK(contains(incomplete.error().message, "coder_plan.md"));
  CHECK_FALSE(contains(incomplete.error().message, "verifier.md"));  // the override supplies it

  custom.write("planner.md", "{{#profile}} open");
  auto bad = PromptLibrary::load(shipped.str(), custom.str());
  REQUIRE_FALSE(bad);
  CHECK(bad.error().code == ErrorCode::InvalidArgument);
  CHECK(contains(bad.error().message, (custom.path() / "planner.md").string()));
  CHECK(contains(bad.error().message, "profile"));
}

TEST_CASE("the shipped prompts render with exactly the placeholders the agents pass", "[agents]") {
  const auto folder = std::filesystem::path(STITCHCUDA_PROMPTS_DIR);  // tests.cmake
  auto lib = PromptLibrary::load(folder.string());
  REQUIRE(lib);
  const std::map<std::string, std::vector<std::string>> placeholders = {
      {"planner", {"reference", "hardware", "profile", "docs", "schema", "target"}},
      {"graph_planner", {"graph", "hardware", "docs", "max_targets"}},
      {"answer_kernel_step", {"target"}},
      {"coder_plan", {"reference", "plan", "hardware", "docs", "answer"}},
      {"coder_feedback", {"reference", "previous", "feedback", "plan", "hardware", "docs", "answer"}},
      {"answer_model_new", {}},
      {"replanner", {"reference", "hardware", "previous_plan", "history", "profile", "docs", "schema"}},
      {"verifier", {"reference", "candidate", "report", "hardware"}},
  };
  for (const auto& [name, keys] : placeholders) {
    INFO("prompt " << name);
    auto prompt = lib->get(name);
    REQUIRE(prompt);
    CHECK((*prompt)->version != "0");  // every shipped prompt says its version
    std::map<std::string, std::string> values;
    for (const auto& key : keys) values[key] = "<<" + key + " value>>";
    if (name == "planner") values["model_new"] = "", values["kernel_step"] = "1";  // sections: which answer
    // Succeeds only when the template uses no placeholder outside the set.
    auto full = lib->render(name, values);
    REQUIRE(full);
    for (const auto& key : keys) {
      INFO("placeholder " << key);
      CHECK(contains((*prompt)->text, "{{" + key + "}}"));  // every one of the set is used
      CHECK(contains(*full, "<<" + key + " value>>"));
      auto without = values;
      without.erase(key);
      auto missing = lib->render(name, without);
      REQUIRE_FALSE(missing);
      CHECK(contains(missing.error().message, key));
    }
    CHECK_FALSE(contains(*full, "{{"));  // no tag left unrendered
  }
  // Optional parts vanish when empty.
  std::map<std::string, std::string> planner = {
      {"reference", "R"}, {"hardware", "H"}, {"profile", ""}, {"docs", ""}, {"schema", "S"},
      {"model_new", "1"}, {"kernel_step", ""}, {"target", ""}};
  auto bare = lib->render("planner", planner);
  REQUIRE(bare);
  CHECK_FALSE(contains(*bare, "Profile of the reference"));
  CHECK_FALSE(contains(*bare, "Documentation"));
  CHECK(contains(*bare, "class ModelNew"));  // program mode plans a ModelNew...
  planner["model_new"] = "", planner["kernel_step"] = "1", planner["target"] = "- in0: float32[4, 8]";
  auto kernel = lib->render("planner", planner);
  REQUIRE(kernel);  // ...a graph target one kernel over its buffers
  CHECK_FALSE(contains(*kernel, "class ModelNew"));
  CHECK(contains(*kernel, "- in0: float32[4, 8]"));
  auto coder = lib->render("coder_plan", {{"reference", "R"}, {"plan", "P"}, {"hardware", "H"}, {"docs", ""},
                                          {"answer", "<<the contract>>"}});
  REQUIRE(coder);
  CHECK_FALSE(contains(*coder, "Documentation"));
  CHECK(contains(*coder, "<<the contract>>"));
  CHECK(coder->find("## How to write it") < coder->find("<<the contract>>"));  // the contract ends the prompt
  auto model_new = lib->render("answer_model_new", {});
  REQUIRE(model_new);
  CHECK(contains(*model_new, "## The contract your answer must meet"));
  CHECK(contains(*model_new, "jit.compile("));
  CHECK(contains(*model_new, "## Answer"));
  // The kernel step's contract (graph mode) renders with what the Coder passes, the target among it.
  std::map<std::string, std::string> coder_values = {{"reference", "R"}, {"plan", "P"}, {"hardware", "H"},
                                                     {"docs", ""}, {"target", "<<target>>"}, {"previous", ""},
                                                     {"feedback", ""}};
  auto step = lib->render("answer_kernel_step", coder_values);
  REQUIRE(step);
  CHECK_FALSE(contains(*step, "{{"));
  CHECK(contains(*step, "## Answer"));
  for (const char* name : {"answer_model_new", "answer_kernel_step"}) {
    INFO(name);
    CHECK(std::find(PromptLibrary::required_names().begin(), PromptLibrary::required_names().end(), name) !=
          PromptLibrary::required_names().end());
  }
}
