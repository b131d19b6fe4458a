"""The package's import rules (docs/architecture.md, "Layers and import rules"): import-linter's contracts in
.importlinter, and the two rules it cannot say, checked here on the source: no circle between any two modules
of python/stitchcuda, and no import of another module's private name.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "stitchcuda"

# Private names imported across modules before the rule existed, each a helper to make public (or to move)
# where it is defined. An entry leaves once its import is gone (the test fails while a fixed one stays
# listed); nothing may join.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(package: Path = PACKAGE) -> dict[str, list[tuple[int, str, str | None]]]:
    """Per module of `package`: (line, imported module, imported name or None) for every import of a
    StitchCUDA module anywhere in it, those inside functions too (a circle through a deferred import is
    still a circle). `from pkg import sub` where sub is a module counts as an import of the module."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    found: dict[str, list[tuple[int, str, str | None]]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        entries = found.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                entries += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "stitchcuda"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "stitchcuda":
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    entries.append((node.lineno, sub, None) if sub in modules else (node.lineno, source, alias.name))
    return found


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def _private_imports(imports: dict[str, list[tuple[int, str, str | None]]]) -> set[tuple[str, str, str]]:
    """(importer, module, name) for each `from module import _name` of another module. A private *module*
    (stitchcuda._C, the native extension) is the package's own and not counted."""
    return {(importer, module, name) for importer, entries in imports.items() for _, module, name in entries
            if name is not None and name.startswith("_") and not name.startswith("__") and module != importer
            and name != "_C"}


def test_lint_imports_holds_the_contracts():
    """.importlinter: the layers, the CLI on top, no circle between the subpackages or modules of one package."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports is not installed: pip install import-linter (the dev dependencies have it)")
    # The tree's package, not an installed copy of it: python/ first on the path (an editable install maps there).
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = done.stdout[done.stdout.find("Contracts"):]  # after import-linter's banner
    assert done.returncode == 0, report[-12000:] + done.stderr[-4000:]


def test_no_module_imports_one_that_imports_it_back():
    imports = _imports()
    edges = {importer: {module for _, module, _ in entries
                        if module in imports and module not in (importer, "stitchcuda")}
             for importer, entries in imports.items()}
    # The package itself (`from .. import _C`) is imported before any of its modules: no edge of a circle.
    circles = _circles(edges)
    assert not circles, "import circles (each list imports itself back): " + "; ".join(map(str, circles))


def test_no_module_imports_another_modules_private_name():
    found = _private_imports(_imports())
    new = sorted(found - KNOWN_PRIVATE_IMPORTS)
    assert not new, ("import of another module's private name; make it public where it is defined, or move it: "
                     + "; ".join(f"{i} imports {n} from {m}" for i, m, n in new))
    fixed = sorted(KNOWN_PRIVATE_IMPORTS - found)
    assert not fixed, "no longer imported: remove from KNOWN_PRIVATE_IMPORTS: " + "; ".join(map(str, fixed))


def test_the_checks_see_a_circle_and_a_private_import(tmp_path):
    """The two source checks on a small package of their own: a circle through a deferred import and a
    private name are found; a public import and the package's own native module are not."""
    package = tmp_path / "stitchcuda"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from . import _C\nfrom .b import helper, _hidden\n")
    (package / "b.py").write_text("def helper():\n    from .sub import c\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from ..a import thing\n")
    imports = _imports(package)
    edges = {i: {m for _, m, _ in e if m in imports and m not in (i, "stitchcuda")} for i, e in imports.items()}
    assert _circles(edges) == [["stitchcuda.a", "stitchcuda.b", "stitchcuda.sub.c"]]
    assert _private_imports(imports) == {("stitchcuda.a", "stitchcuda.b", "_hidden")}
