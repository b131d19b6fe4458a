"""The Verifier's judgement of stitched programs (graph mode): one program against expected outputs
(``check_program``: a generated group against its ATen subgraph, in the isolated worker or in this
process), and a whole optimized model against the original (``verify_whole``: the example inputs and
fresh random sets, with the error against an fp64 copy of the model). Lowering builds the programs;
this module only judges them, with the comparator and tolerance table every other check uses.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .compare import error_and_outside, first_difference, fp64_error
from .tolerance import by_accuracy, judge_accuracy, tolerance

__all__ = ["check_program", "program_job", "output_specs", "run_program_job", "verify_whole", "random_like", "input_set",
           "release_host_memory"]

# The fp64 copy of a model doubles every tensor it touches, and its forward holds fp64 intermediates:
# past this size of the largest input or of the weights, the error against exact arithmetic is not
# computed (at KernelBench's sizes it would cost more memory than the check and the forward together).
EXACT_COPY_LIMIT_BYTES = 256 << 20
# A 16-bit model past that limit gets an fp32 copy instead, up to this many bytes of fp32 weights or input.
FP32_REFERENCE_LIMIT_BYTES = 4 << 30


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def program_job(program: Any, feed: Sequence[torch.Tensor], expected: Sequence[torch.Tensor] | None,
                tolerances: Sequence[tuple[float, float]], names: Sequence[str], on_device: bool = False,
                outputs: Sequence[torch.Tensor] | None = None) -> dict[str, Any]:
    """The worker job (``{"kind": "program"}``) that checks `program` on `feed`: the artifact with its
    CUBINs (the worker compiles nothing), inputs and expected outputs on the CPU (they cross a pipe), or,
    with `on_device`, where they are (CUDA tensors cross as CUDA IPC handles: no copy). With `outputs`
    (CUDA tensors of this process, crossing as IPC handles) and no `expected`, the worker writes the
    program's outputs into them and compares nothing: the caller does (check_program's in-place outputs)."""
    from .config import VerifyConfig

    config = VerifyConfig(device="cuda" if any(t.is_cuda for t in feed) else None)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if on_device else t.detach().cpu()

    job = {"kind": "program", "artifact": program.serialize(), "inputs": [move(t) for t in feed],
           "expected": None if expected is None else [move(t) for t in expected],
           "tolerances": [tuple(t) for t in tolerances], "names": list(names), "config": config.to_dict()}
    if outputs is not None:
        job["outputs"] = [t.detach() for t in outputs]
    return job


def check_program(program: Any, feed: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                  tolerances: Sequence[tuple[float, float]], names: Sequence[str], pool: Any = None,
                  reference: str = "the reference", stats: dict | None = None,
                  in_place_from: int = 0) -> tuple[bool, str]:
    """Runs `program` (a stitchcuda Program) on `feed` and compares output k with `expected[k]` under
    `tolerances[k]` (atol, rtol); `names` name the outputs in messages, `reference` what `expected`
    came from ("ATen"). Returns (ok, why): "matches <reference>", or the first difference or failure.

    With `pool` (a WorkerPool) the program runs in the Verifier's isolated worker: a fault, a hang or a
    crash of generated code becomes the reason, never this process's. Without it, in this process
    (generated templates only: code StitchCUDA wrote itself). `stats`, when given, receives
    "worker_peak_bytes": the GPU memory the worker allocated for the check (its outputs, arena and
    comparison; tensors it reads through CUDA IPC are this process's), 0 in this process, and "in_place":
    how many outputs were checked in place (below).

    `in_place_from` (bytes; 0: never): an expected CUDA output at least this large, laid out as the
    program's output, is copied to page-locked host memory and the program writes its output into that
    tensor's own memory; the comparison runs here against the host copy, and the tensor gets its values
    back before this returns. A check then allocates no second tensor of that size beside the recorded one
    (see ``_in_place``)."""
    if stats is not None:
        stats["worker_peak_bytes"] = 0
    if in_place_from > 0 and (pool is None or getattr(pool, "shares_cuda", False)):
        saved = _in_place(program, feed, expected, in_place_from)
        verdict = _check_in_place(program, feed, expected, saved, tolerances, names, pool, reference, stats) \
            if saved else None
        if verdict is not None:
            if stats is not None:
                stats["in_place"] = len(saved)
            return verdict  # else the worker crashed on the job (CUDA IPC): checked the usual way below
    if pool is not None:
        from .config import VerifyConfig

        on_device = bool(getattr(pool, "shares_cuda", False)) and any(t.is_cuda for t in feed)
        job = program_job(program, feed, expected, tolerances, names, on_device=on_device)
        config = VerifyConfig.from_dict(job["config"])
        result = pool.run(job, config.compile_time_limit_s, config.run_time_limit_s)
        if on_device and (result.get("error") or {}).get("kind") == "crash":
            # The tensors' CUDA IPC handles did not arrive (a driver or container without CUDA IPC): from
            # now on this pool gets copies, and this job again.
            pool.shares_cuda = False
            pool.cuda_ipc_problem = str((result.get("error") or {}).get("message", ""))[:300]
            warnings.warn("StitchCUDA: CUDA tensors could not reach the verification worker by CUDA IPC "
                          f"({pool.cuda_ipc_problem}); they are copied through host memory instead.",
                          RuntimeWarning, stacklevel=2)
            job = program_job(program, feed, expected, tolerances, names)
            result = pool.run(job, config.compile_time_limit_s, config.run_time_limit_s)
        if on_device:
            del job  # the handles' tensors: freed once the worker has let go of them too
            torch.cuda.ipc_collect()
        if stats is not None:
            stats["worker_peak_bytes"] = int(result.get("peak_bytes") or 0)
        if result.get("correct"):
            return True, f"matches {reference} (checked in the Verifier's isolated worker)"
        error = result.get("error") or {}
        message = str(error.get("message") or "the worker reported no result").replace("the reference", reference)
        kind = error.get("kind", "")
        return False, message if kind in ("incorrect", "") else f"{kind}: {message}"
    try:
        got = program.executor(graphs=False).run(list(feed))
    except Exception as exc:  # a launch error is a reason, not a crash of the caller
        return False, _first_line(exc)
    problem = _first_problem(got, expected, tolerances, names, reference)
    return (False, problem) if problem else (True, f"matches {reference}")


def _first_problem(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                   tolerances: Sequence[tuple[float, float]], names: Sequence[str], reference: str) -> str | None:
    if len(got) != len(expected):
        return f"the program returns {len(got)} outputs, {reference} {len(expected)}"
    for name, g, w, (atol, rtol) in zip(names, got, expected, tolerances):
        problem = first_difference(name, g, w, atol, rtol, reference=reference)
        if problem:
            return problem
    return None


def output_specs(program: Any) -> list[dict]:
    """The program's output buffers in the order its runs return them (by buffer id)."""
    return sorted((b for b in program.buffers if b["role"] == "output"), key=lambda b: b["id"])


def _in_place(program: Any, feed: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
              from_bytes: int) -> dict[int, torch.Tensor]:
    """Page-locked host copies of the expected outputs a check may write in place (index -> copy): CUDA
    tensors of `from_bytes` or more that cover their storage exactly, with the shape, strides and dtype of
    the program's output buffer, sharing no storage with an input. Empty when there are none (or no
    page-locked memory could be had)."""
    specs = output_specs(program)
    if len(specs) != len(expected):
        return {}
    inputs = {t.untyped_storage().data_ptr() for t in feed if isinstance(t, torch.Tensor) and t.is_cuda}
    saved: dict[int, torch.Tensor] = {}
    for k, (e, b) in enumerate(zip(expected, specs)):
        size = e.numel() * e.element_size()
        if not (e.is_cuda and size >= from_bytes and size == e.untyped_storage().nbytes() and e.storage_offset() == 0
                and list(e.shape) == list(b["shape"]) and list(e.stride()) == list(b["strides"])
                and e.untyped_storage().data_ptr() not in inputs):
            continue
        try:
            host = torch.empty_strided(e.shape, e.stride(), dtype=e.dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # no page-locked memory: this output is checked the usual way
            continue
        host.copy_(e)
        saved[k] = host
    return saved


def _check_in_place(program: Any, feed: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                    saved: dict[int, torch.Tensor], tolerances: Sequence[tuple[float, float]],
                    names: Sequence[str], pool: Any, reference: str, stats: dict | None) -> tuple[bool, str] | None:
    """check_program with the outputs in `saved` written into the expected tensors themselves (their
    values wait in `saved`, host memory, and come back before this returns); the others get tensors of
    their own. The program runs in `pool`'s worker (which writes through CUDA IPC and compares nothing)
    or in this process; the comparison runs here. None when the worker crashed on the job (the handles
    may not have arrived): the caller checks the usual way, which finds out."""
    specs = output_specs(program)
    outputs = [e if k in saved else torch.empty_strided(b["shape"], b["strides"], dtype=e.dtype, device=e.device)
               for k, (e, b) in enumerate(zip(expected, specs))]
    want = [saved.get(k, e) for k, e in enumerate(expected)]
    on_gpu = any(t.is_cuda for t in outputs)
    try:
        if pool is not None:
            from .config import VerifyConfig

            job = program_job(program, feed, None, tolerances, names, on_device=True, outputs=outputs)
            config = VerifyConfig.from_dict(job["config"])
            result = pool.run(job, config.compile_time_limit_s, config.run_time_limit_s)
            del job
            if on_gpu:
                torch.cuda.ipc_collect()
            if stats is not None:
                stats["worker_peak_bytes"] = int(result.get("peak_bytes") or 0)
            if not result.get("correct"):
                error = result.get("error") or {}
                kind = error.get("kind", "")
                if kind == "crash":
                    return None
                message = str(error.get("message") or "the worker reported no result").replace("the reference",
                                                                                              reference)
                return False, message if kind in ("incorrect", "") else f"{kind}: {message}"
            where = " (run in the Verifier's isolated worker)"
        else:
            try:
                program.executor(graphs=False).run(list(feed), outputs)
            except Exception as exc:  # a launch error is a reason, not a crash of the caller
                return False, _first_line(exc)
            where = ""
        if on_gpu:
            torch.cuda.synchronize()
        problem = _first_problem(outputs, want, tolerances, names, reference)
        return (False, problem) if problem else (True, f"matches {reference}{where}")
    finally:
        for k, host in saved.items():
            expected[k].copy_(host)  # the recorded values, back for the checks and steps that read them
        outputs = want = None


def run_program_job(job: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """The worker side of ``program_job``: runs the saved program (job["artifact"]: .stitch bytes) on
    job["inputs"] and compares each output with job["expected"] under job["tolerances"], isolated like a
    candidate. Returns a VerifyReport dict (correct, error) plus "recycle" (a sticky CUDA error)."""
    from .config import VerifyConfig
    from .harness import classify_exception, context_poisoned
    from .report import VerifyReport, build_feedback

    started = time.perf_counter()
    report, recycle = VerifyReport(), False
    device = torch.device(VerifyConfig.from_dict(job["config"]).device or "cpu")
    base = None
    if device.type == "cuda":  # what this job allocates, beside what the worker held before it
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    try:
        from ..program import Program

        program = Program.deserialize(job["artifact"])
        # "cuda" is the worker's own GPU (the pool set it current when the worker started).
        executor = program.executor(graphs=False)  # CUBINs from the artifact: nothing recompiles
        report.compiled = True
        progress("run")
        given = job.get("outputs")  # the caller's tensors: written here, compared by the caller
        inputs = [t.to(device) for t in job["inputs"]]
        got = executor.run(inputs) if given is None else executor.run(inputs, given)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if job.get("expected") is None:
            report.correct = True  # ran to the end; the caller compares
        else:
            problem = _first_problem(got, job["expected"], job["tolerances"], job["names"], "the reference")
            report.correct = problem is None
            if problem:
                report.fail("incorrect", problem)
    except Exception as exc:  # noqa: BLE001 - whatever the program did becomes the report
        recycle = context_poisoned(exc)
        report.fail(classify_exception(exc), _first_line(exc))
    report.feedback = build_feedback(report)
    report.wall_s = time.perf_counter() - started
    data = report.to_dict()
    data["recycle"] = recycle
    if base is not None and not recycle:
        data["peak_bytes"] = max(int(torch.cuda.max_memory_allocated()) - base, 0)
    return data


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A fresh input like `t`: for floats, normal values with `t`'s mean and standard deviation (the
    example's own distribution, so activations stay in the range the model sees and an absolute
    tolerance means what it means on the example); `t` itself (copied) otherwise: integer inputs are
    indices or sizes. A constant `t` spreads by its magnitude (at least 1e-3), so the set still differs."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    if t.is_floating_point():
        mean, spread = 0.0, 1.0
        if t.numel():
            x = t.detach()
            # One reduction, no temporary as large as the input (inputs of several GB); halves in fp32.
            std, avg = torch.std_mean(x if x.dtype in (torch.float32, torch.float64) else x.float(), correction=0)
            mean, spread = float(avg), float(std)
            if not math.isfinite(mean) or not math.isfinite(spread):  # an input holding inf or NaN
                mean, spread = 0.0, 1.0
            if spread == 0.0:
                spread = max(abs(mean), 1e-3)
        # Scaled in place: one tensor of t's size at a time (verification draws these at KernelBench sizes).
        out = torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).mul_(spread)
        return (out.add_(mean) if mean else out).to(t.dtype)
    return t.clone()


def input_set(example_inputs: Sequence[Any], k: int) -> Sequence[Any]:
    """Input set `k` of a whole-program check: the example inputs (k = 0), else fresh random tensors
    shaped like them (seed 1234 + k), so a failing set can be made again to trace the failure."""
    if k == 0:
        return example_inputs
    return pytree.tree_map(lambda t: random_like(t, 1234 + k) if isinstance(t, torch.Tensor) else t, example_inputs)


def _exact_copy(model: torch.nn.Module, example_inputs: Sequence[Any]) -> tuple[torch.nn.Module | None, str]:
    """An fp64 copy of `model` (the caller's model is untouched), or None and why not."""
    tensors = [t for t in pytree.tree_flatten(example_inputs)[0] if isinstance(t, torch.Tensor)]
    largest = max((t.numel() * t.element_size() for t in tensors), default=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    wide, note = torch.float64, ""
    if max(largest, weights) > EXACT_COPY_LIMIT_BYTES:
        note = (f"an fp64 copy of a model with {max(largest, weights) / 2**30:.1f} GiB tensors would double the "
                "check's memory")
        # A 16-bit model is still judged against the truth (the accuracy rule, verify/tolerance.py): an fp32
        # copy is 2^16 times finer than bf16's rounding and half an fp64 copy's size.
        sixteen = any(t.dtype in (torch.float16, torch.bfloat16) for t in [*tensors, *model.parameters()])
        if not sixteen or 2 * max(largest, weights) > FP32_REFERENCE_LIMIT_BYTES:
            return None, f"not computed: {note}"
        wide, note = torch.float32, f"an fp32 reference: {note}"
    try:
        return copy.deepcopy(model).to(wide), note
    except Exception as exc:
        return None, f"not computed: the model cannot be copied to {wide} ({_first_line(exc)})"


# Outputs of the model at least this large are held in host memory during a whole-program check.
HOST_REFERENCE_BYTES = 64 << 20


def _held_on_host(t: Any) -> Any:
    """`t` itself, or a copy in page-locked host memory of a CUDA tensor of HOST_REFERENCE_BYTES or more
    (the GPU's is freed when the caller drops `t`). Page-locked, because pageable memory moves at a
    fraction of the bus's speed (seconds per set for a 6 GB output); torch's host allocator keeps the
    block for the next input set, and verify_whole gives it back at the end. Where no page-locked memory
    can be had, `t` stays on the GPU."""
    if not (isinstance(t, torch.Tensor) and t.is_cuda and t.numel() * t.element_size() >= HOST_REFERENCE_BYTES):
        return t
    # The same strides on the host: a copy between layouts would first make a contiguous copy on the GPU.
    dense = t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
    if not dense:
        return t
    try:
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True)
    except RuntimeError:
        return t
    return host.copy_(t)


def release_host_memory() -> None:
    """Returns the page-locked blocks torch's host allocator cached for references held in host memory
    (a whole-program check's, a group check's outputs checked in place)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def verify_whole(model: torch.nn.Module, optimized: Callable[..., Any], example_inputs: Sequence[Any], sets: int,
                 precision: str = "fp32", no_exact: str = "",
                 release: Callable[[], None] | None = None) -> dict[str, Any]:
    """`optimized` against `model` on the example inputs, then on `sets - 1` fresh random sets
    (``input_set``), every output under the tolerance table for its dtype and `precision`. Returns {passed,
    input_sets, max_abs_error (the worst |optimized - model|), max_rel_error_fp64 (the worst norm-wise error
    against an fp64 copy of the model; None when none is made, with the reason in fp64_note), detail (the
    first difference, "" when none), failed_set (the input set of that difference, or None)}. `no_exact`:
    why the fp64 copy is not made, when the caller knows it would not fit (the fp64 attention has no
    fused kernel and materializes its score matrix). `release`, when given, is called before the model's
    forwards of each set: `optimized` gives its working memory back then, so the check never holds both
    forwards' working sets at once (the model's outputs, then the optimized ones, are compared), and
    `optimized` runs twice per set, so a program that replays a CUDA graph is judged on its replay. The
    model's outputs of HOST_REFERENCE_BYTES or more wait in host memory while `optimized` runs.

    A 16-bit output (or any under the tf32/bf16 policies) that lies outside the table around the model's
    is judged again by the accuracy rule against the fp64 copy (verify/tolerance.py; an fp32 copy of a
    16-bit model too large for fp64, said in fp64_note): "accuracy" then lists every such verdict, with
    the program's error and the model's own."""
    try:
        return _verify_whole(model, optimized, example_inputs, sets, precision, no_exact, release)
    finally:
        release_host_memory()


def _verify_whole(model: torch.nn.Module, optimized: Callable[..., Any], example_inputs: Sequence[Any], sets: int,
                  precision: str, no_exact: str, release: Callable[[], None] | None) -> dict[str, Any]:
    """verify_whole's check; verify_whole gives back the host memory it held."""
    worst_abs, worst_rel = 0.0, 0.0
    detail = ""
    passed = True
    failed_set = None
    accuracy: list[dict] = []  # the accuracy rule's verdicts (verify/tolerance.py), output by output
    exact_model, exact_note = (None, f"not computed: {no_exact}") if no_exact else _exact_copy(model, example_inputs)

    def failure(k: int, text: str) -> dict[str, Any]:
        return {"passed": False, "input_sets": k + 1, "max_abs_error": float("inf"),
                "max_rel_error_fp64": float("inf"), "detail": text, "failed_set": k, "fp64_note": exact_note}

    for k in range(sets):
        inputs = input_set(example_inputs, k)
        with torch.no_grad():
            if release is not None:
                release()
            # A large output waits in host memory while the program runs: the check holds the model's
            # output or the program's on the GPU, not both (compared a slice at a time, _chunks).
            want = [_held_on_host(t) for t in pytree.tree_flatten(model(*inputs))[0]]
            exact = None
            if exact_model is not None:
                try:
                    high = next((p.dtype for p in exact_model.parameters()), torch.float64)
                    wide = pytree.tree_map(
                        lambda t: t.to(high) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)
                    exact = pytree.tree_flatten(exact_model(*wide))[0]
                    del wide
                except Exception:  # a model that cannot run in fp64 (an fp16-only kernel): no exact error
                    exact = None
            got = pytree.tree_flatten(optimized(*inputs))[0]
            if release is not None:
                # After a release the first call launches the steps directly; the second captures and replays
                # (for a program that replays), as every later call does: that is the result judged.
                del got
                got = pytree.tree_flatten(optimized(*inputs))[0]
        if len(got) != len(want):
            return failure(k, f"the program returns {len(got)} outputs, the model {len(want)}")
        for i, (w, g) in enumerate(zip(want, got)):
            if not isinstance(w, torch.Tensor):
                continue
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                what = f"{g.dtype}{list(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
                return failure(k, f"output {i} is {what}, the model's {w.dtype}{list(w.shape)}")
            atol, rtol = tolerance(w.dtype, precision)
            verdict = None
            error, outside = error_and_outside(g, w, atol, rtol)  # one read of both: w may be in host memory
            worst_abs = max(worst_abs, error)
            if exact is not None and i < len(exact):
                rel = fp64_error(g, exact[i])
                if rel is not None:
                    worst_rel = max(worst_rel, rel)
                if by_accuracy(w.dtype, precision) and exact[i].dtype != w.dtype:  # the truth decides, not eager
                    verdict = judge_accuracy(g, w, exact[i], precision, "fp64" if exact[i].dtype == torch.float64
                                             else "fp32")
                    accuracy.append({"set": k, "output": i, **verdict.to_dict()})
                    outside = outside and not verdict.ok
            if passed and outside:
                passed, failed_set = False, k
                detail = f"input set {k}, {first_difference(str(i), g, w, atol, rtol, reference='the model')}"
                detail += f"; by the accuracy rule: {verdict.describe()}" if verdict is not None else ""
        # The next set is drawn with nothing of this one left alive (the loop's w and g included: at
        # KernelBench's sizes each is an output of several GB).
        del want, got, exact, inputs
        w = g = None
    return {"passed": passed, "input_sets": sets, "max_abs_error": worst_abs,
            "max_rel_error_fp64": worst_rel if exact_model is not None else None, "fp64_note": exact_note,
            "detail": detail, "failed_set": failed_set, **({"accuracy": accuracy} if accuracy else {})}
