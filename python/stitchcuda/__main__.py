"""`python -m stitchcuda`: the same command line as the `stitchcuda` script, plus `--cmake-dir`, which prints
the installed package's CMake config folder for C++ users (as `python -m pybind11 --cmakedir` does):

    cmake -S . -B build -Dstitchcuda_DIR="$(python -m stitchcuda --cmake-dir)"
"""

import sys
from pathlib import Path

CMAKE_DIR = Path(__file__).resolve().parent / "lib" / "cmake" / "stitchcuda"


def _cmake_dir() -> int:
    if (CMAKE_DIR / "stitchcudaConfig.cmake").is_file():
        print(CMAKE_DIR)
        return 0
    print(f"python -m stitchcuda --cmake-dir: {CMAKE_DIR.parent.parent.parent} has no CMake package config "
          "(lib/cmake/stitchcuda): it is the development tree, not an installed wheel. Install the wheel "
          "(pip install --no-build-isolation .), or the C++ package alone (cmake --install build --prefix "
          "PREFIX, then -Dstitchcuda_DIR=PREFIX/lib/cmake/stitchcuda)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--cmake-dir"]:
        sys.exit(_cmake_dir())
    from .cli import main

    sys.exit(main())
