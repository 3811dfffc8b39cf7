"""Fixtures for the SGLang adapter's tests: the SGLang interpreter and servers with gpuckpt's linker
(their machinery: :mod:`tests.harness.sglang`).

Without SGLang's interpreter the tests are skipped, saying so, unless ``GPUCKPT_REQUIRE_SGLANG=1``
(then they fail naming what is missing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.models import write_tiny_llama
from tests.harness.sglang import Servers, Start


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("sglang-model") / "llama", dtype="float32", seed=7)


@pytest.fixture(scope="module")
def start_server(sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Start]:
    """``start(name, page_size=16)``: an SGLang server with the linker, ready; all killed at the end."""
    servers = Servers(sglang_python, tiny_model, tmp_path_factory.mktemp("sglang-run"))
    yield servers.start
    servers.close()
