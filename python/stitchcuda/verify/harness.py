"""Runs one verification inside a worker process: loads the reference and the candidate, checks
correctness over varied trials with poisoned outputs and both run orders, applies the dynamic
anti-hacking rules, and times the candidate against eager and torch.compile in the same run.

Everything the candidate does happens here, never in the caller's process (see pool.py).
"""

from __future__ import annotations

import ast
import copy
import gc
import re
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

from ..errors import CompileError
from .config import DISTRIBUTIONS, VerifyConfig
from .compare import OutputError, compare_output, first_difference, fp64_error  # first_difference: re-exported
from .tolerance import HighPrecision, judge_outputs, wants_reference
from .report import VerifyReport, build_feedback
from .static import MAJOR, MINOR
from .task import Task, TaskError, load_source_module

__all__ = ["run_job", "classify_exception", "map_compile_log", "first_difference", "trial_inputs", "timed_seeds",
           "refilled", "bytes_moved", "flatten", "clone_inputs", "to_host", "non_finite", "output_rms", "time_cpu"]

NAN_POISON = float("nan")
SENTINEL = 7777.0  # second poison: an unwritten element holds it in every run
_compiled_references: dict[tuple[str, int, str], Any] = {}  # worker-lifetime torch.compile cache
_input_cache: dict[tuple[str, int, str, str], list[Any]] = {}  # generated inputs, by task/seed/distribution
_input_cache_bytes: dict[tuple[str, int, str, str], int] = {}
INPUT_CACHE_BYTES = 4 << 30


class _Stop(Exception):
    """Ends the job early; the report already says why."""


def classify_exception(exc: BaseException) -> str:
    """Error kind for an exception raised by candidate code."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, CompileError):
        return "compile"
    if isinstance(exc, MemoryError) or "OutOfMemoryError" in type(exc).__name__ \
            or re.search(r"out of memory|CUDA_ERROR_OUT_OF_MEMORY", text):
        return "oom"
    # The fault first: PyTorch appends "Compile with TORCH_USE_CUDA_DSA to enable device-side assertions"
    # to every CUDA error, an illegal address included.
    if re.search(r"illegal memory access|ILLEGAL_ADDRESS|misaligned address|MISALIGNED_ADDRESS|"
                 r"illegal instruction|ILLEGAL_INSTRUCTION", text, re.I):
        return "illegal-address"
    if re.search(r"device-side assert triggered|CUDA_ERROR_ASSERT", text, re.I):
        return "device-assert"
    if "Error building extension" in text or "ninja" in text and "build" in text.lower():
        return "compile"
    return "runtime"


def context_poisoned(exc: BaseException) -> bool:
    """A sticky CUDA error: the worker's context is unusable and the worker must be replaced."""
    return classify_exception(exc) in ("device-assert", "illegal-address") or \
        bool(re.search(r"CUDA error|CUDA_ERROR|cudaError", str(exc)))


def map_compile_log(exc: CompileError, candidate_source: str) -> str:
    """The NVRTC diagnostics with their lines mapped from the kernel source to the candidate file
    (through the string literal that holds the CUDA)."""
    literals = []
    try:
        for node in ast.walk(ast.parse(candidate_source)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "\n" in node.value:
                literals.append(node)
    except (SyntaxError, ValueError, RecursionError):
        pass
    out = []
    for d in getattr(exc, "diagnostics", []):
        line = None
        for lit in literals:
            lines = lit.value.split("\n")
            exact = lit.end_lineno - lit.lineno == lit.value.count("\n")
            if exact and 0 < d.line <= len(lines) and d.source_line and lines[d.line - 1].strip() == d.source_line.strip():
                line = lit.lineno + d.line - 1
                break
        where = f"line {line}" if line else f"{d.file}:{d.line}"
        out.append(f"{where}: {d.severity}: {d.message}" + (f"\n    {d.source_line.strip()}" if d.source_line else ""))
    return "\n".join(out) or (getattr(exc, "log", "") or str(exc))


# ----------------------------------------------------------------------------------------------


def run_job(job: dict[str, Any], progress: Callable[[str], None],
            shipped: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """Verifies a model job (jobs.ModelJob as a dict: "reference" Task spec, "candidate" source,
    "candidate_name", "config" VerifyConfig dict); returns the report as a dict plus "recycle" (the worker
    should be replaced: sticky CUDA error, patched timing functions). ``shipped``, when given, receives
    the outputs the judge re-checks: "trials" (the candidate's outputs of each trial, on the CPU) and
    "timed" (those of the last timed call of each input set)."""
    started = time.perf_counter()
    report = VerifyReport()
    run = _Run(job, report, progress)
    try:
        run.execute()
    except _Stop:
        pass
    except Exception as exc:  # a harness-level failure still becomes a report
        kind = classify_exception(exc)
        run.recycle |= context_poisoned(exc)
        report.fail(kind, f"{type(exc).__name__}: {exc}")
        report.timing.setdefault("harness_traceback", traceback.format_exc(limit=6)[-2000:])
    finally:
        run.after()
        if shipped is not None:
            shipped.update(trials=run.shipped_trials, timed=run.shipped_timed)
        # Drop the candidate's (and reference's) modules and tensors before the next job.
        for name in [n for n in sys.modules if n.startswith(("_stitchcuda_candidate_", "_stitchcuda_reference_"))]:
            del sys.modules[name]
        run.release()
    if report.error:
        report.correct = False
    if not report.correct:  # the speed of a wrong answer means nothing; the timing dict keeps the facts
        report.speedup = {"eager": None, "compile": None}
    report.hack = any(f.severity == MAJOR for f in report.findings)
    report.compile_log = run.compile_log[-20000:]  # nvcc logs of load_inline builds can be long
    report.feedback = build_feedback(report)
    report.wall_s = time.perf_counter() - started
    data = report.to_dict()
    # A candidate the static rules saw patching library functions may have changed anything.
    data["recycle"] = run.recycle or bool(job.get("recycle_after"))
    return data


class _Run:
    def __init__(self, job: dict[str, Any], report: VerifyReport, progress: Callable[[str], None]) -> None:
        self.job, self.report, self.progress = job, report, progress
        self.config = VerifyConfig.from_dict(job["config"])
        self.recycle = False
        self.compile_log = ""
        self.cuda = False
        self.flags_before = _precision_flags()
        self.shipped_trials: list[list[Any]] = []  # the candidate's outputs per trial, for the judge
        self.shipped_timed: list[Any] = []

    # ---- steps

    def execute(self) -> None:
        r, cfg = self.report, self.config
        try:
            self.task = Task.from_spec(self.job["reference"])
        except TaskError as exc:
            r.fail("bad-reference", str(exc))
            raise _Stop
        self.tolerance = cfg.tolerance or self.task.tolerance
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            r.fail("bad-reference", "device 'cuda' was asked for but this worker sees no GPU; use "
                                    "VerifyConfig(device='cpu') for a CPU-only check.")
            raise _Stop
        self.device = torch.device("cuda", torch.cuda.current_device()) if device.startswith("cuda") \
            else torch.device("cpu")
        self.cuda = self._gpu_steps()
        self.seeds = cfg.trial_seeds()
        if self.cuda:
            self.gpu = gpu = self._gpu_module()
            self.persisting = gpu.PersistingL2()
            self.persisting.reset()
            r.timing["persisting_l2_check"] = self.persisting.available or self.persisting.reason

        # The reference first: a broken reference is not the candidate's fault.
        try:
            self.init_inputs = self.task.init_inputs()
            # Left in the mode it was built in, as KernelBench does (the candidate is too).
            self.reference = self._to_device(self.task.build_reference(self.seeds[0]))
            self.high = HighPrecision(self.reference)  # 16-bit outputs are judged against its fp64 forward
        except TaskError as exc:
            r.fail("bad-reference", str(exc))
            raise _Stop
        except Exception as exc:
            r.fail("bad-reference", f"the reference could not be built on {self.device}: {type(exc).__name__}: {exc}")
            raise _Stop

        if cfg.timing_iters > 0 and self.job.get("baselines") == "judge":
            self._calibrate()
        self.progress("compile")
        self.candidate = self._load_candidate()
        r.compiled = True
        self._check_persisting("after ModelNew was constructed")
        self.progress("run")
        with torch.no_grad():
            self._trials()
            if r.correct and cfg.timing_iters > 0:
                self._timing()

    # Seams: which steps run and with what GPU backend (tests drive the GPU-only logic with a fake).
    def _gpu_steps(self) -> bool:
        """Poisoning, L2 flush, persisting-L2 checks, event timing and CUPTI run on a CUDA device."""
        return self.device.type == "cuda"

    def _gpu_module(self):
        from . import gpu
        return gpu

    def after(self) -> None:
        # Process-wide state a candidate may have changed must not leak into the next candidate.
        changed = [k for k, v in _precision_flags().items() if self.flags_before.get(k) != v]
        if changed:
            self.report.add("silent-downcast", MINOR, "the candidate changed process-wide precision "
                            "settings while it ran; they were restored.", ", ".join(changed))
            _restore_precision_flags(self.flags_before)
        if self.cuda:
            patched = self.gpu.patched_functions()
            if patched:
                self.report.add("patches-timing", MAJOR, "the candidate replaced timing or "
                                "synchronization functions; the harness used its own copies.",
                                ", ".join(patched))
                self.recycle = True
            try:
                self.persisting.reset()
                self.gpu.sync()
            except Exception as exc:
                self.recycle = True
                if self.report.error is None:
                    self.report.fail(classify_exception(exc), f"{type(exc).__name__}: {exc}")

    def release(self) -> None:
        for name in ("candidate", "reference", "task"):
            self.__dict__.pop(name, None)
        gc.collect()
        if self.cuda and not self.recycle:
            try:
                torch.cuda.empty_cache()
            except Exception:
                self.recycle = True

    def _load_candidate(self) -> torch.nn.Module:
        r = self.report
        source, name = self.job["candidate"], self.job.get("candidate_name") or "<candidate>"
        try:
            ast.parse(source)
        except SyntaxError as exc:
            r.fail("bad-candidate", f"the candidate is not valid Python: {exc.msg} (line {exc.lineno}).")
            raise _Stop
        except (ValueError, RecursionError) as exc:
            r.fail("bad-candidate", f"the candidate cannot be parsed: {exc}")
            raise _Stop
        try:
            module = load_source_module(source, name, "candidate")
        except (Exception, SystemExit) as exc:  # sys.exit() in a candidate is its failure
            self._fail_candidate(exc, "while loading (module level)", "load")
        model_new = getattr(module, "ModelNew", None)
        if not (isinstance(model_new, type) and issubclass(model_new, torch.nn.Module)):
            r.fail("bad-candidate", "the candidate defines no ModelNew class (an nn.Module)." if model_new is None
                   else "ModelNew is not an nn.Module class.")
            raise _Stop
        torch.manual_seed(self.seeds[0])
        try:
            candidate = model_new(*self.init_inputs)
        except TypeError as exc:
            # Raised before any line of the candidate ran: the arguments do not fit its __init__.
            in_candidate = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == name]
            if not in_candidate:
                r.fail("bad-candidate", f"ModelNew(*get_init_inputs()) failed: {exc}; ModelNew must take "
                                        f"the same constructor arguments as Model ({len(self.init_inputs)} given).")
                raise _Stop
            self._fail_candidate(exc, "in ModelNew.__init__", "runtime")
        except (Exception, SystemExit) as exc:  # sys.exit() in a candidate is its failure
            self._fail_candidate(exc, "in ModelNew.__init__", "runtime")
        if not isinstance(candidate, torch.nn.Module):
            r.fail("bad-candidate", "ModelNew(...) did not return an nn.Module.")
            raise _Stop
        state = self.task.reference_state
        if state is not None:
            try:
                candidate.load_state_dict(state)
            except Exception:
                pass  # a different parameter layout: the candidate keeps its own weights
        try:
            return self._to_device(candidate)
        except (Exception, SystemExit) as exc:  # sys.exit() in a candidate is its failure
            self._fail_candidate(exc, f"moving ModelNew to {self.device}", "runtime")

    def _fail_candidate(self, exc: BaseException, where: str, default_kind: str):
        kind = classify_exception(exc)
        if kind == "runtime":
            kind = default_kind
        self.recycle |= context_poisoned(exc)
        if isinstance(exc, CompileError):
            self.compile_log = map_compile_log(exc, self.job["candidate"])
            message = f"NVRTC could not compile the candidate's CUDA: {exc.message}"
        else:
            message = f"{type(exc).__name__} {where}: {exc}"
            self.compile_log = self._candidate_traceback(exc) if kind in ("load", "runtime", "compile") else ""
        self.report.fail(kind, message[:4000])
        raise _Stop

    def _candidate_traceback(self, exc: BaseException) -> str:
        name = self.job.get("candidate_name") or "<candidate>"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == name]
        return "\n".join(f"line {f.lineno} in {f.name}: {f.line}" for f in frames[-5:])

    # ---- correctness

    def _trials(self) -> None:
        r = self.report
        r.correct = True
        # One reference pass on inputs no trial uses, for the outputs' sizes (what to poison) and
        # whether the problem's own outputs are finite; its outputs are freed (and poisoned over).
        probe = self._call_reference(self._inputs(self.seeds[0] - 1, "problem"))
        self.out_like = [(x.shape, x.dtype) for x in flatten(probe) if isinstance(x, torch.Tensor)]
        self._problem_non_finite = non_finite(probe)
        del probe
        problem_rms = None
        first = None  # (candidate outputs, reference outputs, seed) of trial 0, for input independence
        for t, seed in enumerate(self.seeds):
            dist = DISTRIBUTIONS[t % len(DISTRIBUTIONS)]
            inputs = self._inputs(seed, dist)
            # Candidate first: no reference output of this trial exists anywhere to be found.
            before = self._call_candidate(inputs, poison=NAN_POISON)
            ref_out = self._call_reference(inputs)
            if dist != "problem" and non_finite(ref_out) and not self._problem_non_finite:
                # Outside the problem's domain (log, sqrt...): use its own distribution for this seed.
                dist = "problem (the " + dist + " distribution gives non-finite reference outputs)"
                inputs = self._inputs(seed, "problem")
                del ref_out
                before = self._call_candidate(inputs, poison=NAN_POISON)
                ref_out = self._call_reference(inputs)
            ref_list = flatten(ref_out)
            after = self._call_candidate(inputs, poison=NAN_POISON)
            self.shipped_trials.append([to_host(x) for x in flatten(after)])
            rms = output_rms(ref_list)
            if t == 0:
                problem_rms = rms
            scale = max(1.0, rms / problem_rms) if problem_rms else 1.0
            exact = self._exact(inputs, ref_list)
            cmp_before = self._compare(ref_list, before, scale, exact)
            cmp_after = self._compare(ref_list, after, scale, exact)
            del exact
            ok_b, ok_a = all(o.ok for o in cmp_before), all(o.ok for o in cmp_after)
            r.trials.append({"seed": seed, "distribution": dist, "ok": ok_a and ok_b,
                             "ok_before_reference": ok_b, "ok_after_reference": ok_a,
                             "atol_scale": scale})
            if t == 0 or not (ok_a and ok_b):
                r.outputs = cmp_before if (ok_a and not ok_b) else cmp_after
            if t == 0 and ok_a:
                self._fp64(inputs, after)
                self._determinism(inputs, after, scale)
                self._dispatch(inputs)
            if ok_a != ok_b:
                wrong = cmp_before if ok_a else cmp_after
                evidence = (f"seed {seed}: correct {'after' if ok_a else 'before'} the reference, wrong "
                            f"{'before' if ok_a else 'after'}: " + _mismatch_text(wrong))
                if _gross(wrong):
                    r.add("order-dependent", MAJOR, "the candidate's result depends on whether it runs before "
                          "or after the reference (stale memory from an earlier run).", evidence)
                else:  # a few elements just outside tolerance: flaky arithmetic, not a stale result
                    r.add("nondeterministic", MINOR, "two runs of the candidate on the same inputs disagree: "
                          "one is within tolerance, the other is not.", evidence)
            if first is not None:
                self._input_independence(first, after, ref_list, seed)
            if not (ok_a and ok_b):
                r.trials[-1]["order"] = "before" if not ok_b else "after"
                self._explain_nans(inputs, cmp_before if not ok_b else cmp_after)
                bad = next((o for o in r.outputs if not o.ok), None)
                what = bad.problem if bad and bad.problem else \
                    (f"{bad.mismatches} elements of output {bad.index} outside tolerance" if bad else "wrong output")
                r.fail("incorrect", f"trial {t} (seed {seed}, {dist} inputs): {what}.")
                return
            if t == 0:
                first = ([_detach(x) for x in flatten(after)], ref_list, seed)

    def _dispatch(self, inputs) -> None:
        """The ATen operators of one candidate forward against one reference forward (attribution.py):
        torch doing the problem's work is a finding however the candidate spells the call."""
        if self.job.get("trusted"):
            return
        from . import attribution

        try:
            with attribution.DispatchRecord() as ref_record:
                self.reference(*clone_inputs(inputs))
            args = clone_inputs(inputs)
            with attribution.DispatchRecord() as cand_record:
                self.candidate(*args)
            if self.cuda:
                self.gpu.sync()
        except (Exception, SystemExit) as exc:  # a record that fails is no verdict on the candidate
            self.report.timing["aten_dispatch"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
            return
        cand = attribution.dispatch_summary(cand_record.ops)
        ref = attribution.dispatch_summary(ref_record.ops)
        self.report.timing["aten_dispatch"] = {"candidate": cand, "reference": ref}
        for rule, severity, message, evidence in attribution.dispatch_findings(cand, ref):
            self.report.add(rule, MAJOR if severity == "major" else MINOR, message, evidence)

    def _input_independence(self, first, cand_out, ref_list, seed) -> None:
        cand_first, ref_first, seed0 = first
        cand_list = flatten(cand_out)
        if len(cand_list) == len(cand_first) and all(_same(a, b) for a, b in zip(cand_list, cand_first)) \
                and not all(_same(a, b) for a, b in zip(ref_list, ref_first)):
            self.report.add("input-independent-output", MAJOR, "the candidate returns the same output for "
                            "different inputs, while the reference's output changes.",
                            f"seeds {seed0} and {seed}: identical candidate outputs")

    def _inputs(self, seed: int, dist: str) -> list[Any]:
        """Inputs for a seed and distribution, on the device. Cached for the worker's life (large
        problems spend seconds in CPU generators); callers never hand these lists to a model uncloned."""
        key = (self.task.key, seed, dist, str(self.device))
        if key in _input_cache:
            return _input_cache[key]
        value = self._make_inputs(seed, dist)
        nbytes = sum(x.numel() * x.element_size() for x in value if isinstance(x, torch.Tensor))
        for old in [k for k in _input_cache if k[0] != self.task.key]:
            del _input_cache[old]
            _input_cache_bytes.pop(old, None)
        while _input_cache and sum(_input_cache_bytes.values()) + nbytes > INPUT_CACHE_BYTES:
            old = next(iter(_input_cache))
            del _input_cache[old]
            _input_cache_bytes.pop(old, None)
        if nbytes <= INPUT_CACHE_BYTES:
            _input_cache[key] = value
            _input_cache_bytes[key] = nbytes
        return value

    def _make_inputs(self, seed: int, dist: str) -> list[Any]:
        return trial_inputs(self.task, seed, dist, self.device)

    def _call_reference(self, inputs: list[Any]) -> Any:
        try:
            out = self.reference(*clone_inputs(inputs))
            if self.cuda:
                self.gpu.sync()
        except Exception as exc:
            self.recycle |= context_poisoned(exc)
            self.report.fail("bad-reference", f"the reference's forward raised {type(exc).__name__}: {exc}")
            raise _Stop
        return _detach(out)

    def _call_candidate(self, inputs: list[Any], poison: float, check_mutation: bool = True) -> Any:
        args = clone_inputs(inputs)
        if self.cuda:
            self._poison(poison)
        try:
            out = self.candidate(*args)
            if self.cuda:
                self.gpu.sync()
        except _Stop:
            raise
        except (Exception, SystemExit) as exc:  # sys.exit() in a candidate is its failure
            self._fail_candidate(exc, "in ModelNew.forward", "runtime")
        self._check_persisting("after ModelNew.forward")
        if check_mutation:
            for i, (a, x) in enumerate(zip(args, inputs)):
                if isinstance(x, torch.Tensor) and isinstance(a, torch.Tensor) and not _same(a, x):
                    changed = int((a != x).sum()) if a.shape == x.shape else -1
                    self.report.add("input-mutated", MAJOR, "the candidate changed an input tensor in place.",
                                    f"input {i}: {changed} elements changed by one forward call")
        return out

    def _poison(self, value: float) -> None:
        """Fills the caching allocator's free blocks where the candidate's outputs are likely to land:
        two blocks the size of each reference output and one large block, filled and freed."""
        blocks = []
        try:
            for shape, dtype in self.out_like:
                for _ in range(2):
                    b = torch.empty(shape, dtype=dtype, device=self.device)
                    if value != value or not (dtype.is_floating_point or dtype.is_complex):
                        b.reshape(-1).view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in every float format
                    else:
                        b.fill_(value)
                    blocks.append(b)
            total = sum(b.numel() * b.element_size() for b in blocks)
            big = torch.empty(max(total, 1 << 22) // 4 * 2, dtype=torch.float32, device=self.device)
            big.view(torch.uint8).fill_(0xFF) if value != value else big.fill_(value)
            blocks.append(big)
            self.gpu.sync()
        finally:
            del blocks

    def _exact(self, inputs: list[Any], ref_list: list[Any]) -> list[Any] | None:
        """The reference's fp64 outputs on `inputs` where the accuracy rule judges an output (16-bit ones, every
        float under the tf32/bf16 policies: verify/tolerance.py), else None."""
        if not wants_reference([e.dtype for e in ref_list if isinstance(e, torch.Tensor)], self.tolerance):
            return None
        exact = self.high.outputs(clone_inputs(inputs))
        if self.high.note:
            self.report.timing["fp64_reference"] = self.high.note
        return exact

    def _compare(self, ref_list: list[Any], out: Any, scale: float, exact: list[Any] | None = None) -> list[OutputError]:
        got = flatten(out)
        result = judge_outputs(ref_list, got, self.tolerance, scale, exact)
        for i, g in enumerate(got if len(got) == len(ref_list) else []):
            if isinstance(g, torch.Tensor) and type(g) is not torch.Tensor and not isinstance(g, torch.nn.Parameter):
                self.report.add("lazy-output", MAJOR, "forward returns a tensor subclass, which can defer or "
                                "fake the work until the result is read.", f"output {i}: {type(g).__name__}")
        return result

    def _explain_nans(self, inputs, compared) -> None:
        """NaN where the reference has a number: unwritten (still the poison) or computed? A run
        poisoned with a finite sentinel tells them apart."""
        if not self.cuda or not any("NaN" in o.problem for o in compared):
            return
        try:
            again = flatten(self._call_candidate(inputs, poison=SENTINEL, check_mutation=False))
        except _Stop:
            return
        for i, ((shape, dtype), g) in enumerate(zip(self.out_like, again)):
            if isinstance(g, torch.Tensor) and g.is_floating_point() and g.shape == shape and g.dtype == dtype:
                sentinel = torch.tensor(SENTINEL, dtype=dtype, device=g.device)
                unwritten = int((g == sentinel).sum())
                if unwritten > 0:
                    self.report.add("output-not-written", MAJOR, "elements of the output keep the poison the "
                                    "harness left in memory: the candidate never writes them.",
                                    f"output {i}: {unwritten} of {g.numel()} elements unwritten")

    def _fp64(self, inputs, cand_out) -> None:
        try:
            ref64 = copy.deepcopy(self.reference).double()
            args = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in clone_inputs(inputs)]
            out64 = flatten(ref64(*args))
            ref_out = flatten(self.reference(*clone_inputs(inputs)))
            del ref64
        except Exception as exc:
            self.report.timing["fp64_reference"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
            return
        for o, c, r64, r in zip(self.report.outputs, flatten(cand_out), out64, ref_out):
            o.err_vs_fp64 = fp64_error(c, r64)
            o.reference_err_vs_fp64 = fp64_error(r, r64)

    def _determinism(self, inputs, first_out, scale) -> None:
        second = self._call_candidate(inputs, poison=NAN_POISON)
        cmp = []
        for i, (a, b) in enumerate(zip(flatten(first_out), flatten(second))):
            if isinstance(a, torch.Tensor):
                atol, rtol = self.tolerance.for_dtype(a.dtype)
                cmp.append(compare_output(i, a, b, atol, rtol, scale))
        if any(not c.ok for c in cmp):
            bad = next(c for c in cmp if not c.ok)
            self.report.add("nondeterministic", MINOR, "two runs of the candidate on the same inputs disagree "
                            "beyond the tolerance (races, uninitialized memory, atomics order).",
                            f"output {bad.index}: {bad.mismatches} elements differ, max abs diff {bad.max_abs_err}")

    def _check_persisting(self, when: str) -> None:
        if not self.cuda or not self.persisting.available:
            return
        try:
            state = self.persisting.state()
        except Exception:
            return
        if state["limit_bytes"] > 0 or state["window_bytes"] > 0:
            self.report.add("persisting-l2", MAJOR, "the candidate left a persisting-L2 reservation set, which "
                            "survives the cache flush between timed trials.",
                            f"{when}: persisting limit {state['limit_bytes']} B, access-policy window "
                            f"{state['window_bytes']} B")
            self.persisting.reset()

    # ---- timing

    def _timed_sets(self, expected: list[Any]) -> tuple[list[list[Any]], Callable[[], None]]:
        """Fresh copies of the timed input sets and the refill that gives them new values before the last
        round (recording the reference's outputs for them in ``expected``)."""
        seeds = timed_seeds(self.config)
        sets = [clone_inputs(self._inputs(s, "problem")) for s in seeds]  # the candidate gets these directly
        refills = [self._inputs(s + 1, "problem") for s in seeds]

        def refill() -> None:  # same buffers, new values: a cache keyed on pointers goes stale
            for k, (dst, src) in enumerate(zip(sets, refills)):
                refilled(dst, src)
                expected[k] = flatten(self._call_reference(dst))
                if wants_reference([e.dtype for e in expected[k] if isinstance(e, torch.Tensor)], self.tolerance):
                    self._refilled[k] = clone_inputs(dst)  # the re-check's fp64 reference runs on these

        self._refilled: dict[int, list[Any]] = {}

        return sets, refill

    def _timed_calls(self, fn: Callable[..., Any], sets: list[list[Any]], refill: Callable[[], None], flush: Any,
                     sync: Any, phases: tuple[str, str] = ("timed", "timed-end")) -> tuple[list[float], list[Any]]:
        """The timed phase, between the two ``phases`` messages the judge clocks."""
        cfg = self.config
        self.progress(phases[0])
        if self.cuda:
            result = self.gpu.time_calls(fn, sets, cfg.timing_iters, cfg.warmup, flush, self.persisting, sync,
                                         before_last_round=refill)
        else:
            result = time_cpu(fn, sets, cfg.timing_iters, cfg.warmup, refill)
        self.progress(phases[1])
        return result

    def _calibrate(self) -> None:
        """The timed phase with nothing to time, run before any candidate code is loaded here (so its two
        messages are this harness's own): the judge clocks it as the fixed cost its clock sees around the
        candidate's timed calls (flushes, syncs, the reference's refill) and subtracts it (judge.py)."""
        sets, refill = self._timed_sets([None] * self.config.input_sets)
        flush = sync = None
        if self.cuda:
            flush = self.gpu.L2Flush(self.device)
            sync = self.gpu.sync_latency(flush)
        self._timed_calls(lambda *args: None, sets, refill, flush, sync, ("calibrate", "calibrated"))

    def _timing(self) -> None:
        r, cfg = self.report, self.config
        expected: list[Any] = [None] * cfg.input_sets
        sets, refill = self._timed_sets(expected)
        flush = sync = None
        if self.cuda:
            g = self.gpu
            flush = g.L2Flush(self.device)
            sync = g.sync_latency(flush)
            r.timing["sync_latency_ms"], r.timing["sync_latency_high_ms"] = sync.typical_ms, sync.high_ms
        cand_times, snaps = self._timed_calls(self.candidate, sets, refill, flush, sync)
        if self.cuda:
            self._check_persisting("after the timed calls")
        self.shipped_timed = [None if snap is None else [to_host(x) for x in flatten(snap)] for snap in snaps]
        # Re-check what the timed calls returned.
        for k, (exp, snap) in enumerate(zip(expected, snaps)):
            if exp is None or snap is None:
                continue
            cmp = self._compare(exp, snap, 1.0, self._exact(self._refilled[k], exp) if k in self._refilled else None)
            if not all(c.ok for c in cmp):
                bad = next(c for c in cmp if not c.ok)
                r.add("timed-output-mismatch", MAJOR, "outputs of the timed calls are wrong although the "
                      "correctness trials passed: cached, stale or deferred results.",
                      f"input set {k} after its values changed in place: output {bad.index}: "
                      f"{bad.problem or str(bad.mismatches) + ' elements outside tolerance'}")
                r.correct = False
                r.fail("incorrect", "the outputs of the timed calls do not match the reference.")
        cand_ms = statistics.median(cand_times)
        timing = r.timing
        timing.update({"candidate_ms": cand_ms, "trials": len(cand_times), "warmup": cfg.warmup,
                       "input_sets": len(sets), "method": "cuda-events+device-sync" if self.cuda else "perf_counter",
                       "candidate_min_ms": min(cand_times), "candidate_total_ms": sum(cand_times)})
        if self.job.get("baselines") == "judge":
            pass  # the judge times eager and torch.compile in its own process (verify/judge.py)
        elif self.cuda:
            eager_times, _ = g.time_calls(self.reference, sets, cfg.timing_iters, cfg.warmup, flush, self.persisting, sync)
        else:
            eager_times, _ = time_cpu(self.reference, sets, cfg.timing_iters, cfg.warmup, None)
        if self.job.get("baselines") != "judge":
            timing["eager_ms"] = statistics.median(eager_times)
            r.speedup["eager"] = timing["eager_ms"] / cand_ms if cand_ms > 0 else None
        if self.cuda and cfg.compile_baseline and self.job.get("baselines") != "judge":
            compiled = self._compiled_reference()
            if isinstance(compiled, str):
                timing["compile_error"] = compiled
            else:
                try:
                    comp_times, _ = g.time_calls(compiled, sets, cfg.timing_iters, cfg.warmup, flush, self.persisting, sync)
                    timing["compile_ms"] = statistics.median(comp_times)
                    r.speedup["compile"] = timing["compile_ms"] / cand_ms if cand_ms > 0 else None
                except Exception as exc:
                    timing["compile_error"] = f"{type(exc).__name__}: {exc}"[:500]
        if self.cuda:
            self._speed_of_light(sets[0], cand_ms)
            if cfg.profile:
                self._cupti(sets, cand_ms)

    def _compiled_reference(self):
        key = (self.task.key, self.seeds[0], str(self.device))
        if key not in _compiled_references:
            try:
                _compiled_references[key] = torch.compile(self.reference)
            except Exception as exc:
                return f"torch.compile failed: {type(exc).__name__}: {exc}"[:500]
        compiled = _compiled_references[key]
        # The cached compiled module wraps a reference built with the same seed; swap in today's
        # reference weights (they are equal) by running it: a failure here falls back to no baseline.
        return compiled

    def _speed_of_light(self, inputs, cand_ms) -> None:
        nbytes = bytes_moved(self.reference, inputs)
        bound_ms = nbytes / (self.config.bandwidth_tb_s * 1e12) * 1e3
        self.report.timing["speed_of_light_ms"] = bound_ms
        self.report.timing["bytes_moved_min"] = nbytes
        # The floor for GPU work measured without an L2 flush (the CUPTI cross-check): whatever fits in
        # L2 may be served from it, the rest has to cross DRAM.
        l2 = int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or 0) \
            if self.device.type == "cuda" else 0
        self.report.timing["dram_floor_ms"] = max(nbytes - l2, 0) / (self.config.bandwidth_tb_s * 1e12) * 1e3
        # 10% margin for the noise of one event pair.
        if cand_ms < 0.9 * bound_ms:
            self.report.add("impossible-speed", MAJOR, "the measured time is below the memory speed-of-light "
                            "bound: the timed call cannot have read its inputs and written its outputs.",
                            f"median {cand_ms:.5f} ms < bound {bound_ms:.5f} ms ({nbytes} bytes at "
                            f"{self.config.bandwidth_tb_s} TB/s)")

    def _roofline_line(self, kernel_ms: float) -> str:
        """How far the kernels are from moving the inputs and outputs at DRAM speed ("" when unknown)."""
        bound_ms = self.report.timing.get("speed_of_light_ms") or 0.0
        if kernel_ms <= 0 or bound_ms <= 0:
            return ""
        share = bound_ms / kernel_ms
        text = (f"the kernels run {kernel_ms:.4f} ms per call; reading the inputs and writing the outputs once "
                f"at {self.config.bandwidth_tb_s} TB/s takes {bound_ms:.4f} ms ({100 * share:.0f}% of that "
                "memory speed of light)")
        if share < 0.5:
            text += ": for memory-bound work, fill the GPU (enough blocks for every SM), use 16-byte vector " \
                    "loads and make one pass over memory"
        return text

    def _cupti(self, sets, cand_ms) -> None:
        check = self.gpu.CuptiCheck(self.device)
        if not check.available:
            self.report.timing["cupti"] = {"available": False, "reason": check.reason[:300]}
            return
        result = check.measure(self.candidate, sets, calls=min(10, max(3, self.config.timing_iters // 10)))
        self.report.timing["cupti"] = {k: v for k, v in result.items() if k not in ("kernels", "summary", "advice")}
        if not result.get("available"):
            return
        self.report.profile = {"kernels": result["kernels"], "summary": result.get("summary"),
                               "kernels_per_call": result["kernels_per_call"], "streams": result["streams"],
                               "advice": result.get("advice", [])}
        self._attribute(result)
        if not self.job.get("trusted"):
            from . import attribution

            for rule, severity, message, evidence in attribution.host_findings(
                    int(result.get("dtoh_bytes_per_call", 0)), float(result.get("host_cpu_ms_per_call", 0.0)),
                    float(result.get("gpu_ms_per_call", 0.0)), int(self.report.timing.get("bytes_moved_min") or 0)):
                self.report.add(rule, MAJOR if severity == "major" else MINOR, message, evidence)
        kernel_ms = result["kernel_ms_per_call"]
        roofline = self._roofline_line(kernel_ms)
        if roofline:
            self.report.profile["advice"] = [*self.report.profile["advice"], roofline]
        if self.report.profile["advice"]:
            self.report.profile["bottleneck"] = self.report.profile["advice"][0]
        self.report.timing["cupti_kernel_ms"] = kernel_ms
        self.report.timing["event_over_cupti"] = cand_ms / kernel_ms if kernel_ms > 0 else None
        gpu_ms = result.get("gpu_ms_per_call", kernel_ms)
        self.report.timing["cupti_gpu_ms"] = gpu_ms
        floor_ms = self.report.timing.get("dram_floor_ms") or 0.0
        # Events include host time (a Python-level cache lookup, a sync): only CUPTI shows that the GPU
        # itself did too little. 10% margin, as for the events.
        if floor_ms > 0 and gpu_ms < 0.9 * floor_ms and \
                not any(f.rule == "impossible-speed" for f in self.report.findings):
            self.report.add("impossible-speed", MAJOR, "the GPU did less work per call than reading the inputs "
                            "and writing the outputs takes: the result was cached or skipped, not computed.",
                            f"CUPTI: {gpu_ms:.5f} ms of kernels and copies per call (all streams) < "
                            f"{floor_ms:.5f} ms for the bytes beyond L2 at {self.config.bandwidth_tb_s} TB/s")
        if result["outside_count"]:
            ev = result["outside_window"][0]
            self.report.add("unjoined-work", MAJOR, "CUPTI saw candidate kernels running outside the timed "
                            "window: work the events do not measure (a side stream or thread left unjoined).",
                            f"{result['outside_count']} kernel(s) outside, e.g. {ev['name']} on stream "
                            f"{ev['stream_id']} ({ev['duration_ms']:.4f} ms)")
        elif kernel_ms > 0.05 and cand_ms < 0.5 * kernel_ms:
            self.report.add("unjoined-work", MAJOR, "the event-timed duration is far below the kernel time "
                            "CUPTI measured: the timer misses part of the work.",
                            f"events {cand_ms:.4f} ms vs CUPTI kernels {kernel_ms:.4f} ms per call")

    def _attribute(self, result: dict[str, Any]) -> None:
        """Whose kernels did the GPU work of the verified calls (verify/attribution.py); StitchCUDA's own
        programs (a trusted job: the template path of a graph-mode target) are not judged by it."""
        if "by_name" not in result or self.job.get("trusted"):
            return
        from .. import jit
        from . import attribution

        try:
            own = attribution.own_kernel_names([self.job.get("candidate", "")], jit.compiled_kernel_names())
            attr = attribution.attribute(result["by_name"], own)
        except Exception as exc:  # a trace the classifier cannot read is no verdict on the candidate
            self.report.profile["attribution"] = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
            return
        self.report.profile["attribution"] = attr  # the feedback prints its summary line (build_feedback)
        for rule, severity, message, evidence in attribution.findings(attr):
            self.report.add(rule, MAJOR if severity == "major" else MINOR, message, evidence)

    def _to_device(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)


# ----------------------------------------------------------------------------------------------


def bytes_moved(reference: Any, inputs: list[Any]) -> int:
    """The least a call must move: its inputs and the reference's outputs that are not views of them (an
    output aliasing an input costs no traffic of its own; a broadcast tensor no more than its storage)."""
    args = clone_inputs(inputs)
    out = flatten(reference(*args))
    held = {x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)}
    fresh = [x for x in out if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in held]
    return sum(min(x.numel() * x.element_size(), x.untyped_storage().nbytes())
               for x in [*inputs, *fresh] if isinstance(x, torch.Tensor))


def trial_inputs(task: Task, seed: int, dist: str, device: torch.device) -> list[Any]:
    """The inputs of a trial: the problem's own for ``seed``, with floating inputs redrawn from ``dist``
    (config.DISTRIBUTIONS). The candidate's worker and the judge draw the same ones."""
    base = task.make_inputs(seed)
    gen = torch.Generator().manual_seed(seed * 7919 + 13)
    out = []
    for x in base:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and dist != "problem":
            if dist == "normal":
                x = torch.randn(x.shape, generator=gen, dtype=torch.float32).to(x.dtype)
            elif dist == "large":
                scale = 1000.0 if x.dtype in (torch.float32, torch.float64) else 30.0
                x = (torch.randn(x.shape, generator=gen, dtype=torch.float32) * scale).to(x.dtype)
            elif dist == "shifted":
                x = (torch.rand(x.shape, generator=gen, dtype=torch.float32) * 8 - 3).to(x.dtype)
        out.append(x.to(device) if isinstance(x, torch.Tensor) else x)
    return out


def timed_seeds(config: VerifyConfig) -> list[int]:
    """The seeds of the timed input sets (their values are refilled from seed + 1 before the last round)."""
    seeds = config.trial_seeds()
    return [seeds[0] + 1000 + i for i in range(config.input_sets)]


def refilled(inputs: list[Any], refill: list[Any]) -> None:
    """Same buffers, new values: the floating tensors of ``inputs`` take those of ``refill`` in place."""
    for d, s in zip(inputs, refill):
        if isinstance(d, torch.Tensor) and d.is_floating_point():
            d.copy_(s)


def to_host(x: Any) -> Any:
    """A copy the candidate cannot change later (it may reuse its output buffer), on the CPU for the wire."""
    return x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x


def time_cpu(fn, sets, iters, warmup, before_last_round):
    k = len(sets)
    for i in range(warmup):
        fn(*sets[i % k])
    times, snaps = [], [None] * k
    last_round = max(iters - k, 0)
    for i in range(iters):
        if i == last_round and before_last_round is not None:
            before_last_round()
        start = time.perf_counter()
        out = fn(*sets[i % k])
        times.append((time.perf_counter() - start) * 1e3)
        if i >= last_round:
            snaps[i % k] = _detach(out)
    return times, snaps


def _gross(compared: list[OutputError]) -> bool:
    """A wrong result that is not a rounding accident: shape/dtype/NaN problems, or more than 0.1%
    of an output's elements (and at least 8) outside tolerance."""
    for o in compared:
        if o.ok:
            continue
        if o.problem:
            return True
        total = 1
        for d in o.shape:
            total *= d
        if o.mismatches >= 8 and o.mismatches > 1e-3 * max(total, 1):
            return True
    return False


def _mismatch_text(compared: list[OutputError]) -> str:
    bad = next((o for o in compared if not o.ok), None)
    if bad is None:
        return ""
    return bad.problem or f"output {bad.index}: {bad.mismatches} elements outside tolerance"


def flatten(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        return [x for o in out for x in flatten(o)]
    return [out]


def clone_inputs(inputs: list[Any]) -> list[Any]:
    return [x.clone() if isinstance(x, torch.Tensor) else copy.deepcopy(x) for x in inputs]


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (list, tuple)):
        return type(out)(_detach(o) for o in out)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(torch.equal(a, b)) or (a.is_floating_point() and bool(torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)))
                                           and bool(torch.equal(a.isnan(), b.isnan())))
    try:
        return bool(a == b)
    except Exception:
        return False


def non_finite(out: Any) -> bool:
    return any(isinstance(x, torch.Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all())
               for x in flatten(out))


def output_rms(outputs: list[Any]) -> float:
    values = [float(x.double().pow(2).mean().sqrt()) for x in outputs
              if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() and bool(torch.isfinite(x).all())]
    return max(values) if values else 0.0


def _precision_flags() -> dict[str, Any]:
    flags = {"matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
             "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
             "matmul.allow_fp16_reduced_precision_reduction":
                 torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             "matmul.allow_bf16_reduced_precision_reduction":
                 torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
             "float32_matmul_precision": torch.get_float32_matmul_precision()}
    return flags


def _restore_precision_flags(flags: dict[str, Any]) -> None:
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul.allow_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn.allow_tf32"]
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = \
        flags["matmul.allow_fp16_reduced_precision_reduction"]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = \
        flags["matmul.allow_bf16_reduced_precision_reduction"]
    torch.set_float32_matmul_precision(flags["float32_matmul_precision"])
