"""stitchcuda.jit on a GPU: results against torch, large shared memory, clusters, attributes,
ordering with torch's streams, launch errors, and a device fault reported as an exception.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import stitchcuda
from stitchcuda import jit
from stitchcuda.bench.jit import BF16_AXPY, CUB_REDUCE, ELEMENTWISE, TILED_GEMM

pytestmark = pytest.mark.gpu

ADD_ONE = r"""
extern "C" __global__ void add_one(const float* x, float* y, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] + 1.0f;
}
"""


def blocks(n: int, block: int = 256) -> int:
    return (n + block - 1) // block


@pytest.mark.parametrize("n", [1, 4, 1023, (1 << 20) + 3])
def test_vector_add_matches_torch(n):
    kernel = jit.compile(ELEMENTWISE, "add_f32")
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    out = torch.full_like(a, float("nan"))
    kernel(min(blocks(n // 4 + 1), 4096), 256, a, b, out, n)
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)


def test_bf16_axpy_matches_torch():
    kernel = jit.compile(BF16_AXPY, "axpy_bf16")
    n = 100_001  # odd: exercises the scalar tail
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    expected = (2.5 * x.float() + y.float()).bfloat16()
    kernel(blocks(n // 2), 256, x, y, 2.5, n)
    torch.testing.assert_close(y.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_cub_block_reduce_matches_torch():
    kernel = jit.compile(CUB_REDUCE, "block_sum_f32")
    x = torch.rand(1 << 20, device="cuda")
    partial = torch.zeros(120, device="cuda")
    kernel(120, 256, x, partial, x.numel())
    torch.testing.assert_close(partial.sum(), x.sum(), rtol=1e-4, atol=1e-2)


def test_tiled_gemm_matches_torch():
    kernel = jit.compile(TILED_GEMM, "sgemm_tiled")
    M, N, K = 100, 70, 129  # not multiples of 32: exercises the edge tiles
    A, B = torch.randn(M, K, device="cuda"), torch.randn(K, N, device="cuda")
    C = torch.empty(M, N, device="cuda")
    kernel((blocks(N, 32), blocks(M, 32)), (32, 32), A, B, C, M, N, K)
    expected = (A.double() @ B.double()).float()
    torch.testing.assert_close(C, expected, rtol=1e-4, atol=1e-4)


def test_dynamic_shared_memory_above_48kb():
    source = r"""
    extern "C" __global__ void reverse_through_smem(const float* in, float* out, int n) {
      extern __shared__ float buf[];
      for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[i];
      __syncthreads();
      for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = buf[n - 1 - i];
    }
    """
    kernel = jit.compile(source, "reverse_through_smem")
    n = 100 * 1024 // 4  # 100 KiB of floats: past the 48 KiB default limit
    x = torch.randn(n, device="cuda")
    out = torch.empty_like(x)
    kernel(1, 1024, x, out, n, shared_mem=n * 4)
    torch.testing.assert_close(out, x.flip(0), rtol=0, atol=0)


def test_shared_memory_past_device_limit_is_a_clear_error():
    kernel = jit.compile(ELEMENTWISE, "add_f32")
    limit = stitchcuda._C.device_info(torch.cuda.current_device())["max_shared_per_block_optin"]
    a = torch.zeros(4, device="cuda")
    with pytest.raises(stitchcuda.StitchError, match="(?i)shared"):
        kernel(1, 32, a, a, a, 4, shared_mem=limit + 1024)


def test_cluster_launch():
    source = r"""
    #include <cooperative_groups.h>
    extern "C" __global__ void cluster_ranks(int* rank, int* size) {
      auto cluster = cooperative_groups::this_cluster();
      if (threadIdx.x == 0) {
        rank[blockIdx.x] = (int)cluster.block_rank();
        size[blockIdx.x] = (int)cluster.num_blocks();
      }
    }
    """
    kernel = jit.compile(source, "cluster_ranks")
    rank = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    size = torch.full((8,), -1, dtype=torch.int32, device="cuda")
    kernel(8, 32, rank, size, cluster=2)
    assert rank.tolist() == [0, 1] * 4
    assert size.tolist() == [2] * 8


def test_attributes_and_occupancy():
    source = r"""
    extern "C" __global__ void __launch_bounds__(128) staged(const float* in, float* out) {
      __shared__ float tile[1024];  // 4096 bytes of static shared memory
      tile[threadIdx.x] = in[threadIdx.x];
      __syncthreads();
      out[threadIdx.x] = tile[127 - threadIdx.x];
    }
    """
    kernel = jit.compile(source, "staged")
    attrs = kernel.attributes
    assert isinstance(attrs, jit.KernelAttributes)
    assert attrs.static_shared_bytes == 4096
    assert 0 < attrs.num_registers <= 255
    assert attrs.max_threads_per_block == 128
    assert attrs.local_bytes == 0
    major, minor = torch.cuda.get_device_capability()
    assert attrs.binary_version == major * 10 + minor
    assert 1 <= kernel.occupancy(128) <= 32


def _order_check(kernel, n: int, stream=None) -> torch.Tensor:
    # A slow torch op first, so a kernel on the wrong stream would read x before it is written.
    m = torch.randn(2048, 2048, device="cuda")
    for _ in range(4):
        m = m @ m / 2048
    x = torch.full((n,), 3.0, device="cuda") + m[0, 0] * 0  # written after the matmuls
    y = torch.empty_like(x)
    kernel(blocks(n), 256, x, y, n, stream=stream)
    return y * 2  # reads the kernel's output on the current stream, no sync in between


def test_ordering_with_torch_on_default_stream():
    kernel = jit.compile(ADD_ONE, "add_one")
    z = _order_check(kernel, 1 << 22)
    torch.cuda.synchronize()
    assert torch.all(z == 8.0)


def test_ordering_with_torch_on_a_side_stream():
    kernel = jit.compile(ADD_ONE, "add_one")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        z = _order_check(kernel, 1 << 22)
    s.synchronize()
    assert torch.all(z == 8.0)


@pytest.mark.parametrize("as_handle", [False, True])
def test_explicit_stream_argument(as_handle):
    kernel = jit.compile(ADD_ONE, "add_one")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.full((4096,), 1.5, device="cuda")
        y = torch.empty_like(x)
        kernel(blocks(4096), 256, x, y, 4096, stream=s.cuda_stream if as_handle else s)
        z = y * 2
    s.synchronize()
    assert torch.all(z == 5.0)


def test_wrong_argument_count_is_rejected():
    kernel = jit.compile(ADD_ONE, "add_one")
    x = torch.zeros(16, device="cuda")
    with pytest.raises(stitchcuda.StitchError) as info:
        kernel(1, 16, x, x)
    assert "3" in str(info.value) and "2" in str(info.value)


def test_wrong_dtype_against_signature_is_rejected():
    kernel = jit.compile(ADD_ONE, "add_one")
    x = torch.zeros(16, device="cuda", dtype=torch.float64)
    y = torch.zeros(16, device="cuda")
    with pytest.raises(stitchcuda.StitchError) as info:
        kernel(1, 16, x, y, 16)
    message = str(info.value).lower()
    assert "float" in message and ("double" in message or "float64" in message)


def test_explicit_signature_checks_template_kernels():
    source = "template <typename T> __global__ void fill(T* out, T v) { out[threadIdx.x] = v; }"
    unchecked = jit.compile(source, "fill<float>")
    checked = jit.compile(source, "fill<float>", signature=["float*", "float"])
    x = torch.zeros(8, device="cuda", dtype=torch.float64)
    with pytest.raises(stitchcuda.StitchError):
        checked(1, 8, x, 1.0)
    y = torch.zeros(8, device="cuda")
    checked(1, 8, y, 2.0)
    unchecked(1, 8, y, 3.0, shared_mem=0)  # no signature: no dtype check, still correct here
    torch.cuda.synchronize()
    assert torch.all(y == 3.0)


def test_non_contiguous_tensor_is_rejected():
    kernel = jit.compile(ADD_ONE, "add_one")
    x = torch.zeros(16, 16, device="cuda").t()
    y = torch.zeros(256, device="cuda")
    with pytest.raises(stitchcuda.StitchError, match="(?i)contiguous"):
        kernel(1, 256, x, y, 256)


def test_block_too_large_is_rejected():
    kernel = jit.compile(ADD_ONE, "add_one")
    x = torch.zeros(16, device="cuda")
    with pytest.raises(stitchcuda.StitchError, match="(?i)block"):
        kernel(1, 2048, x, x, 16)


def test_device_fault_is_reported_as_an_error_in_the_process(subprocess_env):
    script = textwrap.dedent(r"""
        import torch, stitchcuda
        from stitchcuda import jit
        bad = jit.compile('extern "C" __global__ void bad() { *(volatile int*)0x10 = 1; }', "bad")
        try:
            bad(1, 1)
            jit.synchronize()
            print("NO ERROR")
        except stitchcuda.StitchError as exc:
            print("CAUGHT", type(exc).__name__, str(exc).replace("\n", " "))
    """)
    child = subprocess.run([sys.executable, "-c", script], env=subprocess_env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stdout + child.stderr
    assert "CAUGHT" in child.stdout, child.stdout + child.stderr
    kind = child.stdout.split("CAUGHT", 1)[1].split()[0]
    assert kind in ("LaunchError", "CudaError")
    assert "illegal" in child.stdout.lower() or "address" in child.stdout.lower()
