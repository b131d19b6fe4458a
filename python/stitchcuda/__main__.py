"""`python -m stitchcuda`: the same command line as the `stitchcuda` script, plus `--cmake-dir`, which prints
the installed package's CMake config folder for C++ users (as `python -m pybind11 --cmakedir` does):

    cmake -S . -B build -Dstitchcuda_DIR="$(python -m stitchcuda --cmake-dir)"
"""

import sys
from pathlib import Path

CMAKE_DIR = Path(__file__).resolve().parent / "lib" / "cmake" / "stitchcuda"
CMAKE_DIR_HELP = ("--cmake-dir (alone): print the installed package's CMake config folder, for "
                  "cmake -Dstitchcuda_DIR=\"$(python -m stitchcuda --cmake-dir)\"")


def _cmake_dir() -> int:
    if (CMAKE_DIR / "stitchcudaConfig.cmake").is_file():
        print(CMAKE_DIR)
        return 0
    print(f"python -m stitchcuda --cmake-dir: {CMAKE_DIR.parent.parent.parent} has no CMake package config "
          "(lib/cmake/stitchcuda): it is the development tree, not an installed wheel. Install the wheel "
          "(pip install --no-build-isolation .), or the C++ package alone (cmake --install build --prefix "
          "PREFIX, then -Dstitchcuda_DIR=PREFIX/lib/cmake/stitchcuda)", file=sys.stderr)
    return 1


def _help() -> int:
    """The command line's help, with the one option only `python -m stitchcuda` has."""
    from .cli import build_parser

    parser = build_parser()
    parser.prog = "python -m stitchcuda"
    parser.epilog = CMAKE_DIR_HELP
    parser.print_help()
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--cmake-dir"]:
        sys.exit(_cmake_dir())
    if sys.argv[1:] in (["-h"], ["--help"]):
        sys.exit(_help())
    from .cli import main

    sys.exit(main())
