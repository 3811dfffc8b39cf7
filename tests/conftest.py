"""The fixtures every test may use (their machinery is in :mod:`tests.harness`).

S3 tests run against one real SeaweedFS server started for the whole session
(see ``tests/harness/seaweed.py``). Tests that use it are marked ``pytest.mark.s3``;
a missing ``weed`` binary fails them loudly instead of skipping them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.harness.paths import short_dir
from tests.harness.seaweed import SeaweedServer, find_weed, s3_environ
from tests.harness.sglang import find_sglang_python

_bucket_seq = itertools.count()
# the suite's gc and unlock calls judge locks stale in seconds (refused outside tests: ckpt.lock);
# set before any test, so the CLI subprocesses the tests start inherit it
os.environ["GPUCKPT_TEST_SHORT_STALE_LIMITS"] = "1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the SeaweedFS server carries the ``s3`` marker."""
    for item in items:
        if "seaweed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the session, with the test credentials in os.environ."""
    try:
        weed = find_weed()
    except FileNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    with s3_environ():
        server = SeaweedServer(weed=weed)
        try:
            server.start()
            yield server
        finally:
            server.close()


@pytest.fixture
def s3_bucket(seaweed: SeaweedServer) -> str:
    """A fresh, empty bucket (unique, lowercase) on the session server."""
    name = f"t{next(_bucket_seq):04d}-{uuid.uuid4().hex[:10]}"
    return seaweed.make_bucket(name)


@pytest.fixture
def s3_url(seaweed: SeaweedServer, s3_bucket: str) -> str:
    """``s3://<fresh bucket>/repo?endpoint=<server>``."""
    return f"s3://{s3_bucket}/repo?endpoint={seaweed.endpoint}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (for Unix sockets), removed after the test."""
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def module_cleanup() -> Iterator[ExitStack]:
    """Exits at the module's end, for what a module's fixtures start before its turn (a worker that
    starts while another works): ``module_cleanup.enter_context(worker)``."""
    with ExitStack() as stack:
        yield stack


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """SGLang's interpreter. Without it the test is skipped, saying so, unless
    ``GPUCKPT_REQUIRE_SGLANG=1`` (then it fails naming what is missing)."""
    py, why = find_sglang_python()
    if why is None:
        return py
    if os.environ.get("GPUCKPT_REQUIRE_SGLANG") == "1":
        pytest.fail(f"GPUCKPT_REQUIRE_SGLANG=1: {why}")
    pytest.skip(why)
