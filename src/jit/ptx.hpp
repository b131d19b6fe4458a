// Reads kernel entry points and their parameter types from PTX text.
#pragma once

#include <string_view>
#include <vector>

#include <stitchcuda/jit.hpp>

namespace stitchcuda::jit::detail {

/// Every `.entry` in the PTX with its parameters, in order.
std::vector<KernelInfo> parse_ptx_kernels(std::string_view ptx);

}  // namespace stitchcuda::jit::detail
