// Just enough CUDA for the corpus's kernels to run as C++ on the CPU: one std::thread per CUDA
// thread, blocks one after another (so a function-static array is the block's shared memory),
// __syncthreads and warp shuffles as barriers. Correctness checking only; nothing here is fast.
#pragma once
#include <math.h>

#include <barrier>
#include <cstddef>
#include <cstring>

struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
extern thread_local EmuDim3 threadIdx, blockIdx;
extern EmuDim3 blockDim, gridDim;

struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

struct EmuWarp {
  std::barrier<> bar{32};
  double lanes[32];
};
extern thread_local EmuWarp* emu_warp;
extern thread_local int emu_lane;
extern std::barrier<>* emu_block_barrier;
extern unsigned char* emu_dynamic_shared;  // `extern __shared__ T name[];` is rewritten to point here

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
inline float __fdividef(float a, float b) { return a / b; }  // the GPU's is approximate (2 ulp)
inline float __int_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float __uint_as_float(unsigned u) { return __int_as_float(u); }
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Every lane of the warp must take part, as the corpus's kernels do (full masks, whole warps exit).
template <class T>
T emu_shuffle(T v, int source_lane) {
  emu_warp->lanes[emu_lane] = static_cast<double>(v);
  emu_warp->bar.arrive_and_wait();
  T r = static_cast<T>(emu_warp->lanes[source_lane]);
  emu_warp->bar.arrive_and_wait();
  return r;
}
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) { return emu_shuffle(v, emu_lane ^ mask); }
template <class T>
T __shfl_down_sync(unsigned, T v, int delta) { return emu_shuffle(v, emu_lane + delta < 32 ? emu_lane + delta : emu_lane); }
template <class T>
T __shfl_up_sync(unsigned, T v, int delta) { return emu_shuffle(v, emu_lane - delta >= 0 ? emu_lane - delta : emu_lane); }
