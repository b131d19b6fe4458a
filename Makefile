# Two commands matter: `make run` and `make test`. Both set the machine up first when needed.
ROOT   := $(abspath .)
VENV   := $(ROOT)/.venv
PY     := $(VENV)/bin/python
BUILD  := $(ROOT)/build
ASAN_BUILD := $(ROOT)/build-asan
STAMP  := $(VENV)/.stitchcuda-setup
CCACHE := $(shell command -v ccache 2>/dev/null)
export PATH := $(VENV)/bin:/usr/local/cuda/bin:$(PATH)

.PHONY: setup build run test test-cpp test-python test-asan clean

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

# The main job: check the machine, the JIT demo, then optimize the example models (planned and compiled
# only where there is no GPU; verified, timed and saved where there is one).
run: build
	$(VENV)/bin/stitchcuda doctor
	$(VENV)/bin/stitchcuda demo
	gpu=$$($(PY) -c 'import torch; print(int(torch.cuda.is_available()))'); \
	for model in examples/models/*.py; do \
	  save=; [ "$$gpu" = 1 ] && save="--save $(BUILD)/$$(basename $$model .py).stitch"; \
	  $(VENV)/bin/stitchcuda optimize $$model $$save || exit 1; \
	done

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure

test-python: build
	$(PY) -m pytest tests/python -q -rs

test: test-cpp test-python

# The llm layer's C++ tests (64 concurrent calls among them) under AddressSanitizer and UBSan, in a
# tree of their own without Python; not part of `make test` because the extra build takes minutes.
test-asan: $(STAMP)
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DSTITCHCUDA_SANITIZE=address,undefined -DSTITCHCUDA_BUILD_PYTHON=OFF -DSTITCHCUDA_BUILD_TESTS=ON \
	  $(if $(CCACHE),-DCMAKE_CXX_COMPILER_LAUNCHER=$(CCACHE))
	cmake --build $(ASAN_BUILD) --target stitchcuda_cpp_tests
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  $(ASAN_BUILD)/tests/cpp/stitchcuda_cpp_tests "[llm]"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) python/stitchcuda/_C*.so
