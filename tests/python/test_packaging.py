"""Packaging as a user meets it: a clean copy of the tree (what git tracks, and new files it does not ignore)
built into a wheel by `python -m build`, installed with pip into a fresh virtual environment with nothing
but this machine's packages (`--no-index`), extras included; the wheel's torch pin and entry points, the
`stitchcuda` command and the torch.compile backend in that environment, the C++ package inside it and a
find_package(stitchcuda) consumer built against it; the development install's entry points in .venv;
`optimize --save` where there is no GPU.

The wheel build compiles the library and the extension: tens of minutes on two busy cores the first time.
With ccache and the copy's paths made relative (CCACHE_BASEDIR, as the Makefile's build/ has them) the
objects compiled before are reused and what is left is CMake's configure and the extension's link-time
optimization: 7 minutes on two cores at a load average of 15, most objects from the cache."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TORCH_MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# ---- the wheel ------------------------------------------------------------------------------------


def _clean_copy(dest: Path) -> Path:
    """The files of a fresh clone plus the working tree's changes: tracked and untracked-but-not-ignored
    files, as they are on disk (so a build output, .venv or a stray _C.so never reaches the build)."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _clean_copy(tmp_path_factory.mktemp("clean-copy"))
    assert not list(source.glob("python/stitchcuda/_C*")) and not (source / "build").exists()
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the extension compiles against the torch of this environment (pip's isolated build
    # would fetch one from an index, which tests never reach).
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source),
           "-Cbuild-dir=build"]
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    if shutil.which("ccache"):
        cmd.append(f"-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER={shutil.which('ccache')}")
        env["CCACHE_BASEDIR"] = str(source)  # the copy's folder changes every run; relative paths hit the cache
        env["CCACHE_NOHASHDIR"] = "1"
    started = time.monotonic()
    # A session of its own: on a timeout the whole build goes (ninja and the compilers under it), not only
    # the front end that subprocess.run would kill.
    build = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        output, _ = build.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        os.killpg(build.pid, signal.SIGKILL)
        output, _ = build.communicate()
        pytest.fail(f"the wheel build took over 30 minutes; its last lines:\n{output[-3000:]}")
    assert build.returncode == 0, f"{' '.join(cmd)}\n{output[-6000:]}"
    print(f"\nwheel built in {time.monotonic() - started:.0f} s")
    (built,) = out.glob("stitchcuda-*.whl")
    return built


@pytest.fixture(scope="module")
def names(wheel) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _read(wheel: Path, suffix: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(suffix)]
        return z.read(name).decode()


@pytest.mark.slow
def test_wheel_holds_the_package_and_the_cpp_package(names):
    assert len([n for n in names if re.fullmatch(r"stitchcuda/_C\.cpython-.*\.so", n)]) == 1
    for header in (ROOT / "include/stitchcuda").rglob("*.hpp"):
        assert f"stitchcuda/include/{header.relative_to(ROOT / 'include').as_posix()}" in names
    assert "stitchcuda/include/stitchcuda/third_party/tl/expected.hpp" in names  # no tl-expected package needed
    for lib in ("libstitchcuda.a", "libstitchcuda_torch.a"):
        assert f"stitchcuda/lib/{lib}" in names
    for config in ("stitchcudaConfig.cmake", "stitchcudaConfigVersion.cmake", "stitchcuda-targets.cmake"):
        assert f"stitchcuda/lib/cmake/stitchcuda/{config}" in names
    for prompt in (ROOT / "python/stitchcuda/agents/prompts").glob("*.md"):
        assert f"stitchcuda/agents/prompts/{prompt.name}" in names
    assert "stitchcuda/log.py" in names and "stitchcuda/__main__.py" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.slow
def test_wheel_pins_the_torch_it_was_built_against(wheel):
    requires = [line.split(":", 1)[1].strip() for line in _read(wheel, ".dist-info/METADATA").splitlines()
                if line.startswith("Requires-Dist:")]
    assert [r for r in requires if r.startswith("torch")] == [f"torch=={TORCH_MINOR}.*"]
    assert "numpy" in requires and any(r.startswith("rich") for r in requires)
    for extra, package in (("rl", "trl"), ("rl", "datasets"), ("bench", "matplotlib"), ("ray", "ray")):
        assert any(r.startswith(package) and f'extra == "{extra}"' in r for r in requires), (extra, requires)
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "[torch_dynamo_backends]\nstitchcuda = stitchcuda.graph.dynamo:backend" in entry_points
    assert "[console_scripts]\nstitchcuda = stitchcuda.cli:main" in entry_points
    # Not manylinux: it links torch's libraries and the system's libcurl (docs/building.md says why).
    assert "Tag: cp3" in _read(wheel, ".dist-info/WHEEL") and "-linux_x86_64" in _read(wheel, ".dist-info/WHEEL")


# This environment's packages but the development install of stitchcuda: what a user's environment holds
# before `pip install`. A fresh venv sees them through a .pth file, as installed distributions.
OWN = ("stitchcuda", "__editable__", "_stitchcuda")


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with torch and the extras' packages available, the wheel installed by
    pip from nothing but the wheel file (`--no-index`: every requirement must already be satisfied)."""
    base = tmp_path_factory.mktemp("venv")
    packages = base / "packages"
    packages.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(OWN) and entry.suffix != ".pth":
            (packages / entry.name).symlink_to(entry)
    env_dir = base / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], timeout=120)
    python = env_dir / "bin/python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "user-packages.pth").write_text(f"{packages}\n")
    # pip of this environment, run for the new one (--python): the venv itself has none (--without-pip).
    report = base / "report.json"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--report", str(report),
          f"{wheel}[rl,bench]"], timeout=600)
    installed = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installed == ["stitchcuda"], installed  # torch, numpy, rich and the extras' packages were there
    return env_dir


def _site(env_dir: Path) -> Path:
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    return site


@pytest.fixture(scope="module")
def installed(venv) -> Path:
    """The site-packages folder the wheel went to: stitchcuda alone, torch reachable only through the .pth."""
    return _site(venv)


def _in_venv(site: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Runs the fresh environment's Python (or one of its scripts) as a user's shell would: no PYTHONPATH,
    from a folder outside the source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    program = str(site.parents[2] / "bin" / args[0])
    return _run([program, *args[1:]], env=env, cwd=site.parents[3], timeout=timeout)


def _cmake_dir(site: Path) -> str:
    return _in_venv(site, "python", "-m", "stitchcuda", "--cmake-dir").stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_the_extension_finds_torch_beside_it(installed):
    (ext,) = (installed / "stitchcuda").glob("_C.cpython-*.so")
    dynamic = _run(["readelf", "-d", str(ext)]).stdout
    assert "[$ORIGIN/../torch/lib:$ORIGIN/../nvidia/cu13/lib]" in dynamic  # site-packages/torch, not the builder's
    assert "[libcurl.so.4]" in dynamic  # the system's libcurl: a run-time requirement (docs/building.md)


@pytest.mark.slow
def test_installed_wheel_imports_and_prints_its_cmake_dir(installed):
    where = _in_venv(installed, "python", "-c", "import stitchcuda; print(stitchcuda.__file__, stitchcuda._C.__file__)"
                     ).stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in where), where  # the wheel's package and extension
    cmake_dir = _cmake_dir(installed)
    assert Path(cmake_dir) == installed / "stitchcuda/lib/cmake/stitchcuda"
    assert (Path(cmake_dir) / "stitchcudaConfig.cmake").is_file()


@pytest.mark.slow
def test_installed_command_and_backend_work_in_the_fresh_environment(installed):
    version = _in_venv(installed, "stitchcuda", "--version").stdout.strip()
    assert version.startswith("stitchcuda 0.1.0"), version
    assert "optimize" in _in_venv(installed, "stitchcuda", "--help").stdout
    # torch.compile finds the backend through the wheel's entry point, and the result matches eager.
    compiled = _in_venv(installed, "python", "-c", """
import torch, torch._dynamo
assert "stitchcuda" in torch._dynamo.list_backends()
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
x = torch.randn(4, 8)
print(torch.allclose(torch.compile(model, backend="stitchcuda")(x), model(x)))
""", timeout=300)
    assert compiled.stdout.strip().splitlines()[-1] == "True", compiled.stdout


@pytest.mark.slow
def test_extras_resolve_from_the_wheel_alone(installed):
    # The venv fixture installed `wheel[rl,bench]` with --no-index; the extras' modules import there.
    _in_venv(installed, "python", "-c", "import trl, datasets, matplotlib, stitchcuda.rl, stitchcuda.bench.html")


def test_cmake_dir_in_the_development_tree_says_what_to_do(subprocess_env):
    result = subprocess.run([sys.executable, "-m", "stitchcuda", "--cmake-dir"], env=subprocess_env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert "development tree" in result.stderr and "pip install --no-build-isolation ." in result.stderr


CONSUMER_CMAKE = """
cmake_minimum_required(VERSION 3.24)
project(stitchcuda_consumer LANGUAGES CXX)
find_package(stitchcuda REQUIRED)
add_executable(consumer main.cpp)
target_compile_features(consumer PRIVATE cxx_std_20)
target_link_libraries(consumer PRIVATE stitchcuda::stitchcuda)
"""

CONSUMER_MAIN = r'''
#include <cstdio>
#include <stitchcuda/stitchcuda.hpp>

int main() {
  auto module = stitchcuda::jit::build(R"(
extern "C" __global__ void scale(float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
})");
  if (!module) {
    std::fprintf(stderr, "%s\n", module.error().describe().c_str());
    return 1;
  }
  auto kernel = (*module)->kernel("scale");
  if (!kernel) return 2;
  std::printf("arch %s cubin %zu params %zu\n", (*module)->binary().arch.c_str(), (*module)->binary().cubin.size(),
              kernel->params().size());
  return 0;
}
'''


def _configure_args(source: Path, build: Path, *extra: str) -> list[str]:
    args = ["cmake", "-S", str(source), "-B", str(build), *extra]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    if shutil.which("ccache"):
        args.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={shutil.which('ccache')}")
    return args


@pytest.mark.slow
def test_find_package_consumer_compiles_a_kernel_with_nvrtc(installed, tmp_path):
    cmake_dir = _cmake_dir(installed)
    source, build = tmp_path / "consumer", tmp_path / "build"
    source.mkdir()
    (source / "CMakeLists.txt").write_text(CONSUMER_CMAKE)
    (source / "main.cpp").write_text(CONSUMER_MAIN)
    _run(_configure_args(source, build, f"-Dstitchcuda_DIR={cmake_dir}", "-DCMAKE_BUILD_TYPE=Release"), timeout=300)
    _run(["cmake", "--build", str(build)], timeout=600)
    out = _run([str(build / "consumer")], env=dict(os.environ, STITCHCUDA_CACHE_DIR=str(tmp_path / "cache")),
               timeout=120).stdout
    match = re.fullmatch(r"arch (sm_\w+) cubin (\d+) params 3\n", out)
    assert match and int(match.group(2)) > 0, out


TORCH_COMPONENT = """
cmake_minimum_required(VERSION 3.24)
project(stitchcuda_torch_probe LANGUAGES CXX)
find_package(stitchcuda REQUIRED {components} torch)
message(STATUS "torch-found=${{stitchcuda_torch_FOUND}}")
if(stitchcuda_torch_FOUND)
  get_target_property(_inc stitchcuda::stitchcuda_libtorch INTERFACE_INCLUDE_DIRECTORIES)
  get_target_property(_libs stitchcuda::stitchcuda_libtorch INTERFACE_LINK_LIBRARIES)
  message(STATUS "torch-paths=${{_inc}};${{_libs}}")
endif()
"""


@pytest.mark.slow
def test_torch_component_resolves_torch_where_the_consumer_is_configured(installed, tmp_path):
    def probe(name: str, site: Path, components: str, *extra: str) -> str:
        source = tmp_path / f"probe-{name}"
        source.mkdir()
        (source / "CMakeLists.txt").write_text(TORCH_COMPONENT.format(components=components))
        return _run(_configure_args(source, tmp_path / f"build-{name}",
                                    f"-Dstitchcuda_DIR={site}/stitchcuda/lib/cmake/stitchcuda", *extra),
                    timeout=300).stdout

    def torch_paths(out: str) -> list[str]:
        assert "torch-found=TRUE" in out, out
        paths = [p for p in re.search(r"torch-paths=(.*)", out).group(1).split(";") if p]
        assert any(p.endswith("libtorch.so") for p in paths), paths
        return paths

    # Installed alone, told to look where no torch is: stitchcuda::stitchcuda works, the torch component is
    # missing and says where it looked and what to install.
    nowhere = tmp_path / "no-torch"
    alone = probe("alone", installed, "OPTIONAL_COMPONENTS", f"-DSTITCHCUDA_TORCH_ROOT={nowhere}")
    assert "torch-found=FALSE" in alone and f"Install torch=={TORCH_MINOR}.*" in alone
    assert f"{nowhere} (no torch there)" in alone

    # Installed alone, with a Python that has torch: the torch that Python imports, wherever it lives.
    torch_site = Path(torch.__file__).resolve().parents[1]
    from_python = probe("python", installed, "COMPONENTS", f"-DPython_EXECUTABLE={sys.executable}")
    assert all(Path(p).resolve().is_relative_to(torch_site) for p in torch_paths(from_python))

    # Beside torch (and the CUDA runtime torch's wheels bring), as pip installs it: that torch comes first.
    site = tmp_path / "site-packages"
    shutil.copytree(installed / "stitchcuda", site / "stitchcuda", symlinks=True)
    for name in ("torch", "nvidia"):
        (site / name).symlink_to(torch_site / name)
    beside = probe("beside", site, "COMPONENTS", f"-DPython_EXECUTABLE={sys.executable}")
    assert all(p.startswith(str(site)) for p in torch_paths(beside))


# ---- the development install ----------------------------------------------------------------------


def test_development_install_registers_the_entry_points():
    import importlib.metadata as metadata

    try:
        dist = metadata.distribution("stitchcuda")
    except metadata.PackageNotFoundError:
        pytest.fail("stitchcuda is not installed in this environment: run `make setup` (scripts/setup installs it "
                    "in development mode)")
    backends = {ep.name: ep for ep in dist.entry_points if ep.group == "torch_dynamo_backends"}
    import stitchcuda.graph.dynamo

    assert backends["stitchcuda"].load() is stitchcuda.graph.dynamo.backend
    from torch._dynamo import list_backends

    assert "stitchcuda" in list_backends()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    x = torch.randn(2, 4)
    torch._dynamo.reset()
    try:  # no InvalidBackend: dynamo found the backend through the entry point
        assert torch.allclose(torch.compile(model, backend="stitchcuda")(x), model(x))
    finally:
        torch._dynamo.reset()


# ---- --save ---------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path; the GPU machine runs test_save_writes_*")
def test_save_without_a_gpu_fails_and_says_why(tmp_path, capsys):
    from stitchcuda.cli import main

    out = tmp_path / "block.stitch"
    assert main(["optimize", str(ROOT / "examples/models/block.py"), "--save", str(out)]) == 1
    captured = capsys.readouterr()
    assert not out.exists()
    assert captured.out.startswith("StitchCUDA report: eager — no CUDA device")  # the report is still printed
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"stitchcuda optimize: {out} not written: no CUDA device")
    assert "verified and timed on a GPU" in last and "drop --save" in last


@pytest.mark.gpu
def test_save_writes_the_program_on_a_gpu(tmp_path, capsys):
    import stitchcuda
    from stitchcuda.cli import main

    out = tmp_path / "block.stitch"
    code = main(["optimize", str(ROOT / "examples/models/block.py"), "--save", str(out), "--no-compile-baseline"])
    err = capsys.readouterr().err
    if code == 0:  # optimized: the artifact is there and loads
        assert out.is_file() and isinstance(stitchcuda.load(out), torch.nn.Module)
    else:  # kept eager (e.g. not faster than the model): nothing written, and it says why
        assert code == 1 and not out.exists() and f"{out} not written: " in err
