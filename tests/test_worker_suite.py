"""The worker conformance suite (``tests/worker_suite.py``) against every worker side."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.engines.channel import WorkerChannel
from tests.fake_connector import PAGE_SHAPE, FakeConnector
from tests.harness.paths import short_dir
from tests.worker_suite import Subject, WorkerTests


def _where() -> Iterator[Path]:
    d = short_dir("wsuite-")
    (d / "offer").mkdir(mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


where = pytest.fixture(_where)


class TestFake(WorkerTests):
    @pytest.fixture
    def subject(self, where: Path) -> Iterator[Subject]:
        fake = FakeConnector(where / "c.sock", where / "stage")
        channel = WorkerChannel(fake.sock)
        yield Subject(channel, where / "stage", where / "offer", PAGE_SHAPE, "float32", ["l0", "l1"], "vllm")
        fake.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    from tests.harness.models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def vllm_subject(model: Path) -> Iterator[Subject]:
    """Started once (the suite's tests end what they offer or capture)."""
    from tests.harness.workers import VllmHalves

    gen = _where()
    where = next(gen)
    h = VllmHalves(model, where / "c.sock", where / "stage")
    yield Subject(h.channel, where / "stage", where / "offer", h.page_shape, h.dtype, h.layers, "vllm")
    h.close()
    next(gen, None)


@pytest.mark.vllm_classes
class TestVllmSchedulerHalf(WorkerTests):
    @pytest.fixture
    def subject(self, vllm_subject: Subject) -> Subject:
        return vllm_subject


@pytest.fixture(scope="module")
def sglang_subject(sglang_python: str) -> Iterator[Subject]:
    """Started once (see vllm_subject)."""
    from tests.harness.workers import SglangLinkerHost

    gen = _where()
    where = next(gen)
    h = SglangLinkerHost(sglang_python, where / "c.sock", where / "stage", where / "linker.log")
    shape = SglangLinkerHost.PAGE_SHAPE
    yield Subject(h.channel, where / "stage", where / "offer", shape, "float32", ["layer.0", "layer.1"], "sglang")
    h.close()
    next(gen, None)


class TestSglangLinker(WorkerTests):
    @pytest.fixture
    def subject(self, sglang_subject: Subject) -> Subject:
        return sglang_subject


def test_an_sglang_outside_the_supported_range_is_served_with_gpuckpt_disabled(
    sglang_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The linker in an SGLang it was not tested against: it answers ``ping``, its description says
    why it is disabled, naming the version and the range, and a capture is refused with it."""
    from agent.engines import versions
    from ckpt.errors import EngineError
    from tests.harness.workers import SglangLinkerHost

    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    gen = _where()
    where = next(gen)
    h = SglangLinkerHost(
        sglang_python, where / "c.sock", where / "stage", where / "linker.log", {"GPUCKPT_TEST_SGLANG_VERSION": "0.6.0"}
    )
    try:
        h.channel.ping()
        why = "sglang 0.6.0 is outside the versions this gpuckpt supports (sglang>=0.5.23,<0.5.24)"
        assert why in str(h.channel.describe().layout.get("kv_not_carried")), h.channel.describe().layout
        with pytest.raises(EngineError, match=r"sglang 0\.6\.0 is outside"):
            h.channel.capture(timeout=30)
        assert why in (where / "linker.log").read_text()
    finally:
        h.close()
        next(gen, None)
