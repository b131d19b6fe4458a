"""Packaging: the wheel (built once for this module, in build/wheel with ccache: minutes from scratch on
two cores, seconds when nothing changed), its torch pin and entry points, the C++ package inside it and
a find_package(stitchcuda) consumer built against the installed wheel; the development install's entry
points in .venv; `optimize --save` where there is no GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-q", str(ROOT), "-w",
           str(out)]
    if shutil.which("ccache"):  # the same compile commands as build/: ccache answers for most objects
        cmd.append(f"-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER={shutil.which('ccache')}")
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    started = time.monotonic()
    _run(cmd, cwd=ROOT, env=env, timeout=1800)
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
    assert len([n for n in names if re.fullmatch(r"stitchcuda/_C\.cpython-.*\.so", n)]) == 1  # the wheel's, not python/'s
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
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "[torch_dynamo_backends]\nstitchcuda = stitchcuda.graph.dynamo:backend" in entry_points
    assert "[console_scripts]\nstitchcuda = stitchcuda.cli:main" in entry_points
    # Not manylinux: it links torch's libraries and the system's libcurl (docs/building.md says why).
    assert "Tag: cp3" in _read(wheel, ".dist-info/WHEEL") and "-linux_x86_64" in _read(wheel, ".dist-info/WHEEL")


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (pip --target), without torch beside it."""
    site = tmp_path_factory.mktemp("site")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
         timeout=300)
    return site


def _python_env(site: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(site))


# .venv's development install sends `import stitchcuda` to python/ through a finder ahead of sys.path; a
# look at the installed wheel sets that finder aside (the wheel then comes first on sys.path).
WHEEL_FIRST = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'InplaceFinder' not in type(f).__name__]\n"
CMAKE_DIR = WHEEL_FIRST + "import runpy; sys.argv = ['stitchcuda', '--cmake-dir']; runpy.run_module('stitchcuda', run_name='__main__')"


def _cmake_dir(site: Path) -> str:
    return _run([sys.executable, "-c", CMAKE_DIR], env=_python_env(site), timeout=120).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf (binutils)")
def test_the_extension_finds_torch_beside_it(installed):
    (ext,) = (installed / "stitchcuda").glob("_C.cpython-*.so")
    dynamic = _run(["readelf", "-d", str(ext)]).stdout
    assert "[$ORIGIN/../torch/lib:$ORIGIN/../nvidia/cu13/lib]" in dynamic  # site-packages/torch, not the builder's
    assert "[libcurl.so.4]" in dynamic  # the system's libcurl: a run-time requirement (docs/building.md)


@pytest.mark.slow
def test_installed_wheel_imports_and_prints_its_cmake_dir(installed):
    env = _python_env(installed)
    where = _run([sys.executable, "-c", WHEEL_FIRST + "import stitchcuda; print(stitchcuda.__file__, stitchcuda._C.__file__)"],
                 env=env, timeout=120).stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in where), where  # the wheel's package and extension
    cmake_dir = _cmake_dir(installed)
    assert Path(cmake_dir) == installed / "stitchcuda/lib/cmake/stitchcuda"
    assert (Path(cmake_dir) / "stitchcudaConfig.cmake").is_file()


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
def test_torch_component_resolves_torch_in_the_same_site_packages(installed, tmp_path):
    def probe(site: Path, components: str) -> str:
        source = tmp_path / f"probe-{site.name}"
        source.mkdir()
        (source / "CMakeLists.txt").write_text(TORCH_COMPONENT.format(components=components))
        return _run(_configure_args(source, tmp_path / f"build-{site.name}",
                                    f"-Dstitchcuda_DIR={site}/stitchcuda/lib/cmake/stitchcuda"), timeout=300).stdout

    # Installed alone: stitchcuda::stitchcuda works, the torch component is missing and says what to install.
    alone = probe(installed, "OPTIONAL_COMPONENTS")
    assert "torch-found=FALSE" in alone and f"install torch=={TORCH_MINOR}.* (beside a wheel" in alone

    # Beside torch (and the CUDA runtime torch's wheels bring), as pip installs it: every path is there.
    site = tmp_path / "site-packages"
    shutil.copytree(installed / "stitchcuda", site / "stitchcuda", symlinks=True)
    torch_site = Path(torch.__file__).resolve().parents[1]
    for name in ("torch", "nvidia"):
        (site / name).symlink_to(torch_site / name)
    beside = probe(site, "COMPONENTS")
    assert "torch-found=TRUE" in beside
    paths = re.search(r"torch-paths=(.*)", beside).group(1).split(";")
    assert paths and all(p.startswith(str(site)) for p in paths if p), paths
    assert any(p.endswith("libtorch.so") for p in paths)


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
