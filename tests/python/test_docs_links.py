"""The documentation stays true: every relative link and image in the repository's Markdown resolves (the
file exists and, for a `#fragment`, the page has a heading with that anchor, by GitHub's rule), the docs
index lists every page, and the README's first example runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _markdown_files() -> list[Path]:
    """The tracked and new Markdown files (git's view, so ignored build and snapshot folders stay out)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return sorted(ROOT / name for name in listed if (ROOT / name).is_file())


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "``", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings (code spans included, as GitHub renders them); a repeated heading
    gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            out.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, line in enumerate(_prose(path.read_text(encoding="utf-8")), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # an absolute URL or mailto: not checked (tests never reach the network)
            file_part, _, fragment = target.partition("#")
            where = path if not file_part else (path.parent / file_part).resolve()
            if not where.exists():
                problems.append(f"{path.relative_to(root)}: '{target}': {file_part} does not exist")
            elif fragment and where.is_file() and where.suffix == ".md" and fragment not in anchors(where):
                problems.append(f"{path.relative_to(root)}: '{target}': no heading in {where.relative_to(root)} "
                                f"has the anchor #{fragment}")
            elif where.exists() and not where.resolve().is_relative_to(root):
                problems.append(f"{path.relative_to(root)}: '{target}' leaves the repository")
    return problems


def test_the_slug_follows_githubs_rule():
    assert slug("At KernelBench scale: `bench/kernelbench/`") == "at-kernelbench-scale-benchkernelbench"
    assert slug("Run 20 (H200, 2026-12-06): all 53 at fp32") == "run-20-h200-2026-12-06-all-53-at-fp32"
    assert slug("`stitchcuda runs list [--root runs]`") == "stitchcuda-runs-list---root-runs"


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "b.md").write_text("# Known limits\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#known-limits) [gone](c.md) [anchor](b.md#nowhere) `[code](x.md)`\n"
                    "```\n[fenced](y.md)\n```\n[web](https://example.invalid/x)\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2, problems
    assert "c.md does not exist" in problems[0] and "#nowhere" in problems[1]


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs/index.md").read_text(encoding="utf-8")
    listed = {target.partition("#")[0] for target in LINK.findall(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert pages - listed == set(), "docs/index.md does not link these pages"
    assert "runs/README.md" in listed
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/index.md)" in readme


def test_the_readme_example_runs_on_a_cpu(subprocess_env, tmp_path):
    """The README's first Python example, run as a user would paste it (on this machine: no GPU)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert len(example.strip().splitlines()) <= 11, "the README's first example is meant to be about ten lines"
    result = subprocess.run([sys.executable, "-c", example], env=subprocess_env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("StitchCUDA report: "), result.stdout
    assert lines[-1] == "True"
    if not torch.cuda.is_available():  # what the README says a CPU prints
        assert "no CUDA device" in lines[0] and "2 generated kernels, 2 cuBLASLt matmuls" in lines[0], lines[0]


def test_help_and_the_package_docstring_describe_the_optimizer(subprocess_env):
    import stitchcuda

    first = stitchcuda.__doc__.strip().splitlines()[0]
    assert "PyTorch model" in first and "CUDA program" in first, first
    result = subprocess.run([sys.executable, "-m", "stitchcuda", "--help"], env=subprocess_env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    description = " ".join(result.stdout.split("\n\n")[1].split())  # argparse: usage, blank line, description
    assert "optimized, verified CUDA programs" in description and "JIT" not in description, description
