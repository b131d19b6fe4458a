# Finds LibTorch through the Python interpreter's torch package, without TorchConfig.cmake
# (which drags in a CUDA language setup we do not need). Defines the target stitchcuda_libtorch.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import torch, torch.utils.cpp_extension as c; print(','.join(c.include_paths()), ','.join(c.library_paths()), int(torch._C._GLIBCXX_USE_CXX11_ABI), torch.__version__, sep='|', end='')"
  OUTPUT_VARIABLE _torch_info RESULT_VARIABLE _torch_rc ERROR_VARIABLE _torch_err)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "PyTorch is needed for the Python extension but '${Python_EXECUTABLE} -c \"import torch\"' failed:\n${_torch_err}\nInstall torch (make setup) or configure with -DSTITCHCUDA_BUILD_PYTHON=OFF.")
endif()
string(REPLACE "|" ";" _torch_parts "${_torch_info}")
list(GET _torch_parts 0 _torch_inc)
list(GET _torch_parts 1 _torch_lib)
list(GET _torch_parts 2 _torch_abi)
list(GET _torch_parts 3 STITCHCUDA_TORCH_VERSION)
string(REPLACE "," ";" _torch_inc "${_torch_inc}")
string(REPLACE "," ";" _torch_lib "${_torch_lib}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" STITCHCUDA_TORCH_PIN "${STITCHCUDA_TORCH_VERSION}")  # X.Y: the ABI a build links
message(STATUS "stitchcuda: PyTorch ${STITCHCUDA_TORCH_VERSION} (C++11 ABI=${_torch_abi})")
add_library(stitchcuda_libtorch INTERFACE)
set(STITCHCUDA_TORCH_INCLUDE_DIRS ${_torch_inc} ${CUDAToolkit_INCLUDE_DIRS})
set(STITCHCUDA_TORCH_LIBRARIES)
foreach(_lib c10 c10_cuda torch torch_cpu torch_cuda)
  find_library(STITCHCUDA_TORCH_${_lib} ${_lib} PATHS ${_torch_lib} NO_DEFAULT_PATH REQUIRED)
  list(APPEND STITCHCUDA_TORCH_LIBRARIES ${STITCHCUDA_TORCH_${_lib}})
endforeach()
# The CUDA runtime torch ships with (C++ users of c10::cuda streams call into it); else the toolkit's.
find_library(STITCHCUDA_TORCH_cudart NAMES libcudart.so.13 libcudart.so.12 cudart
  PATHS ${_torch_lib}/../../nvidia/cu13/lib ${_torch_lib}/../../nvidia/cuda_runtime/lib NO_DEFAULT_PATH)
if(STITCHCUDA_TORCH_cudart)
  list(APPEND STITCHCUDA_TORCH_LIBRARIES ${STITCHCUDA_TORCH_cudart})
else()
  list(APPEND STITCHCUDA_TORCH_LIBRARIES ${CUDA_cudart_LIBRARY})
endif()
# The paths belong to one torch installation (which may live inside the source tree, as .venv does):
# the build sees them here, an installed package gets them from stitchcudaConfig.cmake.
foreach(_dir ${STITCHCUDA_TORCH_INCLUDE_DIRS})
  target_include_directories(stitchcuda_libtorch SYSTEM INTERFACE $<BUILD_INTERFACE:${_dir}>)
endforeach()
foreach(_lib ${STITCHCUDA_TORCH_LIBRARIES})
  target_link_libraries(stitchcuda_libtorch INTERFACE $<BUILD_INTERFACE:${_lib}>)
endforeach()
target_compile_definitions(stitchcuda_libtorch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_torch_abi})
# An installed package records only the version: stitchcudaConfig.cmake finds torch where it is used.
# Only Python extensions link torch_python (it needs the interpreter's symbols); C++ programs do not.
find_library(STITCHCUDA_TORCH_PYTHON_LIBRARY torch_python PATHS ${_torch_lib} NO_DEFAULT_PATH REQUIRED)
