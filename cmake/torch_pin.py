"""The wheel's run-time requirements, computed when it is built (a scikit-build-core metadata provider:
pyproject.toml's [[tool.dynamic-metadata]]).

stitchcuda._C links LibTorch's C++ ABI, which changes between torch's minor versions: a wheel built
against torch X.Y requires torch==X.Y.*, whatever torch the build found. The other requirements are the
provider's `requires` setting, written out in pyproject.toml.
"""

from __future__ import annotations

from typing import Any, Mapping


def torch_requirement() -> str:
    """``torch==X.Y.*`` for the torch this interpreter imports."""
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(
            "building stitchcuda needs torch importable at build time (its extension compiles against "
            f"LibTorch), but `import torch` failed: {exc}. Install torch first and build without isolation: "
            "pip install --no-build-isolation .") from None
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def dynamic_metadata(settings: Mapping[str, Any], project: Mapping[str, Any]) -> dict[str, Any]:
    requires = settings.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise RuntimeError("[[tool.dynamic-metadata]] torch_pin: `requires` must be a list of requirement strings")
    return {"dependencies": [torch_requirement(), *requires]}


def dynamic_wheel(settings: Mapping[str, Any]) -> dict[str, bool]:
    # An sdist cannot know the torch its wheel will be built against: its dependencies are marked Dynamic.
    return {"dependencies": True}
