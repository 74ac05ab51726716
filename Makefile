# mtpserve — one command serves the embedded demo model, one runs the tests.
# Every target installs what it needs first (into .venv), so a fresh clone needs nothing else.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8080
MODEL  ?= models/qwen3.5-demo
STAMP  := $(VENV)/.installed
NATIVE := build/native/.built
NATIVE_SOURCES := $(wildcard engine/model/native/*.cpp engine/model/native/*.h) engine/model/native/CMakeLists.txt

.PHONY: install serve test test-fast lint bench bench-batch bench-kernel soak mutants compare-llamacpp clean

install: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml scripts/setup_libs.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,clients]"
	bash scripts/setup_libs.sh
	touch $(STAMP)

# the CPU product kernel (engine/model/native); a failed build warns and leaves mlx's products
$(NATIVE): $(STAMP) $(NATIVE_SOURCES) scripts/build_native.sh
	bash scripts/build_native.sh $(PY)
	mkdir -p $(dir $(NATIVE)) && touch $(NATIVE)

serve: install
	$(VENV)/bin/mtpserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# two workers, one test file each at a time (module-scoped servers stay shared): the suite is
# mostly one-core work, ~1.35x faster this way on 2 cores (~9.5 against ~12.5 min)
# then the engine's exactness tests once more on mlx's own products (the path without the
# native kernel: a machine with no compiler, or MTPSERVE_NATIVE_PRODUCTS=0)
test: install
	$(PY) -m pytest -n 2 --dist loadfile
	MTPSERVE_NATIVE_PRODUCTS=0 $(PY) -m pytest -n 2 --dist loadfile $(FALLBACK_TESTS)

# The edit loop's tier (~1.5 min on 2 cores): every unit test and the tests marked `fast` in
# tests/engine, tests/server, tests/e2e, chosen so that every module the suite tests runs here
# too (README "Development"). Not a substitute for `test`.
test-fast: install
	$(PY) -m pytest -n 2 --dist loadfile -m fast

FALLBACK_TESTS := tests/engine/test_engine.py tests/engine/test_acceptance_exact.py \
                  tests/engine/test_batching.py tests/unit/test_attention.py

# Known bugs applied one at a time to a copy of the tree: each must fail a fast test (not in `test`).
mutants: install
	$(PY) scripts/mutants.py

lint: install
	$(VENV)/bin/ruff check .

# The client libraries (instructor, pydantic-ai, langchain, openai-agents, litellm, llm; pinned in
# the `clients` extra) against a server on the demo model; `test` runs them too.
.PHONY: test-clients
test-clients: install
	$(PY) -m pytest tests/e2e/test_clients.py tests/server/test_server_client_compat.py

bench: install
	$(VENV)/bin/mtpserve bench --model $(MODEL) --out bench-results

# continuous batching against one request at a time, concurrency 1, 2, 4, 8 (bench-results/bench_batch.*)
bench-batch: install
	$(VENV)/bin/mtpserve bench-batch --model $(MODEL) --out bench-results

# the native product kernel alone at Qwen3.5-0.8B shapes: fp32/bf16/q8/q4 against this machine's
# read bandwidth and mlx's own products (bench-results/bench_kernel.*)
bench-kernel: install
	$(PY) scripts/bench_kernel.py --crossover --bound --out bench-results

# 500 requests side by side with disconnects mixed in; the server's resident memory over time
soak: install
	$(PY) scripts/soak.py --model $(MODEL) --out bench-results/soak.json

# mtpserve vs llama.cpp (built here from the llama-cpp-python sdist's vendored sources, in the
# git-ignored .llamacpp/); not part of `make test`. Results in bench-results/compare_llamacpp.*
# SHAPE=runs/shapes/qwen3.5-0.8B (made by `$(PY) scripts/make_shapes.py 0.8B`): plain decoding
# and 512-token prompt processing at that checkpoint's shape instead, F32/BF16/Q8_0/Q4_0 against
# fp32/bf16/mlx 8-bit/4-bit
# (bench-results/compare_llamacpp_shape.*)
SHAPE ?=
compare-llamacpp: install
	$(PY) scripts/compare_llamacpp.py --model $(MODEL) --out bench-results \
		$(if $(SHAPE),--shape-model $(SHAPE))

clean:
	rm -rf $(VENV) bench-results .pytest_cache .ruff_cache
