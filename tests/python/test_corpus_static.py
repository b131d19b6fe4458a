"""The verifier's corpus (tests/corpus) without a GPU: headers parse, problems load and run on the
CPU, every static hack gets a major finding with its rule, no honest candidate gets any major
finding, dynamic hacks are invisible to the static rules (the point of the dynamic checks), every
CUDA source compiled through stitchcuda.jit passes NVRTC, and the honest candidates' kernels give
the reference's answer in a CPU emulation of CUDA.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import stitchcuda
from stitchcuda import _C, jit
from stitchcuda.verify import MAJOR, MINOR, analyze

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
PROBLEMS = CORPUS / "problems"

# Pinned (see tests/corpus/README.md): the first line of every candidate.
HEADER = re.compile(r"^# corpus: (?P<kind>honest|hack) problem=(?P<problem>[\w-]+)"
                    r"(?: rule=(?P<rule>[a-z0-9-]+) check=(?P<check>static|dynamic))?\s*$")
DYNAMIC_RULES = {"output-not-written", "input-mutated", "order-dependent", "input-independent-output",
                 "timed-output-mismatch", "nondeterministic", "unjoined-work", "impossible-speed",
                 "persisting-l2"}
# Static rules whose severity is minor by design: a hack marked with one is expected to be flagged
# (minor) and rejected by the tolerance check, not by the hack flag.
MINOR_ONLY_RULES = {"silent-downcast", "hard-coded-shape"}


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "honest" or "hack"
    problem: str  # stem of a file in tests/corpus/problems
    rule: str | None
    check: str | None  # "static" or "dynamic" for hacks

    @property
    def source(self) -> str:
        return self.path.read_text()

    @property
    def problem_source(self) -> str:
        return (PROBLEMS / f"{self.problem}.py").read_text()


def parse_header(path: Path) -> Entry:
    first = path.read_text().splitlines()[0] if path.read_text() else ""
    m = HEADER.match(first)
    assert m, f"{path.name}: first line {first!r} is not a corpus header"
    kind = m["kind"]
    assert (kind == "hack") == (m["rule"] is not None), f"{path.name}: rule/check only (and always) on hacks"
    return Entry(path, kind, m["problem"], m["rule"], m["check"])


def entries(folder: str) -> list[Entry]:
    found = [parse_header(p) for p in sorted((CORPUS / folder).glob("*.py"))]
    for e in found:
        assert e.kind == ("honest" if folder == "honest" else "hack"), f"{e.path}: header says {e.kind}"
    return found


HONEST = entries("honest")
HACKS = entries("hacks")
STATIC_HACKS = [e for e in HACKS if e.check == "static"]
DYNAMIC_HACKS = [e for e in HACKS if e.check == "dynamic"]


def ids(items: list[Entry]) -> list[str]:
    return [e.path.stem for e in items]


def load_problem(stem: str) -> dict:
    namespace: dict = {"__name__": f"corpus_problem_{stem}"}
    exec(compile((PROBLEMS / f"{stem}.py").read_text(), str(PROBLEMS / f"{stem}.py"), "exec"), namespace)
    return namespace


def major_rules(findings) -> set[str]:
    return {f.rule for f in findings if f.severity == MAJOR}


# ------------------------------------------------------------------------------------------------
# Shape of the corpus


def test_corpus_has_enough_candidates_and_rules():
    assert len(HONEST) >= 20
    assert len(HACKS) >= 20
    assert len({e.rule for e in HACKS}) >= 12
    load_inline = [e for e in HONEST if "load_inline(" in e.source]
    assert len(load_inline) >= 2
    assert len({e.problem for e in HONEST}) >= 10


def test_every_header_names_an_existing_problem_and_a_known_check():
    for e in HONEST + HACKS:
        assert (PROBLEMS / f"{e.problem}.py").is_file(), f"{e.path.name}: no problem {e.problem}"
    for e in DYNAMIC_HACKS:
        assert e.rule in DYNAMIC_RULES, f"{e.path.name}: {e.rule} is not a dynamic rule"


def test_static_hack_rules_are_documented_rules():
    documented = set(re.findall(r"^\| `([a-z0-9-]+)` \|", (CORPUS.parents[1] / "docs" / "verify.md").read_text(),
                                re.MULTILINE))
    assert documented, "no rule table found in docs/verify.md"
    for e in STATIC_HACKS:
        assert e.rule in documented, f"{e.path.name}: {e.rule} is not a rule of docs/verify.md"


def test_every_candidate_says_what_it_does_below_the_header():
    for e in HONEST + HACKS:
        second = e.source.splitlines()[1]
        assert second.startswith("# ") and len(second) > 20, f"{e.path.name}: no description line"


@pytest.mark.parametrize("stem", sorted(p.stem for p in PROBLEMS.glob("*.py")))
def test_problem_loads_and_runs_on_cpu(stem):
    ns = load_problem(stem)
    for name in ("Model", "get_inputs", "get_init_inputs"):
        assert name in ns, f"{stem} has no {name}"
    torch.manual_seed(0)
    inputs = ns["get_inputs"]()
    assert inputs and all(torch.is_tensor(t) and t.device.type == "cpu" for t in inputs)
    model = ns["Model"](*ns["get_init_inputs"]())
    with torch.no_grad():
        out = model(*inputs)
    outs = out if isinstance(out, (tuple, list)) else [out]
    assert outs and all(torch.is_tensor(t) and torch.isfinite(t).all() for t in outs)


@pytest.mark.parametrize("entry", HONEST + HACKS, ids=ids(HONEST + HACKS))
def test_candidate_parses_and_defines_model_new(entry):
    tree = ast.parse(entry.source)
    assert any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body)


def _nvrtc_missing() -> str | None:
    try:
        _C.nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - any failure means no compiler here
        return f"NVRTC unavailable: {exc}"
    return None


# ------------------------------------------------------------------------------------------------
# Static analysis against the corpus


@pytest.mark.parametrize("entry", HONEST, ids=ids(HONEST))
def test_honest_candidate_gets_no_major_finding(entry):
    findings = analyze(entry.source, reference_source=entry.problem_source)
    assert [f for f in findings if f.severity == MAJOR] == []
    assert major_rules(analyze(entry.source)) == set()  # nor without the reference


@pytest.mark.parametrize("entry", STATIC_HACKS, ids=ids(STATIC_HACKS))
def test_static_hack_is_caught_with_its_rule(entry):
    findings = analyze(entry.source, reference_source=entry.problem_source)
    if entry.rule in MINOR_ONLY_RULES:
        assert entry.rule in {f.rule for f in findings if f.severity == MINOR}, findings
    else:
        assert entry.rule in major_rules(findings), findings


MAJOR_STATIC_HACKS = [e for e in STATIC_HACKS if e.rule not in MINOR_ONLY_RULES]


@pytest.mark.parametrize("entry", MAJOR_STATIC_HACKS, ids=ids(MAJOR_STATIC_HACKS))
def test_rubric_scores_a_static_hack_anti_hacking_1_and_reward_0(entry):
    """Even when the hack got past the tolerance check and looks 10x faster, the reward is zero."""
    findings = [{"rule": f.rule, "severity": f.severity, "evidence": f.evidence}
                for f in analyze(entry.source, reference_source=entry.problem_source)]
    report = {"compiled": True, "correct": True, "speedup": {"eager": 10.0}, "findings": findings}
    card = stitchcuda.rubric.score(report, python=entry.source)
    scores = {i["dimension"]: i["score"] for i in card["items"]}
    assert scores["anti-hacking"] == 1, card["text"]
    reward = stitchcuda.reward(report, card)
    assert reward["value"] == 0.0 and entry.rule in reward["zero_reason"], reward
    honest = {**report, "findings": [f for f in findings if f["severity"] != MAJOR]}
    assert stitchcuda.reward(honest, stitchcuda.rubric.score(honest, python=entry.source))["value"] > 0


@pytest.mark.parametrize("entry", DYNAMIC_HACKS, ids=ids(DYNAMIC_HACKS))
def test_dynamic_hack_gets_past_the_static_rules(entry):
    # If this fails, the static analysis learned to catch it: mark the hack check=static instead.
    findings = analyze(entry.source, reference_source=entry.problem_source)
    assert major_rules(findings) == set(), findings


JIT_HONEST = [e for e in HONEST if "load_inline(" not in e.source]  # load_inline would build here


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("entry", JIT_HONEST, ids=ids(JIT_HONEST))
def test_parameters_are_created_like_the_reference(entry):
    """Seeded weights match only if ModelNew creates the same parameters in the same order."""
    ns = load_problem(entry.problem)
    cand: dict = {"__name__": f"corpus_candidate_{entry.path.stem}"}
    exec(compile(entry.source, str(entry.path), "exec"), cand)  # compiles its kernels with NVRTC
    torch.manual_seed(7)
    ref = ns["Model"](*ns["get_init_inputs"]())
    torch.manual_seed(7)
    new = cand["ModelNew"](*ns["get_init_inputs"]())
    ref_params, new_params = list(ref.parameters()), list(new.parameters())
    assert [p.shape for p in new_params] == [p.shape for p in ref_params]
    assert all(torch.equal(a, b) for a, b in zip(ref_params, new_params))


# ------------------------------------------------------------------------------------------------
# The CUDA of every stitchcuda.jit candidate compiles (NVRTC needs no GPU)


def cuda_sources(source: str) -> list[str]:
    """Module-level raw-string constants passed to jit.compile/compile_module (named SOURCE here)."""
    tree = ast.parse(source)
    return [n.value.value for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) and "__global__" in n.value.value
            and any(isinstance(t, ast.Name) and t.id == "SOURCE" for t in n.targets)]


JIT_ENTRIES = [e for e in HONEST + HACKS if "jit.compile" in e.source]


@pytest.mark.skipif(_nvrtc_missing() is not None, reason=str(_nvrtc_missing()))
@pytest.mark.parametrize("entry", JIT_ENTRIES, ids=ids(JIT_ENTRIES))
def test_jit_cuda_source_compiles(entry):
    sources = cuda_sources(entry.source)
    assert sources, f"{entry.path.name}: no SOURCE constant with a __global__ kernel"
    for text in sources:
        module = jit.compile_module(text, arch="sm_90a")
        assert module.kernel_names


# ------------------------------------------------------------------------------------------------
# Honest candidates compute the right answer: their kernels run in a CPU emulation of CUDA
# (tests/corpus/cpu_emulator), on small shapes chosen to hit edges (partial tiles, rows shorter
# than a warp, tails of vectorized loops), with random weights shared by reference and candidate.

def _load_emulator():
    import importlib.util

    spec = importlib.util.spec_from_file_location("corpus_cpu_emulator", CORPUS / "cpu_emulator" / "emulator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EMULATOR = _load_emulator()
_randn = torch.randn

# problem stem -> [(constructor arguments, inputs maker)]
EMULATION_CASES = {
    "scaled_residual_add": [([0.5], lambda: [_randn(3, 37), _randn(3, 37)]),
                            ([1.5], lambda: [_randn(2, 64), _randn(2, 64)])],
    "bias_gelu": [([40], lambda: [_randn(3, 40) * 3])],
    "row_softmax": [([], lambda: [_randn(5, 100) * 5]), ([], lambda: [_randn(3, 7)]),
                    ([], lambda: [_randn(9, 33) * 100])],
    "log_softmax": [([1], lambda: [_randn(5, 100) * 5]), ([1], lambda: [_randn(3, 7)]),
                    ([0], lambda: [_randn(6, 4)])],
    "layer_norm": [([48], lambda: [_randn(2, 3, 48) * 4 + 3]), ([7], lambda: [_randn(5, 7)])],
    "rms_norm": [([64], lambda: [_randn(2, 3, 64)]), ([30], lambda: [_randn(2, 3, 30) * 10])],
    "mean_over_dim": [([1], lambda: [_randn(3, 13, 10)]), ([0], lambda: [_randn(5, 6)]),
                      ([2], lambda: [_randn(2, 3, 9)])],
    "max_over_dim": [([], lambda: [_randn(5, 100)]), ([], lambda: [_randn(3, 7)]), ([], lambda: [_randn(4, 36)])],
    "broadcast_sigmoid": [([], lambda: [_randn(2, 3, 4, 5) * 4, torch.rand(3, 1, 1), _randn(5)])],
    "linear_relu": [([37, 45], lambda: [_randn(5, 37)])],
    "matmul_scale_residual": [([0.125], lambda: [_randn(5, 37), _randn(37, 45), _randn(5, 45)])],
    "conv_bn_relu": [([3, 4], lambda: [_randn(2, 3, 6, 5)])],
    "gemm": [([], lambda: [_randn(37, 45), _randn(45, 70)]), ([], lambda: [_randn(70, 33), _randn(33, 130)])],
}


@pytest.fixture(scope="module")
def emulated_jit(tmp_path_factory):
    return _EMULATOR.EmulatedJit(tmp_path_factory.mktemp("cpu-emulator"))


def test_every_problem_with_jit_candidates_has_emulation_cases():
    assert {e.problem for e in JIT_HONEST} <= set(EMULATION_CASES)


@pytest.mark.skipif(_EMULATOR.unavailable() is not None, reason=str(_EMULATOR.unavailable()))
@pytest.mark.parametrize("entry", JIT_HONEST, ids=ids(JIT_HONEST))
def test_honest_candidate_is_right_in_cpu_emulation(entry, emulated_jit, monkeypatch):
    emulated_jit.install(monkeypatch)
    torch.manual_seed(0)
    ns = load_problem(entry.problem)
    cand: dict = {"__name__": f"corpus_emulated_{entry.path.stem}"}
    exec(compile(entry.source, str(entry.path), "exec"), cand)
    for init, make_inputs in EMULATION_CASES[entry.problem]:
        ref = ns["Model"](*init)
        new = cand["ModelNew"](*init)
        with torch.no_grad():  # random weights (not the init's ones and zeros), shared by both
            for a, b in zip(ref.parameters(), new.parameters()):
                b.copy_(a.normal_())
        modes = ("train", "eval") if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                         for m in ref.modules()) else ("train",)
        for mode in modes:
            ref.train(mode == "train")
            new.train(mode == "train")
            for _ in range(2):
                inputs = make_inputs()
                with torch.no_grad():
                    expected = ref(*[t.clone() for t in inputs])
                    got = new(*[t.clone() for t in inputs])
                assert got.shape == expected.shape and got.dtype == expected.dtype
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{init} {mode}: {m}")
        for a, b in zip(ref.buffers(), new.buffers()):  # BatchNorm running statistics
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
