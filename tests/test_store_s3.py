"""S3Store passes the conformance suite against a real SeaweedFS server, plus
what only S3 has: URLs, credentials, multipart faults, retries, debris, checksums."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, ConnectionClosedError

from ckpt.errors import (
    AccessDenied,
    ConfigError,
    IntegrityError,
    ObjectExists,
    ObjectNotFound,
    StoreUnavailable,
)
from ckpt.store import s3 as s3mod
from ckpt.store.s3 import MiB, S3Store
from ckpt.store.s3_errors import translate as _translate
from tests.harness.seaweed import SeaweedServer, free_port
from tests.store_suite import RawAccess, StoreTests

pytestmark = pytest.mark.s3

SMALL_PARTS: dict[str, Any] = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


class BucketRaw(RawAccess):
    """The bucket through a plain boto3 client, bypassing S3Store."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.root = client, bucket, prefix + "/"

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.root + name, Body=data)

    def get(self, name: str) -> bytes:
        body = self.client.get_object(Bucket=self.bucket, Key=self.root + name)["Body"]
        return bytes(body.read())

    def names(self) -> set[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return {o["Key"][len(self.root) :] for p in pages for o in p.get("Contents", [])}

    def uploads(self) -> list[str]:
        resp = self.client.list_multipart_uploads(Bucket=self.bucket)
        return [u["Key"] for u in resp.get("Uploads", [])]


@pytest.fixture
def raw(seaweed: SeaweedServer, s3_bucket: str) -> BucketRaw:
    return BucketRaw(seaweed.admin, s3_bucket, "repo")


@pytest.fixture
def small_parts(s3_url: str) -> Iterator[S3Store]:
    """A store with 5 MiB parts and few retries, so fault tests stay quick."""
    with S3Store.from_url(s3_url, max_attempts=2, **SMALL_PARTS) as s:
        assert isinstance(s, S3Store)
        yield s


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3_url: str) -> Iterator[S3Store]:
        s = S3Store.from_url(s3_url)
        yield s
        s.close()

    @pytest.fixture
    def raw(self, raw: BucketRaw) -> BucketRaw:
        return raw


# -- URLs and configuration ------------------------------------------------------------


def test_from_url_parses_bucket_prefix_endpoint_region() -> None:
    s = S3Store.from_url("s3://my-bucket/some/prefix/?endpoint=http://127.0.0.1:8333&region=eu-west-1")
    with s:
        assert (s.bucket, s.prefix) == ("my-bucket", "some/prefix")
        assert s.endpoint_url == "http://127.0.0.1:8333"
        assert s.client.meta.endpoint_url == "http://127.0.0.1:8333"
        assert s.client.meta.region_name == "eu-west-1"
        assert s.client.meta.config.s3 == {"addressing_style": "path"}
        assert s._key("a/b") == "some/prefix/a/b"
        assert s.url == "s3://my-bucket/some/prefix?endpoint=http://127.0.0.1:8333&region=eu-west-1"
        again = S3Store.from_url(s.url)
        assert (again.bucket, again.prefix, again.endpoint_url, again.region) == (
            "my-bucket",
            "some/prefix",
            "http://127.0.0.1:8333",
            "eu-west-1",
        )
        again.close()
    bare = S3Store.from_url("s3://bkt", region="us-east-1", part_size=8 * MiB)
    assert (bare.prefix, bare.part_size, bare._key("x")) == ("", 8 * MiB, "x")
    assert bare.capabilities.server_checksums
    assert bare.capabilities.parallel_upload
    bare.close()


def test_endpoint_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1111")
    with S3Store.from_url("s3://bkt/p") as s:
        assert isinstance(s, S3Store)
        assert s.endpoint_url == "http://127.0.0.1:1111"
    monkeypatch.setenv("GPUCKPT_S3_ENDPOINT", "http://127.0.0.1:2222")
    with S3Store.from_url("s3://bkt/p") as s:
        assert isinstance(s, S3Store)
        assert s.endpoint_url == "http://127.0.0.1:2222"
    with S3Store.from_url("s3://bkt/p?endpoint=http://127.0.0.1:3333") as s:
        assert isinstance(s, S3Store)
        assert s.endpoint_url == "http://127.0.0.1:3333"


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:hunter2secret@bucket/prefix",
        "s3://hunter2secret@bucket/prefix",
        "s3://bucket/prefix?endpoint=http://user:hunter2secret@127.0.0.1:8333",
        "s3://bucket/prefix?secret_key=hunter2secret",
        "s3://bucket/prefix?endpoint=ftp://user:hunter2secret@127.0.0.1:8333",
    ],
)
def test_from_url_refuses_credentials(url: str) -> None:
    with pytest.raises(ConfigError) as ei:
        S3Store.from_url(url)
    assert "hunter2secret" not in str(ei.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://bucket/prefix",
        "file:///tmp/repo",
        "gs://bucket/prefix",
        "s3:///prefix-without-bucket",
        "s3://bucket/../escape",
        "s3://bucket/prefix?endpoint=ftp://host",
        "s3://bucket/prefix?endpoint=http://127.0.0.1:notaport",
        "s3://bucket/p?region=a&region=b",
    ],
)
def test_from_url_rejects_bad_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        S3Store.from_url(url)


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        S3Store("bucket", part_size=1 * MiB)  # below S3's 5 MiB minimum part
    with pytest.raises(ConfigError):
        S3Store("b")  # bucket names have at least 3 characters
    with pytest.raises(ConfigError) as ei:
        S3Store("bucket", profile="no-such-profile-8812")
    assert "no-such-profile-8812" in str(ei.value)


# -- credentials, buckets, endpoints ---------------------------------------------------------


def test_wrong_secret_is_access_denied(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with S3Store.from_url(s3_url, max_attempts=1) as s:
        for op in (lambda: s.put("x", b"1"), lambda: s.get("x"), lambda: s.stat("x")):
            with pytest.raises(AccessDenied) as ei:
                op()
            assert "wrong-secret-value" not in str(ei.value)
        with pytest.raises(AccessDenied):
            list(s.list(""))


def test_missing_bucket_is_named(seaweed: SeaweedServer) -> None:
    url = f"s3://no-such-bucket-4217/repo?endpoint={seaweed.endpoint}"
    with S3Store.from_url(url, max_attempts=1) as s:
        for op in (lambda: s.put("x", b"1"), lambda: s.get("x"), lambda: list(s.list())):
            with pytest.raises(ObjectNotFound) as ei:
                op()
            assert "bucket 'no-such-bucket-4217' does not exist" in str(ei.value)


def test_unreachable_endpoint_is_unavailable() -> None:
    url = f"s3://bucket/repo?endpoint=http://127.0.0.1:{free_port()}"
    with S3Store.from_url(url, max_attempts=1) as s, pytest.raises(StoreUnavailable) as ei:
        s.stat("x")
    assert "'x'" in str(ei.value)


# -- multipart -------------------------------------------------------------------------------


def test_multipart_part_dropped_aborts_and_leaves_nothing(small_parts: S3Store, raw: BucketRaw) -> None:
    attempts: list[str] = []

    def drop_part_2(request: Any, **_: Any) -> None:
        if "partNumber=2" in request.url:
            attempts.append(request.url)
            raise ConnectionClosedError(endpoint_url=request.url)

    small_parts.client.meta.events.register("before-send.s3.UploadPart", drop_part_2)
    data = os.urandom(12 * MiB)  # three parts
    with pytest.raises(StoreUnavailable) as ei:
        small_parts.put("packs/big", data)
    assert "packs/big" in str(ei.value)
    assert len(attempts) == 2  # max_attempts=2: botocore retried once, then gave up
    assert not small_parts.exists("packs/big")
    assert raw.names() == set()
    assert raw.uploads() == []


def test_multipart_roundtrip_and_parallel_ranged_get(small_parts: S3Store, raw: BucketRaw) -> None:
    data = os.urandom(12 * MiB + 17)
    small_parts.put("packs/p1", memoryview(data))
    assert raw.get("packs/p1") == data
    assert small_parts.get("packs/p1") == data
    # >= 2 parts long: split into parallel ranged GETs
    assert small_parts.get("packs/p1", 3, 11 * MiB) == data[3 : 3 + 11 * MiB]
    with pytest.raises(IntegrityError) as ei:
        small_parts.get("packs/p1", 2 * MiB, 11 * MiB)
    assert "packs/p1" in str(ei.value)
    assert raw.uploads() == []


def test_multipart_conditional_create_on_completion(
    small_parts: S3Store, raw: BucketRaw, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_parts.put("m/big", b"a" * (6 * MiB), if_absent=True)
    with pytest.raises(ObjectExists):
        small_parts.put("m/big", b"b" * (6 * MiB), if_absent=True)  # early HEAD check
    # Skip the early check: If-None-Match on completion must refuse it too.
    monkeypatch.setattr(small_parts, "_key_exists", lambda name, key: False)
    with pytest.raises(ObjectExists) as ei:
        small_parts.put("m/big", b"c" * (6 * MiB), if_absent=True)
    assert ei.value.key == "m/big"
    assert raw.get("m/big") == b"a" * (6 * MiB)
    assert raw.uploads() == []


# -- retries ------------------------------------------------------------------------------------


class _RawBody:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def test_transient_503_is_retried_by_botocore(s3_url: str, raw: BucketRaw) -> None:
    calls = [0]
    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def slow_down_twice(request: Any, **_: Any) -> AWSResponse | None:
        calls[0] += 1
        if calls[0] <= 2:
            return AWSResponse(request.url, 503, {"Content-Type": "application/xml"}, _RawBody(body))
        return None

    with S3Store.from_url(s3_url, max_attempts=3) as s:
        assert isinstance(s, S3Store)
        s.client.meta.events.register("before-send.s3.PutObject", slow_down_twice)
        data = bytes(range(256)) * 40
        s.put("r/obj", data)
        assert calls[0] == 3
        assert s.get("r/obj") == data
    assert raw.get("r/obj") == data


def test_503_after_retries_is_unavailable(s3_url: str, raw: BucketRaw) -> None:
    def always_503(request: Any, **_: Any) -> AWSResponse:
        return AWSResponse(request.url, 503, {}, _RawBody(b""))

    with S3Store.from_url(s3_url, max_attempts=1) as s:
        assert isinstance(s, S3Store)
        s.client.meta.events.register("before-send.s3.PutObject", always_503)
        with pytest.raises(StoreUnavailable):
            s.put("r/obj", b"x")
    assert raw.names() == set()


def test_a_saves_deadline_is_its_retry_budget(s3_url: str) -> None:
    """A bucket that answers 503 to every pack put: botocore (8 attempts) and RetryStore (3) would
    retry for many seconds; under a save's deadline no retry starts after it, and the save returns
    at the deadline, naming it, with nothing visible."""
    import numpy as np

    from ckpt import Block, Namespace, OperationAborted, Pins, Repository, SaveOptions, WorkerFacts
    from ckpt.pins import HostFacts
    from ckpt.store.retry import RetryStore

    store = RetryStore(S3Store.from_url(s3_url, max_attempts=8), attempts=3, base_delay=0.5, max_delay=0.5)
    repo = Repository.init(store, pack_size=64 << 10)
    inner = store.inner
    assert isinstance(inner, S3Store)
    retried_after: list[str] = []
    seen: set[str] = set()
    deadline = [0.0]

    def always_503(request: Any, **_: Any) -> AWSResponse:
        key = request.url.split("?")[0]
        attempt = str(request.headers.get("amz-sdk-request", b""))
        if time.monotonic() > deadline[0] and (key in seen or "attempt=1;" not in attempt):
            retried_after.append(f"{key} {attempt}")
        seen.add(key)
        return AWSResponse(request.url, 503, {}, _RawBody(b""))

    inner.client.meta.events.register("before-send.s3.PutObject", always_503)
    rng = np.random.default_rng(3)
    blocks = [Block(f"k{i}".encode(), rng.bytes(32 << 10), "uint8", (32 << 10,)) for i in range(8)]
    deadline[0] = time.monotonic() + 1.5
    t0 = time.monotonic()
    with pytest.raises((OperationAborted, StoreUnavailable)) as ei:
        repo.save(
            blocks,
            worker_id="w0",
            namespace=Namespace({"m": "x"}),
            pins=Pins(host=HostFacts(), worker=WorkerFacts()),
            options=SaveOptions(pack_size=64 << 10, upload_workers=2),
            deadline=deadline[0],
        )
    inner.client.meta.events.unregister("before-send.s3.PutObject", always_503)
    assert "deadline" in str(ei.value)
    # neither botocore nor RetryStore retried a request past the deadline (first tries of uploads
    # the save had already queued may still go out: the save abandons them)
    assert not retried_after, retried_after
    assert repo.list() == []
    print(f"save with a 1.5 s deadline against a 503-only bucket returned after {time.monotonic() - t0:.2f} s")


# -- debris and checksums --------------------------------------------------------------------------


def test_cleanup_aborts_unfinished_uploads_under_prefix(s3_url: str, raw: BucketRaw, s3_bucket: str) -> None:
    mine = raw.client.create_multipart_upload(Bucket=s3_bucket, Key="repo/packs/debris")
    raw.client.upload_part(
        Bucket=s3_bucket,
        Key="repo/packs/debris",
        UploadId=mine["UploadId"],
        PartNumber=1,
        Body=b"x",
    )
    raw.client.create_multipart_upload(Bucket=s3_bucket, Key="other/debris")
    with S3Store.from_url(s3_url) as s:
        assert s.cleanup(older_than=time.time() - 3600) == 0  # too young
        assert sorted(raw.uploads()) == ["other/debris", "repo/packs/debris"]
        assert s.cleanup(older_than=time.time() + 60) == 1
        assert raw.uploads() == ["other/debris"]  # outside the store's prefix
        assert s.cleanup(older_than=time.time() + 60) == 0


def test_server_rejects_wrong_crc32c(
    s3_url: str, raw: BucketRaw, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ClientError) as ei:
        raw.client.put_object(Bucket=s3_bucket, Key="repo/bad", Body=b"hello", ChecksumCRC32C="AAAAAA==")
    err = _translate(ei.value, "bad", "put")
    assert isinstance(err, IntegrityError)
    assert "bad" in str(err)
    # And end to end: S3Store sending a wrong checksum gets IntegrityError.
    monkeypatch.setattr(s3mod, "_crc32c_b64", lambda view: "AAAAAA==")
    with S3Store.from_url(s3_url) as s:
        with pytest.raises(IntegrityError):
            s.put("bad", b"hello")
        assert not s.exists("bad")
    assert raw.names() == set()


# -- the test server itself ----------------------------------------------------------------


def test_server_restart_on_same_data(tmp_path: Any, seaweed: SeaweedServer) -> None:
    """stop() then start() keeps the data, ports and endpoint; while it is down,
    calls fail as StoreUnavailable (what agent tests rely on)."""
    server = SeaweedServer(tmp_path / "data")
    server.start()
    try:
        server.make_bucket("restart")
        url = f"s3://restart/repo?endpoint={server.endpoint}"
        with S3Store.from_url(url, max_attempts=1) as s:
            s.put("a/b", b"kept")
            endpoint = server.endpoint
            server.stop()
            assert not server.running
            with pytest.raises(StoreUnavailable):
                s.get("a/b")
            server.start()
            assert server.endpoint == endpoint
            assert s.get("a/b") == b"kept"
            assert [i.name for i in s.list("a/")] == ["a/b"]
    finally:
        server.close()
    assert (tmp_path / "data").is_dir()  # a caller-owned data dir is left in place


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("ConditionalRequestConflict", 409, "StoreUnavailable"),
        ("PreconditionFailed", 412, "ObjectExists"),
        ("SlowDown", 503, "StoreUnavailable"),
        ("NoSuchKey", 404, "ObjectNotFound"),
        ("AccessDenied", 403, "AccessDenied"),
        ("QuotaExceeded", 403, "StorageFull"),
        ("BadDigest", 400, "IntegrityError"),
    ],
)
def test_translate_maps_s3_codes(code: str, status: int, expected: str) -> None:
    """The one translation table, without a server: AWS codes SeaweedFS never sends."""
    from botocore.exceptions import ClientError

    exc = ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},  # type: ignore[typeddict-item]
        "PutObject",
    )
    err = _translate(exc, "manifests/w/1", "put", bucket="b")
    assert type(err).__name__ == expected
    assert "manifests/w/1" in str(err)
