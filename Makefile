# Two commands matter: `make run` and `make test`. Both set the machine up first when needed.
ROOT   := $(abspath .)
VENV   := $(ROOT)/.venv
PY     := $(VENV)/bin/python
BUILD  := $(ROOT)/build
STAMP  := $(VENV)/.stitchcuda-setup
CCACHE := $(shell command -v ccache 2>/dev/null)
export PATH := $(VENV)/bin:/usr/local/cuda/bin:$(PATH)

.PHONY: setup build run test test-cpp test-python clean

$(STAMP): scripts/setup pyproject.toml
	bash scripts/setup
	touch $@

setup: $(STAMP)

$(BUILD)/build.ninja: $(STAMP) CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DSTITCHCUDA_BUILD_PYTHON=ON -DSTITCHCUDA_BUILD_TESTS=ON \
	  -DPython_EXECUTABLE=$(PY) $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))

build: $(BUILD)/build.ninja
	cmake --build $(BUILD)

# The main job (until optimize() lands): check the machine, then the JIT demo.
run: build
	$(VENV)/bin/stitchcuda doctor
	$(VENV)/bin/stitchcuda demo

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure

test-python: build
	$(PY) -m pytest tests/python -q -rs

test: test-cpp test-python

clean:
	rm -rf $(BUILD) python/stitchcuda/_C*.so
