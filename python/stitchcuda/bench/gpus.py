"""A bench run spread over the GPUs of one machine (--gpus N): the devices each process gets, the shared queue
the processes take problems from, the processes themselves (Spread), and the comparison of a one-GPU run with
an N-GPU run (--scaling)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .problems import problem_class, problem_level
from .results import ROW_PREFIX, new_row, read_results, row_mode
from .tables import fmt, full_summary


# Two runs of a problem agree when their status, failing stages and correctness match and each of these
# speed-ups is within SPEEDUP_TOLERANCE of the other (max / min - 1): timings move between runs and
# GPUs, verdicts must not.
SPEEDUP_TOLERANCE = 0.15
AGREEMENT_COLUMNS = ("speedup_stitch", "speedup_best_compile", "speedup_agents")
STDERR_TAIL = 20  # lines of a bench process's stderr kept for the rows it could not finish
STOP_GRACE_S = 5.0  # after Ctrl-C, how long a bench process may take to stop before it is killed


def _device_count() -> int:
    try:
        from .. import _C

        return _C.device_count()  # the driver's count under this process's CUDA_VISIBLE_DEVICES, no context
    except Exception:  # no native module, no driver
        return 0


def child_devices(n: int, compile_only: bool, environ: dict[str, str] | None = None,
                  count: int | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES value for each of `n` bench processes: the i-th GPU this process sees
    (an entry of its own CUDA_VISIBLE_DEVICES when it has one, else i); "" for every process of a
    --compile-only run, which needs no GPU. `count` is the driver's device count (default: asked).
    ValueError, naming both counts and the fix, when fewer than `n` GPUs are visible."""
    if compile_only:
        return [""] * n
    environ = os.environ if environ is None else environ
    count = _device_count() if count is None else count
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    # The driver stops at the first entry it cannot use, so its count says how many entries hold.
    visible = [t.strip() for t in listed.split(",")][:count] if listed is not None else [str(i) for i in range(count)]
    if n > len(visible):
        where = f" (CUDA_VISIBLE_DEVICES={listed!r})" if listed is not None else ""
        raise ValueError(f"--gpus {n} asks for {n} GPUs but this machine shows {len(visible)}{where}; pass "
                         f"--gpus {len(visible)} or fewer" + (", or make more GPUs visible through "
                                                              "CUDA_VISIBLE_DEVICES" if listed is not None else ""))
    return visible[:n]


def _device_names(devices: list[str]) -> list[str]:
    """The name of each device of child_devices() ("cpu" for ""), by the driver (no context is made)."""
    from .. import _C

    names = []
    for index, device in enumerate(devices):
        try:
            names.append(_C.device_info(index)["name"] if device else "cpu")
        except Exception:  # a driver without the name: the index says which one
            names.append(f"GPU {device}")
    return names


def devices_label(names: list[str]) -> str:
    """"2 x NVIDIA H200" for identical devices, else their names in order."""
    if names and all(name == names[0] for name in names):
        return f"{len(names)} x {names[0]}"
    return ", ".join(names)


def queue_order(files: list[Path]) -> list[Path]:
    """The order the bench processes take problems in: whole networks first (their optimize captures,
    compiles and checks the most groups: the long poles), then the rest, each in folder order. A process
    takes the next problem no other has taken as soon as it finishes one, so no GPU idles while problems
    wait, however unequal they are (at KernelBench sizes they differ a hundredfold)."""
    return sorted(files, key=lambda p: problem_class(p.stem) != "whole network" and problem_level(p) != "level3")


def queue_files(queue: Path) -> list[Path]:
    try:
        return [Path(p) for p in json.loads((queue / "queue.json").read_text(encoding="utf-8"))]
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench: --queue {queue} is not the queue of a --gpus run ({exc})") from None


def claim(queue: Path, index: int) -> bool:
    """Takes problem `index` of the shared queue for this process; False when another process has it.
    Creating the claim file is atomic (O_EXCL); it holds the taker's pid, so the parent knows which
    process a problem without a row was lost with."""
    try:
        fd = os.open(queue / "claims" / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def queue_claims(queue: Path) -> dict[int, int]:
    """Problem index -> the pid of the process that took it (0: it died before writing its pid)."""
    out = {}
    for path in (queue / "claims").iterdir():
        text = path.read_text().strip()
        out[int(path.name)] = int(text) if text.isdigit() else 0
    return out


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit {code})"
    return f"exited with {code}"


def _child_environment(device: str, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a bench process on `device`: its CUDA_VISIBLE_DEVICES, this
    process's kernel cache, this package first on the path (from a source checkout), the selection
    variables dropped (the queue is the selection)."""
    from .. import jit

    env = {k: v for k, v in os.environ.items()
           if k not in ("STITCHCUDA_SUITE_DIR", "STITCHCUDA_SUITE_ONLY", "STITCHCUDA_SUITE_CHUNK")}
    root = Path(__file__).resolve().parents[2]
    # A source checkout (python/) goes first so the processes run this code; an installed package's
    # site-packages does not (it would come before the standard library).
    if root.name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join([str(root), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env["STITCHCUDA_CACHE_DIR"] = jit.cache_dir()
    env["CUDA_VISIBLE_DEVICES"] = device
    return {**env, **extra}


def _interrupt_on_sigterm() -> Callable[[], None]:
    """SIGTERM (a job's time limit, `timeout`) raises KeyboardInterrupt, so the bench processes are
    stopped as on Ctrl-C; returns what restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@dataclass
class _Child:
    """One bench process of a Spread: its GPU, its process, the tail of its stderr."""

    gpu: int
    proc: subprocess.Popen
    stdout: Path
    started: float
    ended: float | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=STDERR_TAIL))
    reader: threading.Thread | None = None


class Spread:
    """`files` run by one bench process per device (`--gpus N`): the same command (`bench BENCH --dir
    FOLDER --json`) with CUDA_VISIBLE_DEVICES set to its GPU and `--queue` to a shared queue, from which
    each takes the next untaken problem (queue_order); each appends its rows to its own results file
    (`parts`). Their [suite-row] lines are passed on to stderr as they come, their other stderr lines
    prefixed with their GPU. A process that dies having taken a problem is replaced on its GPU while
    problems are left; a problem without a row becomes an error row naming the process's exit code and
    its last stderr lines. Ctrl-C (or SIGTERM) stops every process (SIGINT, then SIGKILL after
    STOP_GRACE_S)."""

    def __init__(self, bench: str, folder: Path, files: list[Path], devices: list[str], work: Path,
                 parts: list[Path], *, llm: str | None, compile_only: bool, json_output: bool,
                 env: dict[str, str] | None = None, on_row: Callable[[dict], None] | None = None,
                 precision: str = "fp32", no_compile: bool = False) -> None:
        self.bench, self.folder, self.devices, self.parts = bench, folder, devices, parts
        self.names = _device_names(devices)
        self.llm, self.compile_only, self.json_output = llm, compile_only, json_output
        self.no_compile = no_compile
        self.precision = precision
        self.env, self.on_row = env or {}, on_row
        self.files = queue_order(files)
        self.queue = work / "queue"
        (self.queue / "claims").mkdir(parents=True)
        (self.queue / "queue.json").write_text(json.dumps([str(p.resolve()) for p in self.files]), encoding="utf-8")
        self.children: list[_Child] = []
        self.lock = threading.Lock()  # one line at a time on stdout and stderr, one CSV writer
        self.started = self.ended = 0.0

    def _say(self, line: str) -> None:
        with self.lock:
            print(line, file=sys.stderr, flush=True)

    def _command(self, gpu: int) -> list[str]:
        command = [sys.executable, "-m", "stitchcuda", "bench", self.bench, "--dir", str(self.folder), "--queue",
                   str(self.queue), "--results", str(self.parts[gpu]), "--json"]
        if self.compile_only:
            command.append("--compile-only")
        if self.no_compile:
            command.append("--no-compile")
        if self.llm:
            command += ["--llm", self.llm]
        if self.precision != "fp32":
            command += ["--precision", self.precision]
        return command

    def _start(self, gpu: int) -> None:
        stdout = self.queue.parent / f"gpu{gpu}-{sum(c.gpu == gpu for c in self.children)}.json"
        with stdout.open("wb") as out:  # the process's JSON report: the hardware it ran on
            proc = subprocess.Popen(self._command(gpu), env=_child_environment(self.devices[gpu], self.env),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.PIPE, text=True,
                                    errors="replace")
        child = _Child(gpu, proc, stdout, time.perf_counter())
        child.reader = threading.Thread(target=self._relay, args=(child,), daemon=True)
        child.reader.start()
        self.children.append(child)
        self._say(f"[gpus] GPU {gpu} ({self.names[gpu]}, CUDA_VISIBLE_DEVICES={self.devices[gpu]!r}): pid {proc.pid}")

    def _relay(self, child: _Child) -> None:
        for line in child.proc.stderr:
            line = line.rstrip("\n")
            if not line.startswith(ROW_PREFIX):
                child.tail.append(line)
                self._say(f"[gpu {child.gpu}] {line}")
                continue
            try:
                row = json.loads(line[len(ROW_PREFIX):])
            except json.JSONDecodeError:
                row = None
            with self.lock:
                print(line, file=sys.stderr, flush=True)
                if isinstance(row, dict):
                    if not self.json_output:
                        print(f"[suite] {row.get('model')}: done (GPU {child.gpu})", file=sys.stderr, flush=True)
                    if self.on_row is not None:
                        self.on_row(row)

    def run(self) -> Spread:
        restore = _interrupt_on_sigterm()
        self.started = time.perf_counter()
        try:
            for gpu in range(min(len(self.devices), len(self.files))):
                self._start(gpu)
            while self._poll():
                time.sleep(0.1)
        except BaseException:  # Ctrl-C, SIGTERM, a process that cannot start: none is left running
            self._stop()
            raise
        finally:
            restore()
        self.ended = time.perf_counter()
        for child in self.children:  # the last lines; a lingering grandchild holding the pipe is not waited for
            child.reader.join(timeout=2)
        return self

    def _poll(self) -> bool:
        """Notes the processes that ended, replaces one that died after taking a problem while problems
        are left (each replacement follows a taken problem, so this ends); True while any runs."""
        for child in list(self.children):
            if child.ended is not None or child.proc.poll() is None:
                continue
            child.ended = time.perf_counter()
            code = child.proc.returncode
            if code == 0:
                continue
            claims = queue_claims(self.queue)
            taken = [i for i, pid in claims.items() if pid == child.proc.pid]
            what = f"[gpus] GPU {child.gpu}: pid {child.proc.pid} {_ended(code)}"
            if taken and len(claims) < len(self.files):
                self._say(f"{what} after taking {self.files[max(taken)].stem}; starting another for the problems left")
                self._start(child.gpu)
            else:
                self._say(what)
        return any(c.ended is None for c in self.children)

    def _stop(self) -> None:
        live = [c for c in self.children if c.proc.poll() is None]
        try:
            for child in live:
                child.proc.send_signal(signal.SIGINT)
            deadline = time.monotonic() + STOP_GRACE_S
            for child in live:
                try:
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.proc.kill()
        finally:  # a second Ctrl-C while they stop: kill them at once
            for child in live:
                if child.proc.poll() is None:
                    child.proc.kill()
                child.proc.wait()
        self._say(f"[gpus] stopped {len(live)} bench process(es)")

    def rows(self) -> dict[str, dict]:
        """Every queued problem's row, by stem: the one its process wrote, else an error row."""
        mode = row_mode(self.compile_only, self.no_compile)
        measured: dict[str, dict] = {}
        for part in self.parts:
            measured.update(read_results(part))
        claims = queue_claims(self.queue)
        by_pid = {c.proc.pid: c for c in self.children}
        for index, path in enumerate(self.files):
            if path.stem not in measured:
                measured[path.stem] = self._lost_row(new_row(path, mode, self.precision),
                                                     by_pid.get(claims.get(index, -1)))
        return measured

    def _lost_row(self, row: dict, child: _Child | None) -> dict:
        """A problem whose process ended without writing its row (`child`), or that no process reached."""
        if self.llm:
            row["llm"] = self.llm
        row["correct"] = False
        if child is not None:
            text = f"the bench process on GPU {child.gpu} (pid {child.proc.pid}) {_ended(child.proc.returncode)} " \
                   "before writing this problem's row"
            row["process"] = {"gpu": child.gpu, "device": self.devices[child.gpu], "pid": child.proc.pid,
                              "exit": child.proc.returncode, "stderr_tail": list(child.tail)}
            tail = list(child.tail)
        else:
            last = {c.gpu: c for c in self.children}  # the last process of each GPU
            text = "not run: every bench process ended before reaching it (" + \
                   ", ".join(f"GPU {c.gpu} {_ended(c.proc.returncode)}" for c in last.values()) + ")"
            row["process"] = {"exits": {str(g): c.proc.returncode for g, c in last.items()}}
            tail = next((list(c.tail) for c in last.values() if c.tail), [])
        if tail:
            text += "; its last stderr lines:\n" + "\n".join(f"      {line}" for line in tail[-5:])
        row["errors"]["process"] = text
        return row

    def section(self) -> dict:
        """The "gpus" section of the JSON: the devices, the wall time, what each GPU ran and how long."""
        claims = queue_claims(self.queue)
        per_gpu = []
        for gpu in sorted({c.gpu for c in self.children}):
            mine = [c for c in self.children if c.gpu == gpu]
            pids = {c.proc.pid for c in mine}
            per_gpu.append({"gpu": gpu, "device": self.devices[gpu], "name": self.names[gpu],
                            "problems": [self.files[i].stem for i in sorted(claims) if claims[i] in pids],
                            "wall_s": max(c.ended for c in mine) - min(c.started for c in mine),
                            "exits": [c.proc.returncode for c in mine]})
        return {"gpus": len(self.devices), "wall_s": self.ended - self.started, "per_gpu": per_gpu,
                "devices": self.names, "queue": "one shared queue, whole networks first; each process takes "
                                                "the next problem no other has taken"}

    def hardware(self) -> dict | None:
        """The hardware the first process that finished reports (its JSON on stdout)."""
        for child in self.children:
            try:
                report = json.loads(child.stdout.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(report, dict) and isinstance(report.get("hardware"), dict):
                return report["hardware"]
        return None


def compare_runs(one: list[dict], many: list[dict], tolerance: float = SPEEDUP_TOLERANCE) -> list[dict]:
    """Per problem of `many`, whether its row agrees with the same problem's row in `one`: the same
    status, the same failing stages, the same correctness, and each speed-up of AGREEMENT_COLUMNS that
    either row has present in both and within `tolerance` (max / min - 1)."""
    first = {r["model"]: r for r in one}
    out = []
    for r in many:
        a = first.get(r["model"], {})
        entry: dict[str, Any] = {"model": r["model"], "status": [a.get("status"), r.get("status")],
                                 "correct": [a.get("correct"), r.get("correct")]}
        differences = [f"{key} {a.get(key)} vs {r.get(key)}" for key in ("status", "correct")
                       if a.get(key) != r.get(key)]
        stages = sorted(a.get("errors") or {}), sorted(r.get("errors") or {})
        if stages[0] != stages[1]:
            differences.append(f"errors in {', '.join(stages[0]) or 'nothing'} vs {', '.join(stages[1]) or 'nothing'}")
        for key in AGREEMENT_COLUMNS:
            x, y = a.get(key), r.get(key)
            if x is None and y is None:
                continue
            entry[key] = [x, y]
            if not (isinstance(x, (int, float)) and isinstance(y, (int, float)) and x > 0 and y > 0):
                differences.append(f"{key} {fmt(x, '.2f')} vs {fmt(y, '.2f')}")
            elif max(x, y) / min(x, y) - 1 > tolerance:
                differences.append(f"{key} {x:.2f} vs {y:.2f} ({100 * (max(x, y) / min(x, y) - 1):.0f}% apart)")
        out.append({**entry, "agree": not differences, "differences": differences})
    return out


def scaling_report(one: Spread, many: Spread, rows_one: list[dict], rows_many: list[dict]) -> dict:
    """The "scaling" section: both walls, speed-up, efficiency = wall_1 / (N x wall_N), per-problem
    agreement (compare_runs), and the one-GPU run's own section, summary and rows."""
    n, wall_1, wall_n = len(many.devices), one.ended - one.started, many.ended - many.started
    problems = compare_runs(rows_one, rows_many)
    note = ("N = 1: both runs used the one GPU, so efficiency is 1.0 by definition; the printed value is "
            "run-to-run variation" if n == 1 else
            f"efficiency 1.0 is perfect scaling over {n} GPUs")
    return {"gpus": n, "wall_1_s": wall_1, "wall_n_s": wall_n, "speedup": wall_1 / wall_n if wall_n else None,
            "efficiency": wall_1 / (n * wall_n) if wall_n else None, "note": note + "; each run started with "
            "empty compile caches of its own: StitchCUDA's kernel cache and torch.compile's",
            "agree": sum(p["agree"] for p in problems), "compared": ["status", "errors", "correct", *AGREEMENT_COLUMNS],
            "tolerance": SPEEDUP_TOLERANCE, "problems": problems,
            "one_gpu": {"gpus": one.section(), "summary": full_summary(rows_one), "models": rows_one}}


def format_gpus(section: dict) -> str:
    """The lines after the table of a --gpus run: the devices, the wall time, what each GPU ran."""
    on_cpu = not any(g["device"] for g in section["per_gpu"]) and all(n == "cpu" for n in section["devices"])
    where = (f"in {section['gpus']} processes on the CPU" if on_cpu else
             f"on {section['gpus']} GPU(s) ({devices_label(section['devices'])})")
    lines = [f"{where}: wall {section['wall_s']:.1f} s; {section['queue']}"]
    for g in section["per_gpu"]:
        exits = [code for code in g["exits"] if code != 0]
        lines.append(f"  GPU {g['gpu']} ({g['name']}, CUDA_VISIBLE_DEVICES={g['device']!r}): {len(g['problems'])} "
                     f"problem(s) in {g['wall_s']:.1f} s" + (f"; process exits {g['exits']}" if exits else ""))
    return "\n".join(lines)


def format_scaling(s: dict) -> str:
    n = s["gpus"]
    lines = [f"scaling: 1 GPU {s['wall_1_s']:.1f} s, {n} GPU(s) {s['wall_n_s']:.1f} s: {fmt(s['speedup'], '.2f')}x, "
             f"efficiency {fmt(s['efficiency'], '.2f')} = wall_1 / ({n} x wall_{n}) ({s['note']})",
             f"agreement: {s['agree']}/{len(s['problems'])} problems agree between the two runs (status, failing "
             f"stages and correctness the same; {', '.join(AGREEMENT_COLUMNS)} within {s['tolerance']:.0%})"]
    lines += [f"  {p['model']}: {'; '.join(p['differences'])}" for p in s["problems"] if not p["agree"]]
    return "\n".join(lines)


def spread_usage(gpus: int, chunk: str | None, chunk_from_flag: bool, results: Path | str | None,
                  scaling_run: bool) -> str | None:
    """Why --gpus / --scaling cannot run with these options, or None."""
    if chunk:
        source = "--chunk" if chunk_from_flag else f"STITCHCUDA_SUITE_CHUNK={chunk}"
        return (f"--gpus splits the selected problems over the GPUs itself, and {source} selects a share for a "
                f"separate run; pass one of them (--only picks the problems of a --gpus run)")
    if scaling_run and results is not None:
        return ("--scaling measures every problem twice, from scratch, and a resumed run's wall time means "
                "nothing; drop --results (--json carries both runs' rows)")
    return None
