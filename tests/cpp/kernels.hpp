// CUDA sources shared by several C++ test files.
#pragma once

namespace {

// c = a + b over n floats, one thread per element.
const char* const kVectorAdd = R"(extern "C" __global__ void add(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}
)";

}  // namespace
