// The emulator's launcher: runs a kernel body (a callback that calls the kernel with its
// arguments) once per CUDA thread, block after block. One OS thread per CUDA thread of a block,
// started once per launch and reused for every block (starting 256 threads per block made thread
// creation most of a launch's time); each block gets fresh barriers, so a thread that returns early
// drops out of its own block's barriers only.
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
  // The block the pool runs next, and the barriers it uses; the launcher sets them between blocks,
  // while every pool thread waits at `start`.
  EmuDim3 block;
  bool done = false;
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<EmuWarp>> warps;
  std::barrier<> start(threads + 1), end(threads + 1);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      threadIdx = {unsigned(t % bx), unsigned((t / bx) % by), unsigned(t / (bx * by))};
      emu_lane = t % 32;
      for (;;) {
        start.arrive_and_wait();
        if (done) return;
        blockIdx = block;
        emu_warp = warps[t / 32].get();
        body();
        // A thread that returned leaves its block's barriers, so early exits do not deadlock the rest.
        emu_warp->bar.arrive_and_drop();
        emu_block_barrier->arrive_and_drop();
        end.arrive_and_wait();
      }
    });
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        block = {unsigned(x), unsigned(y), unsigned(z)};
        block_barrier = std::make_unique<std::barrier<>>(threads);
        emu_block_barrier = block_barrier.get();
        warps.clear();
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(new EmuWarp());
        start.arrive_and_wait();
        end.arrive_and_wait();
      }
  done = true;
  start.arrive_and_wait();
  for (auto& th : pool) th.join();
}
