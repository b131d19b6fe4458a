"""StitchCUDA: compile CUDA C++ in-process with NVRTC and run it on PyTorch tensors; talk to models.

Start with :func:`stitchcuda.jit.compile` or :func:`stitchcuda.llm.connect`; ``stitchcuda doctor``
checks the machine.
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
from .program import Program, ProgramBuilder, ProgramModule, load
from .graph import OptimizedModule, optimize
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
           "optimize", "OptimizedModule", "rubric", "reward",
           *errors.__all__]
