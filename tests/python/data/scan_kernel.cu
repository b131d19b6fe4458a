// log1p(cumsum(sigmoid(x) * w, dim=-1)) over rows: one 1,024-thread block per row, four consecutive elements per
// thread and tile of 4,096, the block's prefix through warp shuffles, a running carry across tiles.
extern "C" __global__ void __launch_bounds__(1024)
scan_sigmoid_log1p(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y, int rows, int cols) {
  __shared__ float warp_sums[32];
  __shared__ float carry_in;
  const int row = blockIdx.x;
  if (row >= rows) return;
  const float* xr = x + (long long)row * cols;
  float* yr = y + (long long)row * cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool vector = (cols & 3) == 0;
  if (threadIdx.x == 0) carry_in = 0.0f;
  __syncthreads();
  for (int base = 0; base < cols; base += 4 * blockDim.x) {
    const int c = base + 4 * threadIdx.x;
    float v[4];
    if (vector && c + 3 < cols) {
      const float4 a = *reinterpret_cast<const float4*>(xr + c);
      const float4 b = *reinterpret_cast<const float4*>(w + c);
      v[0] = b.x / (1.0f + expf(-a.x)); v[1] = b.y / (1.0f + expf(-a.y));
      v[2] = b.z / (1.0f + expf(-a.z)); v[3] = b.w / (1.0f + expf(-a.w));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = c + i < cols ? w[c + i] / (1.0f + expf(-xr[c + i])) : 0.0f;
    }
    v[1] += v[0]; v[2] += v[1]; v[3] += v[2];
    float total = v[3];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float up = __shfl_up_sync(0xffffffffu, total, d);
      if (lane >= d) total += up;
    }
    if (lane == 31) warp_sums[warp] = total;
    __syncthreads();
    if (warp == 0) {
      const int nwarps = blockDim.x >> 5;
      float s = lane < nwarps ? warp_sums[lane] : 0.0f;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, s, d);
        if (lane >= d) s += up;
      }
      if (lane < nwarps) warp_sums[lane] = s;
    }
    __syncthreads();
    const float before = carry_in + (warp > 0 ? warp_sums[warp - 1] : 0.0f) + (total - v[3]);
    float out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = log1pf(before + v[i]);
    if (vector && c + 3 < cols) {
      *reinterpret_cast<float4*>(yr + c) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) if (c + i < cols) yr[c + i] = out[i];
    }
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry_in = before + v[3];
    __syncthreads();
  }
}
