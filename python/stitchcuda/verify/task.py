"""What a candidate is judged against: a KernelBench-format problem (``Model``, ``get_inputs()``,
``get_init_inputs()``, module-level sizes) or a live ``nn.Module`` with an input generator, judged under
a tolerance policy by dtype (``Tolerance``, from verify/tolerance.py).
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import os
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import InvalidArgumentError
from .tolerance import Tolerance  # the policy lives with the table it reads; re-exported here

__all__ = ["Task", "Tolerance", "TaskError", "load_source_module", "spec_key"]

_module_counter = itertools.count()


class TaskError(InvalidArgumentError):
    """A reference problem that cannot be used: unreadable, not Python, no ``Model``, no inputs."""

    code = "InvalidArgument"


def load_source_module(source: str, filename: str, prefix: str) -> types.ModuleType:
    """Executes ``source`` as a fresh module (registered in sys.modules while it runs, so
    dataclasses, pickling and torch.compile can find it). Exceptions propagate to the caller."""
    name = f"_stitchcuda_{prefix}_{os.getpid()}_{next(_module_counter)}"
    module = types.ModuleType(name)
    module.__file__ = filename
    code = compile(source, filename, "exec")
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@dataclass
class Task:
    """A reference problem. Build one with :meth:`from_file`, :meth:`from_source` or :meth:`from_module`.

    ``sizes`` holds the problem's module-level integer and float constants (``batch_size = 128``);
    ``tolerance`` is the per-dtype policy used unless the VerifyConfig overrides it.
    """

    name: str
    source: str | None = None  # the problem file (None for from_module)
    sizes: dict[str, int | float] = field(default_factory=dict)
    tolerance: Tolerance = field(default_factory=Tolerance)
    _payload: bytes | None = field(default=None, repr=False)  # pickled (model, make_inputs, init_inputs)
    _module: Any = field(default=None, repr=False, compare=False)

    # ---- construction

    @classmethod
    def from_file(cls, path: str | os.PathLike, tolerance: Tolerance | None = None) -> "Task":
        """Reads a KernelBench-format problem file; TaskError says what is wrong with it."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise TaskError(f"cannot read the reference {path!r}: {exc}") from None
        return cls.from_source(text, os.path.splitext(os.path.basename(path))[0] or path,
                               tolerance=tolerance, filename=path)

    @classmethod
    def from_source(cls, text: str, name: str = "problem", tolerance: Tolerance | None = None,
                    filename: str | None = None, isolated: bool = False) -> "Task":
        """A problem given as source text. Runs the file once to check it defines ``Model`` (an
        nn.Module), ``get_inputs()`` and optionally ``get_init_inputs()``. ``isolated``: import it first
        in a separate process (``preflight``), so that a file that crashes, exits or hangs at import is a
        TaskError naming it, never the end of this process."""
        if not isinstance(text, str) or not text.strip():
            raise TaskError(f"the reference {name!r} is empty.")
        try:
            tree = ast.parse(text)
        except SyntaxError as exc:
            raise TaskError(f"the reference {name!r} is not valid Python: {exc.msg} (line {exc.lineno}).") \
                from None
        except (ValueError, RecursionError) as exc:
            raise TaskError(f"the reference {name!r} cannot be parsed: {exc}") from None
        defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        defined |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name)}
        defined |= {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                    for a in n.names}
        missing = [n for n in ("Model", "get_inputs") if n not in defined]
        if isolated:
            preflight(text, filename or f"<reference {name}>")
        task = cls(name=name, source=text, tolerance=tolerance or Tolerance())
        if missing:
            # Not at the top level. A file that raises says so first (the exception is what to fix); one
            # that loads and still lacks them gets the file's layout.
            task._load(filename or f"<reference {name}>", required=False)
            raise TaskError(f"the reference {name!r} does not define {' or '.join(missing)}; a problem "
                            "file needs class Model(nn.Module), get_inputs() and get_init_inputs().")
        task._module = task._load(filename or f"<reference {name}>")
        task.sizes = {k: v for k, v in vars(task._module).items()
                      if not k.startswith("_") and type(v) in (int, float)}
        return task

    @classmethod
    def from_module(cls, model: torch.nn.Module, make_inputs: Callable[..., Sequence[Any]],
                    init_inputs: Sequence[Any] | None = None, name: str | None = None,
                    tolerance: Tolerance | None = None) -> "Task":
        """A live reference: ``model`` as built, ``make_inputs()`` returning the forward arguments
        (called after ``torch.manual_seed(seed)``; it may accept a ``seed`` keyword), and the
        constructor arguments ``ModelNew`` takes. The candidate gets the reference's weights when its
        state_dict has the same keys and shapes. Model and generator must pickle (a module-level
        function, not a lambda) because candidates run in a separate process."""
        if not isinstance(model, torch.nn.Module):
            raise TaskError(f"from_module needs an nn.Module, got {type(model).__name__}.")
        if not callable(make_inputs):
            raise TaskError("from_module needs a callable that returns the forward inputs.")
        init = list(init_inputs or [])
        try:
            payload = pickle.dumps((model, make_inputs, init))
        except Exception as exc:  # lambdas, local classes, open handles
            raise TaskError(f"the reference model or its input generator cannot be sent to a worker "
                            f"process ({type(exc).__name__}: {exc}); define them at module level.") from None
        task = cls(name=name or type(model).__name__, source=None, tolerance=tolerance or Tolerance(),
                   _payload=payload)
        task._module = (model, make_inputs, init)
        return task

    def _load(self, filename: str, required: bool = True) -> types.ModuleType:
        """The problem file as a module; TaskError when it raises, or (`required`) when Model or
        get_inputs is not what a problem file needs."""
        try:
            module = load_source_module(self.source, filename, "reference")
        except (Exception, SystemExit) as exc:
            raise TaskError(f"the reference {self.name!r} raised while loading: "
                            f"{type(exc).__name__}: {exc}") from None
        if not required:
            return module
        model = getattr(module, "Model", None)
        if not (isinstance(model, type) and issubclass(model, torch.nn.Module)):
            raise TaskError(f"the reference {self.name!r}: Model is not an nn.Module class.")
        if not callable(getattr(module, "get_inputs", None)):
            raise TaskError(f"the reference {self.name!r}: get_inputs is not a function.")
        return module

    # ---- transport to a worker process

    def to_spec(self) -> dict[str, Any]:
        """A picklable description a worker rebuilds the task from."""
        return {"name": self.name, "source": self.source, "payload": self._payload,
                "tolerance": self.tolerance.to_dict()}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "Task":
        tolerance = Tolerance.from_dict(spec["tolerance"])
        if spec.get("source") is not None:
            return cls.from_source(spec["source"], spec["name"], tolerance=tolerance)
        try:
            model, make_inputs, init = pickle.loads(spec["payload"])
        except Exception as exc:
            raise TaskError(f"the reference {spec['name']!r} could not be rebuilt in the worker "
                            f"({type(exc).__name__}: {exc}).") from None
        task = cls(name=spec["name"], tolerance=tolerance, _payload=spec["payload"])
        task._module = (model, make_inputs, init)
        return task

    @property
    def key(self) -> str:
        """Hash of the problem (source or pickled model), for caches of compiled references."""
        return spec_key(self.to_spec())

    # ---- what the harness uses

    def init_inputs(self) -> list[Any]:
        """Constructor arguments of Model and ModelNew."""
        if self.source is None:
            return list(self._module[2])
        fn = getattr(self._module, "get_init_inputs", None)
        if fn is None:
            return []
        try:
            value = fn()
        except Exception as exc:
            raise TaskError(f"get_init_inputs() of {self.name!r} raised {type(exc).__name__}: {exc}") from None
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def make_inputs(self, seed: int) -> list[Any]:
        """The problem's own inputs for ``seed`` (on the CPU, as the problem builds them)."""
        torch.manual_seed(seed)
        try:
            if self.source is None:
                fn = self._module[1]
                try:
                    value = fn(seed=seed)
                except TypeError:
                    torch.manual_seed(seed)
                    value = fn()
            else:
                value = self._module.get_inputs()
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"the input generator of {self.name!r} raised {type(exc).__name__}: {exc}") \
                from None
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def build_reference(self, seed: int) -> torch.nn.Module:
        """The reference model; for a problem file, built after ``torch.manual_seed(seed)`` so a
        candidate built after the same seed gets the same weights."""
        if self.source is None:
            return self._module[0]
        torch.manual_seed(seed)
        try:
            return self._module.Model(*self.init_inputs())
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"Model(*get_init_inputs()) of {self.name!r} raised "
                            f"{type(exc).__name__}: {exc}") from None

    @property
    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """For a live module: its state_dict, given to a candidate with the same parameter layout."""
        return self._module[0].state_dict() if self.source is None else None


def spec_key(spec: dict[str, Any]) -> str:
    """``Task.key`` of a spec, without rebuilding the task (which runs the problem's code): the judge keys
    its reference runs by it."""
    data = spec["source"].encode() if spec.get("source") is not None else (spec.get("payload") or b"")
    return hashlib.sha256(data).hexdigest()[:16]


# ---- importing a file nobody has run here yet -----------------------------------------------------

_PREFLIGHT = r"""
import os, sys
source = sys.stdin.read()
folder = os.path.dirname(os.path.abspath(sys.argv[1]))
if os.path.isdir(folder):
    sys.path.insert(0, folder)  # modules beside the file import, as when it runs as a script
namespace = {"__name__": "stitchcuda_preflight", "__file__": sys.argv[1]}

def stage(name):  # the parent words a crash or an exit by the last stage it read
    sys.stdout.write("stitchcuda-preflight-stage " + name + "\n")
    sys.stdout.flush()

exec(compile(source, sys.argv[1], "exec"), namespace)
if sys.argv[2:] == ["run"]:
    try:
        stage("build")
        import torch
        init = namespace["get_init_inputs"]() if "get_init_inputs" in namespace else []
        model = namespace["Model"](*init).eval()
        inputs = namespace["get_inputs"]()
        if torch.cuda.is_available():
            model = model.cuda()
            inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
        stage("forward")
        with torch.no_grad():
            model(*inputs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except SystemExit as exc:
        sys.stdout.write("stitchcuda-preflight-exit " + repr(exc.code)[:80] + "\n")
        sys.stdout.flush()
        raise
sys.stdout.write("stitchcuda-preflight-ok\n")
sys.stdout.flush()
"""
_PREFLIGHTED: set[str] = set()  # sources (and ":run" for those whose model also ran) that passed
PREFLIGHT_TIMEOUT_S = 120.0
_STAGES = {"import": "importing", "build": "building its Model or its inputs", "forward": "running Model.forward"}


def preflight(source: str, filename: str, timeout_s: float = PREFLIGHT_TIMEOUT_S, *, run_model: bool = False) -> None:
    """Imports `source` once in a separate Python process (without the environment's secrets): a file
    that crashes (a signal), exits (``os._exit``, ``sys.exit``) or hangs at import raises TaskError
    naming `filename` and the cause instead of ending or blocking this process. ``run_model``: it also
    builds ``Model(*get_init_inputs())`` and runs its forward once on ``get_inputs()`` (on the GPU when
    there is one), for callers that run the model in their own process (graph mode's ``optimize FILE``).
    A Python exception is left for the caller's own load to report. Each source is checked once per
    process."""
    import signal
    import subprocess

    digest = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest() + (":run" if run_model else "")
    if digest in _PREFLIGHTED:
        return
    import shutil
    import tempfile

    from . import sandbox
    from .environment import sandbox_wanted, worker_environment

    # The same sandbox as the Verifier's workers (verify/sandbox.py), with a private folder of its own.
    private = tempfile.mkdtemp(prefix="stitchcuda-preflight-")
    argv = [sys.executable, "-c", _PREFLIGHT, filename] + (["run"] if run_model else [])
    command = sandbox.command(private, sandbox_wanted(None), argv)
    try:
        done = subprocess.run(command, input=source, capture_output=True, text=True, timeout=timeout_s,
                              env=worker_environment(), start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stage = _stage(out)
        hint = " (a loop or a wait at module level?)" if stage == "import" else ""
        raise TaskError(f"the file {filename!r} did not finish {_STAGES[stage]} within {timeout_s:g} s{hint}; it "
                        "was stopped") from None
    except OSError:  # no interpreter to start: the caller's own load is all there is
        return
    finally:
        shutil.rmtree(private, ignore_errors=True)
    while_ = f"while {_STAGES[_stage(done.stdout)]}"
    if done.returncode < 0:
        try:
            sig = signal.Signals(-done.returncode).name
        except ValueError:
            sig = f"signal {-done.returncode}"
        raise TaskError(f"the file {filename!r} crashed {while_} ({sig}); it is not loaded here")
    if "stitchcuda-preflight-ok" not in done.stdout:
        if done.returncode != 0 and "Traceback" in done.stderr:
            return  # a Python exception: the caller's load names it
        called = [line for line in done.stdout.splitlines() if line.startswith("stitchcuda-preflight-exit ")]
        if called:
            raise TaskError(f"the file {filename!r} called sys.exit({called[-1].split(' ', 1)[1]}) {while_}; it is "
                            "not loaded here")
        raise TaskError(f"the file {filename!r} ended the process {while_} (exit status {done.returncode}); it is "
                        "not loaded here")
    _PREFLIGHTED.add(digest)
    if run_model:
        _PREFLIGHTED.add(digest.removesuffix(":run"))  # it imported, too


def _stage(stdout: str) -> str:
    """The last stage the preflight's child announced ("import" when it announced none)."""
    stages = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("stitchcuda-preflight-stage ")]
    return stages[-1] if stages and stages[-1] in _STAGES else "import"

