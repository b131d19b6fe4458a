"""stitchcuda.jit without a GPU: real NVRTC compiles, errors with line mapping, options, name
expressions, the kernel cache (hits, corruption, unusable folders, concurrency) and bad launches.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

import stitchcuda
from stitchcuda import _C, jit
from stitchcuda.bench.jit import TILED_GEMM

SCALE = r"""
extern "C" __global__ void scale(float* x, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= a;
}
"""

TWO_KERNELS = SCALE + r"""
extern "C" __global__ void shift(float* x, float b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += b;
}
"""

TEMPLATE = r"""
template <typename T, int N>
__global__ void fill(T* out, T value) {
  for (int i = 0; i < N; ++i) out[threadIdx.x * N + i] = value;
}
"""


def unique(source: str) -> str:
    """A source no cache has seen: the comment changes the key but not the program."""
    return f"// test {uuid.uuid4().hex}\n{source}"


def stats_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


# --- compiling -----------------------------------------------------------------------------------

def test_compile_returns_kernel_with_params_and_binary():
    kernel = jit.compile(SCALE, "scale")
    assert isinstance(kernel, jit.Kernel)
    assert kernel.name == "scale" and kernel.symbol == "scale"
    assert [p.size for p in kernel.params] == [8, 4, 4]
    assert kernel.params[0].kind == "u64" and kernel.params[1].kind == "f32"
    assert kernel.params[2].kind in ("u32", "s32")
    assert kernel.signature == ["float*", "float", "int"]
    module = kernel.module
    assert module.arch == _C.default_arch()
    assert ".entry scale" in module.ptx
    assert module.cubin[:4] == b"\x7fELF"
    assert module.kernel_names == ["scale"]
    assert len(module.key) == 64 and module.key == _C.cache_key(SCALE, "kernel.cu", {})


def test_default_arch_without_gpu_is_sm90a():
    if _C.device_count() > 0:
        pytest.skip("a GPU is present: the default is its architecture")
    assert _C.default_arch() == "sm_90a"
    assert "sm_90a" in _C.supported_archs()
    assert jit.compile(SCALE, "scale").module.arch == "sm_90a"


def test_compile_module_gives_each_kernel_with_its_signature():
    module = jit.compile_module(TWO_KERNELS)
    assert sorted(module.kernel_names) == ["scale", "shift"]
    shift = module.kernel("shift")
    assert shift.name == "shift" and shift.signature == ["float*", "float", "int"]
    assert shift.module is module


def test_explicit_arch_is_used():
    kernel = jit.compile(SCALE, "scale", arch="sm_80")
    assert kernel.module.arch == "sm_80"
    assert ".target sm_80" in kernel.module.ptx


def test_compile_error_carries_log_diagnostics_and_line():
    source = (
        'extern "C" __global__ void broken(float* x) {\n'   # line 1
        "  int i = threadIdx.x;\n"                           # line 2
        "  x[i] = 1.0f;\n"                                   # line 3
        "  x[i] += not_declared_anywhere;\n"                 # line 4
        "}\n"
    )
    with pytest.raises(stitchcuda.CompileError) as info:
        jit.compile(source, "broken", program_name="mine.cu")
    exc = info.value
    assert isinstance(exc, stitchcuda.StitchError)
    assert exc.line == 4
    assert "not_declared_anywhere" in exc.log
    first_error = next(d for d in exc.diagnostics if d.severity == "error")
    assert first_error.file == "mine.cu"
    assert "not_declared_anywhere" in first_error.message
    assert "not_declared_anywhere" in first_error.source_line
    assert "not_declared_anywhere" in str(exc)  # the log is part of the printed error


def test_compile_error_in_in_memory_header_names_the_header():
    with pytest.raises(stitchcuda.CompileError) as info:
        jit.compile('#include "helper.cuh"\nextern "C" __global__ void k() {}\n', "k",
                    headers={"helper.cuh": "// fine\nint broken = ;\n"})
    error = next(d for d in info.value.diagnostics if d.severity == "error")
    assert error.file.endswith("helper.cuh") and error.line == 2


def test_unknown_option_keyword_is_type_error_naming_it():
    with pytest.raises(TypeError, match="optimise"):
        jit.compile(SCALE, "scale", optimise=True)


def test_unknown_native_option_key_is_invalid_argument_naming_it():
    with pytest.raises(stitchcuda.InvalidArgumentError, match="optimise"):
        _C.compile(SCALE, "kernel.cu", {"optimise": True})


@pytest.mark.parametrize("options, word", [
    ({"arch": "sm_12"}, "sm_12"),
    ({"arch": "banana"}, "banana"),
    ({"std": 14}, "14"),
    ({"pch": "sometimes"}, "sometimes"),
    ({"max_registers": -4}, "-4"),
])
def test_bad_option_values_are_invalid_argument(options, word):
    with pytest.raises(stitchcuda.InvalidArgumentError) as info:
        jit.compile(SCALE, "scale", **options)
    assert word in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_kernel_is_not_found_listing_the_kernels():
    with pytest.raises(stitchcuda.NotFoundError) as info:
        jit.compile(TWO_KERNELS, "scael")
    message = str(info.value)
    assert "scael" in message and "scale" in message and "shift" in message
    assert isinstance(info.value, LookupError)


def test_name_expression_selects_template_instantiation():
    kernel = jit.compile(TEMPLATE, "fill<float, 4>")
    assert kernel.symbol.startswith("_Z") and kernel.symbol in kernel.module.kernel_names
    assert kernel.module.lowered_names["fill<float, 4>"] == kernel.symbol
    assert [p.kind for p in kernel.params] == ["u64", "f32"]
    assert kernel.signature is None  # templates have no parsed signature: dtypes are not checked


def test_several_name_expressions_in_one_module():
    module = jit.compile_module(TEMPLATE, name_expressions=["fill<float, 4>", "fill<double, 2>"])
    f32, f64 = module.kernel("fill<float, 4>"), module.kernel("fill<double, 2>")
    assert f32.symbol != f64.symbol
    assert f64.params[1].kind == "f64" and f64.params[1].size == 8


def test_defines_reach_the_program():
    source = 'extern "C" __global__ void k(int* out) { out[0] = VALUE * 7; }\n'
    ptx = jit.compile(source, "k", defines={"VALUE": 6}).module.ptx
    assert "42" in ptx
    with pytest.raises(stitchcuda.CompileError):
        jit.compile(source, "k")  # VALUE undefined without the define


def test_std_selects_the_language_standard():
    source = ('template <typename T> concept Small = sizeof(T) <= 4;\n'
              'template <Small T> __device__ T twice(T v) { return v + v; }\n'
              'extern "C" __global__ void k(int* out) { out[0] = twice(out[0]); }\n')
    assert jit.compile(source, "k", std=20).module.origin in ("compiled", "memory", "disk")
    with pytest.raises(stitchcuda.CompileError):
        jit.compile(source, "k", std=17)


def test_fast_math_changes_division():
    source = 'extern "C" __global__ void k(float* x) { x[0] = x[1] / x[2]; }\n'
    assert "div.rn.f32" in jit.compile(source, "k").module.ptx
    assert "div.rn.f32" not in jit.compile(source, "k", fast_math=True).module.ptx


def test_line_info_emits_source_locations():
    assert ".loc" not in jit.compile(SCALE, "scale").module.ptx
    assert ".loc" in jit.compile(SCALE, "scale", line_info=True).module.ptx


def test_cub_and_bf16_headers_are_available():
    from stitchcuda.bench.jit import BF16_AXPY, CUB_REDUCE

    assert [p.kind for p in jit.compile(CUB_REDUCE, "block_sum_f32").params] == ["u64", "u64", "u64"]
    assert [p.kind for p in jit.compile(BF16_AXPY, "axpy_bf16").params] == ["u64", "u64", "f32", "u64"]


# --- declared signatures -----------------------------------------------------------------------

@pytest.mark.parametrize("source, expected", [
    ('extern "C" __global__ void add(const float* __restrict__ a, float *b, int n, double s) {}',
     ["const float*", "float*", "int", "double"]),
    ('__global__ void add(const __nv_bfloat16* x, unsigned int n, long long m) {}',
     ["const __nv_bfloat16*", "unsigned int", "long long"]),
    ('extern "C" __global__ void add(\n    const float* a,   /* input */\n    float* b) {}',
     ["const float*", "float*"]),
    # __launch_bounds__ sits between __global__ and the name in most tuned kernels.
    ('extern "C" __global__ void __launch_bounds__(256)\nadd(const float* a, int n) {}',
     ["const float*", "int"]),
    # A declaration inside a comment is not the kernel.
    ('// old: __global__ void add(int nothing)\nextern "C" __global__ void add(const float* a, int n) {}',
     ["const float*", "int"]),
    ('template <typename T> __global__ void add(T* x) {}', []),
    ('extern "C" __global__ void other(float* x) {}', []),
])
def test_declared_signature_parsing(source, expected):
    assert jit.declared_signature(source, "add") == expected


def test_compile_uses_declared_signature():
    from stitchcuda.bench.jit import CUB_REDUCE

    assert jit.compile(SCALE, "scale").signature == ["float*", "float", "int"]
    assert jit.compile(CUB_REDUCE, "block_sum_f32").signature == ["const float*", "float*", "long long"]
    assert jit.compile(SCALE, "scale", signature=["float*", "float", "int"]).signature == \
        ["float*", "float", "int"]


# --- the kernel cache --------------------------------------------------------------------------

def test_cache_memory_then_disk_hits(fresh_cache):
    source = unique(SCALE)
    s0 = jit.cache_stats()
    first = jit.compile(source, "scale").module
    s1 = jit.cache_stats()
    second = jit.compile(source, "scale").module
    s2 = jit.cache_stats()
    jit.clear_memory_cache()
    third = jit.compile(source, "scale").module
    s3 = jit.cache_stats()

    assert (first.origin, second.origin, third.origin) == ("compiled", "memory", "disk")
    assert first.key == second.key == third.key
    assert stats_delta(s0, s1)["compiles"] == 1 and stats_delta(s0, s1)["misses"] == 1
    assert stats_delta(s1, s2)["memory_hits"] == 1 and stats_delta(s1, s2)["compiles"] == 0
    assert stats_delta(s2, s3)["disk_hits"] == 1 and stats_delta(s2, s3)["compiles"] == 0
    assert third.cubin == first.cubin and third.ptx == first.ptx

    entry = _C.cache_entry_path(first.key)
    assert entry.startswith(str(fresh_cache))
    assert jit.cache_dir() == str(fresh_cache)


def test_compile_ms_is_zero_for_cache_hits(fresh_cache):
    # jit.hpp: Binary::compile_ms is "wall time NVRTC took (0 when read from the cache)".
    source = unique(SCALE)
    assert jit.compile(source, "scale").module.compile_ms > 0
    assert jit.compile(source, "scale").module.compile_ms == 0  # memory hit
    jit.clear_memory_cache()
    assert jit.compile(source, "scale").module.compile_ms == 0  # disk hit


def test_cache_false_always_compiles(fresh_cache):
    source = unique(SCALE)
    jit.compile(source, "scale")
    assert jit.compile(source, "scale", cache=False).module.origin == "compiled"


def test_key_follows_options():
    key = lambda options: _C.cache_key(SCALE, "kernel.cu", options)  # noqa: E731
    assert key({}) == key({"std": 17, "pch": "auto", "fast_math": False})  # defaults spelled out
    assert key({"defines": {"A": "1"}}) != key({"defines": {"A": "2"}})
    assert key({}) != key({"fast_math": True})
    assert key({}) != key({"headers": {"h.cuh": "// 1"}}) != key({"headers": {"h.cuh": "// 2"}})
    assert _C.cache_key(SCALE, "other.cu", {}) != key({})
    assert _C.cache_key(SCALE, "kernel.cu", {"arch": "sm_80"}) != _C.cache_key(SCALE, "kernel.cu", {"arch": "sm_90a"})


def test_key_follows_included_header_contents(fresh_cache, tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    header = include / "value.cuh"
    source = unique('#include "value.cuh"\nextern "C" __global__ void k(int* out) { out[0] = VALUE; }\n')
    header.write_text("#define VALUE 1111\n")
    first = jit.compile(source, "k", include_paths=[include]).module
    header.write_text("#define VALUE 2222\n")
    second = jit.compile(source, "k", include_paths=[include]).module
    assert first.key != second.key
    assert second.origin == "compiled"
    assert "2222" in second.ptx and "1111" in first.ptx


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_disk_entry_is_rebuilt(fresh_cache, damage):
    source = unique(SCALE)
    first = jit.compile(source, "scale").module
    path = _C.cache_entry_path(first.key)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    else:
        data = bytearray(b"not a cache entry at all" * 10)
    with open(path, "wb") as f:
        f.write(data)

    jit.clear_memory_cache()
    before = jit.cache_stats()
    rebuilt = jit.compile(source, "scale").module
    delta = stats_delta(before, jit.cache_stats())
    assert rebuilt.origin == "compiled"
    assert delta["corrupt_entries"] == 1 and delta["compiles"] == 1
    assert rebuilt.cubin == first.cubin

    jit.clear_memory_cache()  # the rebuilt entry replaced the damaged one
    assert jit.compile(source, "scale").module.origin == "disk"


def test_unwritable_cache_folder_is_io_error_naming_path(fresh_cache, tmp_path):
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a folder")
    wanted = blocker / "cache"  # runs as root, so chmod cannot make a folder unwritable
    with pytest.raises(stitchcuda.StitchIOError) as info:
        jit.set_cache_dir(wanted)
    assert str(wanted) in str(info.value)
    assert jit.cache_dir() == str(fresh_cache)  # the previous cache stays in use


def test_memory_only_cache(fresh_cache):
    jit.set_cache_dir("")
    assert jit.cache_dir() == ""
    source = unique(SCALE)
    assert jit.compile(source, "scale").module.origin == "compiled"
    assert jit.compile(source, "scale").module.origin == "memory"
    jit.clear_memory_cache()
    assert jit.compile(source, "scale").module.origin == "compiled"


def test_eight_threads_one_new_source_compile_once(fresh_cache):
    source = unique(TILED_GEMM)
    barrier = threading.Barrier(8)
    keys, failures = [], []

    def worker():
        try:
            barrier.wait()
            keys.append(jit.compile(source, "sgemm_tiled").module.key)
        except Exception as exc:  # collected: an exception in a thread would otherwise vanish
            failures.append(exc)

    before = jit.cache_stats()
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert len(keys) == 8 and len(set(keys)) == 1
    assert stats_delta(before, jit.cache_stats())["compiles"] == 1


def test_compile_releases_the_gil(fresh_cache):
    # Compiling candidates on a thread pool only helps if NVRTC runs without the GIL held.
    ticks: list[int] = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter_ns())
            time.sleep(0.001)

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter_ns()
    # CUB without precompiled headers takes a second or more even on a fast machine.
    from stitchcuda.bench.jit import CUB_REDUCE
    jit.compile(unique(CUB_REDUCE), "block_sum_f32", cache=False, pch="off")
    end = time.perf_counter_ns()
    stop.set()
    thread.join()
    margin = 10_000_000  # 10 ms: the interpreter's switch interval is 5 ms
    assert end - start > 3 * margin, "compile too fast to tell"
    assert any(start + margin < t < end - margin for t in ticks), "no Python thread ran during the compile"


# --- launches that must fail before reaching a GPU ---------------------------------------------

def test_launch_on_cpu_tensor_is_rejected_naming_cpu():
    kernel = jit.compile(SCALE, "scale")
    x = torch.zeros(32)
    with pytest.raises((stitchcuda.LaunchError, stitchcuda.InvalidArgumentError)) as info:
        kernel(1, 32, x, 2.0, 32)
    assert "cpu" in str(info.value).lower()
    assert torch.equal(x, torch.zeros(32))


def test_kernel_repr_and_params_need_no_gpu():
    kernel = jit.compile(SCALE, "scale")
    assert "scale(float*, float, int)" in repr(kernel)
    assert "origin=" in repr(kernel.module)


def test_device_runtime_links_a_loadable_cubin_without_a_gpu():
    launcher = r"""
extern "C" __global__ void tail_launch(cudaGraphExec_t graph, int* status) {
  *status = (int)cudaGraphLaunch(graph, cudaStreamGraphTailLaunch);
}
"""
    module = jit.compile_module(launcher, arch="sm_90a", device_runtime=True, cache=False)
    assert module.cubin[:4] == b"\x7fELF" and module.cubin[16] == 2  # ET_EXEC: linked, loadable
    unlinked = jit.compile_module(launcher, arch="sm_90a", extra_flags=["-rdc=true"], cache=False)
    assert unlinked.cubin[16] == 1  # ET_REL: cudaGraphLaunch still undefined
    assert module.key != unlinked.key
    with pytest.raises(stitchcuda.errors.InvalidArgumentError, match="sm_90a"):
        jit.compile_module(launcher, arch="compute_90", device_runtime=True)
