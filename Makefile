# Two commands matter: `make run` and `make test`. Both set the machine up first when needed.
SHELL  := /bin/bash
ROOT   := $(abspath .)
VENV   := $(ROOT)/.venv
PY     := $(VENV)/bin/python
BUILD  := $(ROOT)/build
ASAN_BUILD := $(ROOT)/build-asan
STAMP  := $(VENV)/.stitchcuda-setup
CCACHE := $(shell command -v ccache 2>/dev/null)
# ccache keys on paths relative to the tree, so a clone elsewhere (CI's, the wheel test's clean copy) reuses
# the objects compiled here.
export CCACHE_BASEDIR := $(ROOT)
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

# The tests use every core: ctest's tests side by side, pytest's files spread over worker processes
# (pytest-xdist; each file whole on one worker, in order, as in a serial run). Where a GPU is present
# pytest runs in one process: the GPU tests time kernels on a GPU nothing else is using. Files start in
# collection order, the ones conftest.py names as long first (xdist would start the files with most tests).
# `make test PYTEST_WORKERS=0` runs pytest serially anywhere.
NPROC := $(shell nproc 2>/dev/null || echo 2)
GPUS  := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
PYTEST_WORKERS ?= $(if $(filter 0,$(GPUS)),$(NPROC),0)
PYTEST := $(PY) -m pytest tests/python -q -rs $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
CTEST  := ctest --output-on-failure -j $(NPROC)

test-cpp: build
	cd $(BUILD) && $(CTEST)

test-python: build
	$(PYTEST)

# Both at once (on two cores the whole run is about half as long as one after the other). ctest's output
# waits in build/ctest.log and is printed once pytest is done; pytest's summary line is repeated at the
# end, so the run closes with it. Fails when either fails.
test: build
	@rm -f $(BUILD)/ctest.log $(BUILD)/ctest.rc
	@(cd $(BUILD) && $(CTEST) > ctest.log 2>&1; echo $$? > ctest.rc) & \
	$(PYTEST) 2>&1 | tee $(BUILD)/pytest.log; py=$${PIPESTATUS[0]}; \
	wait; cpp=$$(cat $(BUILD)/ctest.rc 2>/dev/null || echo 1); \
	echo "---- ctest (C++ tests, run beside pytest) ----"; cat $(BUILD)/ctest.log; \
	echo "---- pytest ----"; tail -n 1 $(BUILD)/pytest.log; \
	[ "$$cpp" = 0 ] || echo "make test: ctest failed (exit $$cpp): its output is above"; \
	[ "$$py" = 0 ] || echo "make test: pytest failed (exit $$py)"; \
	[ "$$cpp" = 0 ] && [ "$$py" = 0 ]

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
