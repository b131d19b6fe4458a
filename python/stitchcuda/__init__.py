"""StitchCUDA: turns a PyTorch model into an optimized, verified CUDA program — fused kernels and the host
code that stitches them — kept only when it is correct and faster than the model.

Start with :func:`stitchcuda.optimize` (or ``torch.compile(model, backend="stitchcuda")``); the result's
``report`` says what was done and why, and ``save()`` writes the program for :func:`stitchcuda.load` or a
C++ server. ``llm=`` adds the agents (:mod:`stitchcuda.agents`, :mod:`stitchcuda.llm`); the layers below
are usable alone: :mod:`stitchcuda.jit` (CUDA C++ compiled in the process with NVRTC),
:mod:`stitchcuda.verify`, :mod:`stitchcuda.profile`, and :mod:`stitchcuda.rl` for RL training.
``stitchcuda doctor`` checks the machine.
"""

# torch first: the native module links against LibTorch, whose libraries must already be loaded.
import torch  # noqa: F401

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - depends on the build state
    raise ImportError(
        f"stitchcuda's native module stitchcuda._C could not be imported ({exc}). "
        "Build it from the repository root with `make build` (or install the package with "
        "`pip install .`), using the same Python and torch as this interpreter."
    ) from exc

from . import agents, errors, jit, llm, profile, rubric
from .rubric import reward
from .program import (DecodePrograms, FamilyExecutor, FamilyModule, LoadedGenerator, Program, ProgramBuilder, ProgramFamily,
                      ProgramModule, load)
from .graph import OptimizedModule, StaticCacheGenerator, TransformersStaticCacheLM, optimize
from .doctor import doctor
from .errors import (
    CancelledError,
    CompileError,
    CudaError,
    Diagnostic,
    InternalError,
    InvalidArgumentError,
    LaunchError,
    LLMError,
    NotFoundError,
    StitchError,
    StitchIOError,
    StitchTimeoutError,
    UnavailableError,
)

__version__: str = _C.version()


def __getattr__(name: str):
    # stitchcuda.rl (the RL environment) loads on first use: importing stitchcuda stays free of it.
    if name == "rl":
        import importlib

        return importlib.import_module(".rl", __name__)
    raise AttributeError(f"module 'stitchcuda' has no attribute {name!r}")

__all__ = ["__version__", "agents", "jit", "llm", "profile", "errors", "doctor", "Program", "ProgramBuilder", "ProgramModule", "load",
           "ProgramFamily", "FamilyExecutor", "FamilyModule", "DecodePrograms", "LoadedGenerator",
           "optimize", "OptimizedModule", "StaticCacheGenerator", "TransformersStaticCacheLM", "rubric", "reward",
           *errors.__all__]
