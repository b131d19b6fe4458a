"""stitchcuda.settings: the one table of environment variables holds every variable the code names, the
Python code reads them only through it, docs/environment.md is its generated text, and bad values are
refused with a message naming the variable and what it takes."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stitchcuda import settings as st

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "stitchcuda"
SOURCE_SUFFIXES = {".py", ".cpp", ".hpp", ".h", ".cu", ".cuh"}
# STITCHCUDA_ names that are not environment variables: the build's version macro and a CMake variable.
BUILD_NAMES = {"STITCHCUDA_VERSION", "STITCHCUDA_TORCH_PYTHON_LIBRARY"}
# Folders and files that still read the environment themselves: their owners move them onto settings().
# An entry leaves once its reads go through settings(); nothing may join.
NOT_YET_MIGRATED = ()
NAME = re.compile(r"\bSTITCHCUDA_[A-Z0-9_]*[A-Z0-9]\b")


def _sources() -> list[Path]:
    return [p for folder in (PACKAGE, ROOT / "src", ROOT / "bindings") for p in sorted(folder.rglob("*"))
            if p.suffix in SOURCE_SUFFIXES and p.is_file()]


def test_every_variable_the_code_names_is_in_the_table():
    declared = st.variable_names()
    missing = {}
    for path in _sources():
        for name in set(NAME.findall(path.read_text(errors="replace"))) - declared - BUILD_NAMES:
            missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, ("variables named in the code but not declared in python/stitchcuda/settings (add "
                         f"each to Settings or OTHER_VARIABLES): {missing}")


def _cpp_table() -> dict[str, tuple[str, str]]:
    """The C++ library's table, {name: (fallback, reason)}: from the binding where the module has it, else
    read from its source (src/core/settings.cpp)."""
    from stitchcuda import _C

    if hasattr(_C, "cpp_settings"):
        rows = _C.cpp_settings()
        return {r["name"]: (r["fallback"], r["reason"]) for r in rows}
    row = re.compile(r'\{Setting::\w+, "(\w+)", "\w+", "([^"]*)", "((?:[^"\\]|\\.)*)"\}')
    return {name: (fallback, reason) for name, fallback, reason in
            row.findall((ROOT / "src" / "core" / "settings.cpp").read_text())}


def test_the_cpp_table_and_this_one_agree():
    cpp = _cpp_table()
    assert "STITCHCUDA_NVRTC" in cpp and "STITCHCUDA_TF32X3_CHUNK" in cpp, "the C++ table was not read"
    ours = {s.name: s for s in st.declared() if s.side in ("C++", "both") and s.name.startswith("STITCHCUDA_")}
    assert sorted(ours) == sorted(cpp), \
        "declare the C++ table's rows in stitchcuda.settings, and only those, as C++/both"
    for name, (fallback, reason) in cpp.items():
        if ours[name].side == "C++":  # the rows the C++ alone reads say what the C++ says
            assert (ours[name].reason, ours[name].shown_default()) == (reason, fallback or "unset"), name
        elif fallback:
            assert ours[name].shown_default() == fallback, name


def _environment_reads(tree: ast.AST, constants: dict[str, str]) -> list[tuple[int, str]]:
    """(line, variable) of each os.environ.get / os.getenv / os.environ[...] / `in os.environ` of a
    STITCHCUDA_ variable, named directly or through a module constant."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    def text(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, (ast.Name, ast.Attribute)):
            return constants.get(node.id if isinstance(node, ast.Name) else node.attr)
        return None

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "get" and is_environ(f.value)) or f.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        value = text(key) if key is not None else None
        if value and value.startswith("STITCHCUDA_"):
            reads.append((node.lineno, value))
    return reads


def test_python_reads_go_through_settings():
    trees = {p: ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    constants = {t.id: n.value.value for tree in trees.values() for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
                 and isinstance(n.value.value, str) and n.value.value.startswith("STITCHCUDA_")}
    direct = {}
    for path, tree in trees.items():
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith((*NOT_YET_MIGRATED, "settings/")):
            continue
        for line, name in _environment_reads(tree, constants):
            direct.setdefault(where, []).append(f"{name} (line {line})")
    assert not direct, f"read stitchcuda.settings.settings() instead of the environment: {direct}"


def test_the_scan_sees_a_direct_read():
    tree = ast.parse("import os\nA = 'STITCHCUDA_X'\nos.environ.get('STITCHCUDA_Y')\nos.getenv(A)\n"
                     "os.environ['STITCHCUDA_Z']\n'STITCHCUDA_W' in os.environ\nos.environ['PATH']\n")
    assert sorted(_environment_reads(tree, {"A": "STITCHCUDA_X"})) == [
        (3, "STITCHCUDA_Y"), (4, "STITCHCUDA_X"), (5, "STITCHCUDA_Z"), (6, "STITCHCUDA_W")]


def test_docs_page_is_the_generated_table():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert st.with_table(page) == page, ("docs/environment.md differs from the table in stitchcuda.settings: run "
                                         "`python -m stitchcuda.settings --write-docs`")
    for s in st.declared():
        assert s.name.split(",")[0].strip() in page


def test_every_setting_has_a_reason_and_a_known_side():
    for s in st.declared():
        assert s.side in st.SIDES, s.name
        assert s.reason and "\n" not in s.reason and s.read_by, s.name
    names = [n.strip() for s in st.declared() for n in s.name.split(",")]
    assert len(names) == len(set(names)), "a variable is declared twice"


@pytest.mark.parametrize("name, text, takes", [
    ("STITCHCUDA_TF32X3_CHUNK", "abc", "a whole number"),
    ("STITCHCUDA_TF32X3_CHUNK", "-1", "a whole number"),
    ("STITCHCUDA_TF32X3_FUSE_LO", "3", "one of 0, 1, 2"),
    ("STITCHCUDA_RELAYOUT", "maybe", "1 or 0"),
    ("STITCHCUDA_CHANNELS_LAST", "sometimes", "one of auto, on, off"),
    ("STITCHCUDA_SUITE_CHUNK", "3/2", "K/N with 1 <= K <= N"),
    ("STITCHCUDA_SUITE_CHUNK", "0/2", "K/N with 1 <= K <= N"),
    ("STITCHCUDA_LOG", "loud", "one of debug, info, warning, error"),
])
def test_a_bad_value_is_refused_when_read_with_the_variable_and_what_it_takes(name, text, takes):
    got = st.from_environ({name: text})  # building never raises: the package still imports
    attribute = name.removeprefix("STITCHCUDA_").lower()
    with pytest.raises(st.SettingsError) as caught:
        getattr(got, attribute)
    message = str(caught.value)
    assert message.startswith(f"{name} must be {takes}") and repr(text) in message and "unset it" in message
    assert got.problems() == [message]
    assert isinstance(caught.value, ValueError)


def test_values_parse_to_their_types_and_unset_or_blank_is_the_default():
    got = st.from_environ({"STITCHCUDA_TF32X3_CHUNK": "0", "STITCHCUDA_RELAYOUT": "off", "STITCHCUDA_SANDBOX": " No ",
                           "STITCHCUDA_TF32X3_FUSE_LO": "1", "STITCHCUDA_SUITE_DIR": "/x/suite", "CI": "woodpecker",
                           "STITCHCUDA_CHANNELS_LAST": "ON", "STITCHCUDA_MEMORY_SITES": " ", "STITCHCUDA_LOG": ""})
    assert got.tf32x3_chunk == 0 and got.relayout is False and got.sandbox is False and got.tf32x3_fuse_lo == 1
    assert got.suite_dir == Path("/x/suite") and got.ci is True and got.channels_last == "on"
    assert got.memory_sites == 0 and got.log is None and got.problems() == []
    defaults = st.from_environ({})
    assert (defaults.tf32x3_chunk, defaults.bf16_cast, defaults.relayout, defaults.verify_worker_stderr,
            defaults.channels_last, defaults.ci) == (None, 1, True, False, "auto", False)


def test_settings_is_read_once_and_reload_reads_again(monkeypatch):
    monkeypatch.setenv("STITCHCUDA_MEMORY_SITES", "4")
    first = st.reload()
    monkeypatch.setenv("STITCHCUDA_MEMORY_SITES", "9")
    assert st.settings() is first and st.settings().memory_sites == 4
    try:
        assert st.reload().memory_sites == 9 and st.settings().memory_sites == 9
    finally:
        monkeypatch.delenv("STITCHCUDA_MEMORY_SITES")
        st.reload()


def test_override_by_field_or_by_variable_text_and_restores():
    before = st.settings()
    with st.override(relayout=False, STITCHCUDA_TF32X3_KBLOCK="64") as inside:
        assert st.settings() is inside and inside.relayout is False and inside.tf32x3_kblock == 64
        with st.override(STITCHCUDA_SUITE_CHUNK="9/2"):
            with pytest.raises(st.SettingsError, match="STITCHCUDA_SUITE_CHUNK must be K/N"):
                st.settings().suite_chunk
            assert st.settings().relayout is False  # the outer override still holds
    assert st.settings() is before
    with pytest.raises(TypeError, match="neither a field of Settings nor a variable"):
        with st.override(relayut=False):
            pass
    assert st.settings() is before


def test_override_keeps_a_bad_value_of_the_environment_bad():
    with st.override(STITCHCUDA_BF16_CAST="7"), st.override(relayout=False):
        with pytest.raises(st.SettingsError, match="STITCHCUDA_BF16_CAST must be one of 0, 1, 2"):
            st.settings().bf16_cast


def test_command_line_lists_values_and_exits_2_on_a_bad_one(subprocess_env):
    env = {**subprocess_env, "STITCHCUDA_TF32X3_FUSE_LO": "5", "PYTHONPATH": str(ROOT / "python")}
    done = subprocess.run([sys.executable, "-m", "stitchcuda.settings"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "BAD: STITCHCUDA_TF32X3_FUSE_LO must be one of 0, 1, 2, got '5'" in done.stdout
    table = subprocess.run([sys.executable, "-m", "stitchcuda.settings", "--markdown"], capture_output=True,
                           text=True, env={**env, "STITCHCUDA_TF32X3_FUSE_LO": ""}, timeout=120)
    assert table.returncode == 0 and table.stdout == st.markdown_table()


def test_with_table_needs_the_markers():
    with pytest.raises(ValueError, match="has no generated section"):
        st.with_table("# a page\n")
