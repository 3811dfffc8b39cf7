"""Preemption notices as each cloud documents them, against fake metadata services on loopback:
a notice only on the provider's own word, none on the "no event" answers, and a malformed or
unreachable answer never a notice."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agent.daemon.preemption import NoticeSource
from tests.harness.metadata import MetadataServer


@pytest.fixture(params=["gce", "aws", "azure"])
def cloud(request: pytest.FixtureRequest) -> Iterator[MetadataServer]:
    srv = MetadataServer(request.param)
    yield srv
    srv.close()


def test_a_notice_only_on_the_providers_word(cloud: MetadataServer) -> None:
    src = NoticeSource(cloud.cloud, metadata_url=cloud.url)
    assert src.poll() is None
    assert src.poll() is None, "no event: no notice, however often polled"
    cloud.preempted = True
    n = src.poll()
    assert n is not None
    assert n.final
    assert n.provider == cloud.cloud


def test_a_broken_metadata_service_is_never_a_notice(cloud: MetadataServer) -> None:
    src = NoticeSource(cloud.cloud, metadata_url=cloud.url)
    for status in (200, 403, 500):
        cloud.broken = status
        assert src.poll() is None, status
    assert NoticeSource(cloud.cloud, metadata_url="http://127.0.0.1:9").poll() is None  # nothing listens


def test_gce_needs_its_header_and_reads_the_body_not_the_status() -> None:
    srv = MetadataServer("gce")
    try:
        src = NoticeSource("gce", metadata_url=srv.url)
        assert src.poll() is None  # 200 "FALSE"
        srv.maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
        n = src.poll()
        assert n is not None
        assert "maintenance-event" in n.detail
        # the old way (a plain GET, any 200 a notice) gets a 403 here, and would fire on "FALSE"
        assert NoticeSource("url", url=f"{srv.url}/computeMetadata/v1/instance/preempted").poll() is None
    finally:
        srv.close()


def test_aws_uses_an_imdsv2_token_and_takes_a_rebalance_for_an_early_signal() -> None:
    srv = MetadataServer("aws")
    try:
        src = NoticeSource("aws", metadata_url=srv.url)
        assert src.poll() is None
        srv.rebalance = True
        n = src.poll()
        assert n is not None
        assert not n.final
        srv.preempted = True
        n = src.poll()
        assert n is not None
        assert n.final
        assert "terminate" in n.detail
        assert [r for r in srv.requests if r[0] == "PUT"] == [("PUT", "/latest/api/token")], "one token, kept"
    finally:
        srv.close()


def test_azure_acknowledges_the_events_it_acted_on() -> None:
    srv = MetadataServer("azure")
    try:
        src = NoticeSource("azure", metadata_url=srv.url)
        assert src.poll() is None  # a Freeze is not a notice
        srv.preempted = True
        n = src.poll()
        assert n is not None
        assert n.ack == ("E-1",)
        src.acknowledge(n)
        assert srv.acks == [{"StartRequests": [{"EventId": "E-1"}]}]
    finally:
        srv.close()
