// The emulator's launcher: runs a kernel body (a callback that calls the kernel with its
// arguments) once per CUDA thread, block after block.
#include <memory>
#include <thread>
#include <vector>

#include "cuda_on_cpu.hpp"

thread_local EmuDim3 threadIdx, blockIdx;
EmuDim3 blockDim, gridDim;
thread_local EmuWarp* emu_warp;
thread_local int emu_lane;
std::barrier<>* emu_block_barrier;
unsigned char* emu_dynamic_shared;

extern "C" void emu_launch(int gx, int gy, int gz, int bx, int by, int bz, std::size_t shared_bytes,
                           void (*body)()) {
  gridDim = {unsigned(gx), unsigned(gy), unsigned(gz)};
  blockDim = {unsigned(bx), unsigned(by), unsigned(bz)};
  const int threads = bx * by * bz;
  std::vector<unsigned char> shared(shared_bytes + 16);
  emu_dynamic_shared = shared.data();
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        std::barrier<> block_barrier(threads);
        emu_block_barrier = &block_barrier;
        std::vector<std::unique_ptr<EmuWarp>> warps;
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new EmuWarp());
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([&, t, x, y, z] {
            blockIdx = {unsigned(x), unsigned(y), unsigned(z)};
            threadIdx = {unsigned(t % bx), unsigned((t / bx) % by), unsigned(t / (bx * by))};
            emu_warp = warps[t / 32].get();
            emu_lane = t % 32;
            body();
            // A thread that returned leaves both barriers, so early exits do not deadlock the rest.
            emu_warp->bar.arrive_and_drop();
            emu_block_barrier->arrive_and_drop();
          });
        for (auto& th : pool) th.join();
      }
}
