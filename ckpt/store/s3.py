"""A store in an S3 bucket (AWS S3 or any S3-compatible server), over boto3.

Object names map to keys ``prefix + "/" + name`` in one bucket. What the
store contract needs maps onto S3 like this:

* **Atomic puts.** A ``put_object`` or a completed multipart upload becomes
  visible whole or not at all. Large objects (``>= multipart_threshold``) go
  up as a multipart upload whose parts are sent in parallel on a thread pool
  the store owns; any failure aborts the upload (best effort) and an upload
  left by a killed process is invisible debris that :meth:`S3Store.cleanup`
  aborts.
* **Conditional create** is ``If-None-Match: *`` on ``put_object`` and on
  ``complete_multipart_upload``; the server answers 412 to the losers.
* **Checksums.** With ``checksum=True`` every put and every part carries a
  CRC32C the server verifies (``x-amz-checksum-crc32c``); a mismatch is an
  :class:`~ckpt.errors.IntegrityError`.
* **Retries.** botocore's ``standard`` retry mode backs off on throttling,
  5xx and dropped connections; what still fails after ``max_attempts``
  surfaces as :class:`~ckpt.errors.StoreUnavailable`.

Credentials come only from the standard boto3 chain (environment, shared
profile, instance or container role); never from the URL. Every botocore
exception is translated into the :mod:`ckpt.errors` tree in exactly one
place, :func:`ckpt.store.s3_errors.translate`.

For fault-injection tests the boto3 client is public as :attr:`S3Store.client`;
register botocore event handlers on ``client.meta.events`` (for example
``before-send.s3.UploadPart``) to drop connections or answer 503.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import io
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import boto3
import botocore.session
from awscrt import checksums as crt_checksums
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ProfileNotFound,
)

from ckpt.errors import (
    ConfigError,
    GpuckptError,
    IntegrityError,
    InvalidName,
    ObjectExists,
    ObjectNotFound,
    StoreUnavailable,
)
from ckpt.store.base import Buffer, Capabilities, ObjectInfo, Store, check_name, check_prefix, retry_budget_left
from ckpt.store.s3_errors import EXISTS_CODES, NOT_FOUND_CODES, TRANSLATED, translate

log = logging.getLogger("gpuckpt.store")

T = TypeVar("T")

MiB = 1 << 20
#: S3's smallest part (all but the last) and most parts in one upload.
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 1024 * MiB
MAX_PARTS = 10_000

ENDPOINT_ENV_VARS = ("GPUCKPT_S3_ENDPOINT", "AWS_ENDPOINT_URL")
_URL_OPTIONS = ("endpoint", "region", "profile")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


def _no_retry_past_deadline(
    attempts: int = 1, response: Any = None, caught_exception: BaseException | None = None, **_: Any
) -> None:
    """A ``needs-retry`` handler: after a failed attempt, when the current operation's deadline has
    passed, raise instead of letting botocore retry (its retries and 60 s reads would otherwise run
    on long after a save gave up)."""
    failed = caught_exception is not None
    if response is not None and not failed:
        status = getattr(response[0], "status_code", 200)
        failed = status >= 500 or status == 429
    # botocore's standard mode then sleeps up to 2^(attempts-1) s (at most 20 s) before the retry
    if failed and not retry_budget_left(min(20.0, 2.0 ** (attempts - 1))):
        why = caught_exception if caught_exception is not None else f"HTTP {response[0].status_code}"
        raise StoreUnavailable(
            f"s3 request failed ({why}) after {attempts} attempt(s); "
            "not retried: the deadline passes before a retry could"
        )


# -- a zero-copy request body ---------------------------------------------------


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview, so botocore streams (and re-sends on
    retry) a slice of the caller's buffer without copying all of it."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = len(self._view) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError("negative seek position")
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        start = min(self._pos, len(self._view))
        end = len(self._view) if size is None or size < 0 else min(start + size, len(self._view))
        self._pos = end
        return bytes(self._view[start:end])

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        start = min(self._pos, len(self._view))
        n = min(len(out), len(self._view) - start)
        out[:n] = self._view[start : start + n]
        self._pos = start + n
        return n


def _crc32c_b64(view: memoryview) -> str:
    return base64.b64encode(crt_checksums.crc32c(view).to_bytes(4, "big")).decode("ascii")


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


def _new_session(profile: str | None) -> boto3.session.Session:
    """A fresh boto3 session (so credentials are resolved anew) that shares
    botocore's parsed service models with earlier ones: a client then takes
    ~30 ms to make instead of ~150 ms."""
    core = botocore.session.Session()
    with _shared_lock:
        loader = _shared.get("data_loader")
        if loader is None:
            _shared["data_loader"] = core.get_component("data_loader")
        else:
            core.register_component("data_loader", loader)
    return boto3.session.Session(botocore_session=core, profile_name=profile)


def _check_endpoint(endpoint: str) -> str:
    try:
        parts = urlsplit(endpoint)
        if "@" in parts.netloc:
            # Checked first, and the endpoint never echoed: it holds a secret.
            raise ConfigError(
                "credentials in the S3 endpoint URL are refused: use the environment, a profile or an instance role"
            )
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"invalid S3 endpoint {endpoint!r}: expected http(s)://host[:port]")
    return endpoint.rstrip("/")


# -- the store -------------------------------------------------------------------


class S3Store(Store):
    """Objects in ``bucket`` under ``prefix``. Safe to call from many threads.

    ``endpoint_url`` selects an S3-compatible server (path-style addressing);
    without it ``GPUCKPT_S3_ENDPOINT`` or ``AWS_ENDPOINT_URL`` is used, else AWS.
    Objects of ``multipart_threshold`` bytes or more go up in ``part_size``
    parts (grown when more than 10 000 would be needed), ``max_workers`` at a
    time; reads of at least two parts' length are split the same way.
    ``checksum`` sends a CRC32C the server verifies with every put and part.
    ``max_attempts`` is the total number of tries botocore makes per request
    (first included) before the error surfaces. ``client`` injects a ready
    boto3 S3 client (the store then leaves closing it to the caller).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        part_size: int = 16 * MiB,
        multipart_threshold: int = 16 * MiB,
        max_workers: int = 8,
        checksum: bool = True,
        max_attempts: int = 8,
        client: Any = None,
    ) -> None:
        if not isinstance(bucket, str) or not _BUCKET.match(bucket):
            raise ConfigError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            try:
                check_name(prefix)
            except InvalidName as exc:
                raise ConfigError(f"invalid S3 key prefix {prefix!r}: {exc}") from None
        if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ConfigError(f"part_size {part_size} is outside S3's limits [{MIN_PART_SIZE}, {MAX_PART_SIZE}]")
        if multipart_threshold < 1:
            raise ConfigError(f"multipart_threshold must be positive, not {multipart_threshold}")
        if max_workers < 1:
            raise ConfigError(f"max_workers must be positive, not {max_workers}")
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be positive, not {max_attempts}")
        if endpoint_url is None:
            endpoint_url = next((os.environ[v] for v in ENDPOINT_ENV_VARS if os.environ.get(v)), None)
        if endpoint_url is not None:
            endpoint_url = _check_endpoint(endpoint_url)

        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.region = region
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.max_workers = max_workers
        self.checksum = checksum
        self.capabilities = Capabilities(
            conditional_create=True,
            ranged_read=True,
            server_checksums=checksum,
            parallel_upload=True,
        )
        self._owns_client = client is None
        if client is None:
            config = Config(
                signature_version="s3v4",
                # total attempts, the first included (botocore's "max_attempts"
                # would count retries only)
                retries={"mode": "standard", "total_max_attempts": max_attempts},
                connect_timeout=10,
                read_timeout=60,
                max_pool_connections=2 * max_workers + 16,
                tcp_keepalive=True,
                s3={"addressing_style": "path"} if endpoint_url else None,
                request_checksum_calculation="when_supported" if checksum else "when_required",
                response_checksum_validation="when_supported" if checksum else "when_required",
            )
            try:
                client = _new_session(profile).client(
                    "s3", endpoint_url=endpoint_url, region_name=region, config=config
                )
            except ProfileNotFound as exc:
                raise ConfigError(f"AWS profile {profile!r} not found") from exc
            except BotoCoreError as exc:  # a malformed config file, an unknown region
                raise ConfigError(f"cannot configure the S3 client: {exc}") from exc
        #: the boto3 S3 client: register botocore event handlers here to inject faults
        self.client: Any = client
        # botocore's own retries stop at the operation's deadline (ckpt.store.base.deadline_scope)
        client.meta.events.register_first("needs-retry.s3", _no_retry_past_deadline)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gpuckpt-s3")
        self._closed = False
        self._close_lock = threading.Lock()

    # -- construction from a URL -----------------------------------------------

    @classmethod
    def from_url(cls, url: str, **opts: Any) -> S3Store:
        """``s3://bucket/prefix?endpoint=http://host:port&region=us-east-1``.

        ``endpoint`` may also come from ``GPUCKPT_S3_ENDPOINT`` or
        ``AWS_ENDPOINT_URL``. Credentials in the URL are refused.
        """
        if not isinstance(url, str):
            raise ConfigError("S3 URL must be a string")
        try:
            parts = urlsplit(url)
        except ValueError as exc:
            raise ConfigError(f"malformed S3 URL: {exc}") from None
        if parts.scheme != "s3":
            raise ConfigError(f"not an S3 URL (scheme {parts.scheme!r}): expected s3://bucket/prefix")
        if "@" in parts.netloc:
            # Never echo the URL: it holds a secret.
            raise ConfigError(
                "credentials in an s3:// URL are refused: use the environment "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), a profile or an instance role"
            )
        if parts.fragment:
            raise ConfigError("an s3:// URL takes no #fragment")
        bucket = parts.netloc
        if not bucket:
            raise ConfigError("S3 URL names no bucket: expected s3://bucket/prefix")
        try:
            query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
        except ValueError:
            raise ConfigError("malformed query in S3 URL") from None
        kwargs: dict[str, Any] = {}
        for key, values in query.items():
            if key not in _URL_OPTIONS:
                raise ConfigError(f"unknown S3 URL option {key!r} (known: {', '.join(_URL_OPTIONS)})")
            if len(values) != 1 or not values[0]:
                raise ConfigError(f"S3 URL option {key!r} needs exactly one non-empty value")
            kwargs["endpoint_url" if key == "endpoint" else key] = values[0]
        kwargs.update(opts)
        return cls(bucket, parts.path.strip("/"), **kwargs)

    @property
    def url(self) -> str:
        out = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        query = []
        if self.endpoint_url:
            query.append(f"endpoint={self.endpoint_url}")
        if self.region:
            query.append(f"region={self.region}")
        return out + ("?" + "&".join(query) if query else "")

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # -- helpers -------------------------------------------------------------------

    def _key(self, name: str) -> str:
        check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, name: str, op: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except TRANSLATED as exc:
            raise translate(exc, name, op, bucket=self.bucket) from exc

    # -- put -------------------------------------------------------------------------

    def put(self, name: str, data: Buffer, *, if_absent: bool = False) -> None:
        key = self._key(name)
        view = memoryview(data).cast("B")
        if len(view) >= self.multipart_threshold:
            self._put_multipart(name, key, view, if_absent)
        else:
            self._put_single(name, key, view, if_absent)

    def _put_single(self, name: str, key: str, view: memoryview, if_absent: bool) -> None:
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "Body": _ViewReader(view) if len(view) else b"",
        }
        if self.checksum:
            kwargs["ChecksumAlgorithm"] = "CRC32C"
            kwargs["ChecksumCRC32C"] = _crc32c_b64(view)
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        try:
            self.client.put_object(**kwargs)
        except ClientError as exc:
            if if_absent and self._lost_answer_landed(exc, name, view):
                return
            raise translate(exc, name, "put", bucket=self.bucket) from exc
        except TRANSLATED as exc:
            raise translate(exc, name, "put", bucket=self.bucket) from exc

    def _lost_answer_landed(self, exc: ClientError, name: str, view: memoryview) -> bool:
        """A conditional create that botocore retried and that then found the
        name taken may have been taken by its own earlier attempt (the write
        landed, its answer was lost). True when the stored bytes are ours."""
        meta = exc.response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code")
        if not meta.get("RetryAttempts") or not (status == 412 or code in EXISTS_CODES):
            return False
        try:
            return self.get(name) == view
        except GpuckptError:
            return False

    def _part_plan(self, size: int) -> list[tuple[int, int]]:
        part = max(self.part_size, -(-size // MAX_PARTS))
        return [(off, min(part, size - off)) for off in range(0, size, part)]

    def _put_multipart(self, name: str, key: str, view: memoryview, if_absent: bool) -> None:
        if if_absent and self._key_exists(name, key):
            # Cheap early answer; the real check is If-None-Match on completion.
            raise ObjectExists(f"object exists: {name!r} in bucket {self.bucket!r}", key=name)
        create: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if self.checksum:
            create["ChecksumAlgorithm"] = "CRC32C"
        upload_id: str = self._call(name, "put", lambda: self.client.create_multipart_upload(**create)["UploadId"])
        try:
            futures: list[Future[dict[str, Any]]] = [
                self._pool.submit(
                    contextvars.copy_context().run, self._upload_part, key, upload_id, n, view[off : off + length]
                )
                for n, (off, length) in enumerate(self._part_plan(len(view)), start=1)
            ]
            try:
                parts = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                # Let parts in flight finish so the abort below leaves nothing.
                wait(futures)
                raise
            complete: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": key,
                "UploadId": upload_id,
                "MultipartUpload": {"Parts": parts},
            }
            if if_absent:
                complete["IfNoneMatch"] = "*"
            try:
                self.client.complete_multipart_upload(**complete)
            except ClientError as exc:
                if if_absent and self._lost_answer_landed(exc, name, view):
                    return
                raise
        except TRANSLATED as exc:
            self._abort(name, key, upload_id)
            raise translate(exc, name, "put", bucket=self.bucket) from exc
        except BaseException:
            self._abort(name, key, upload_id)
            raise

    def _upload_part(self, key: str, upload_id: str, number: int, chunk: memoryview) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": key,
            "UploadId": upload_id,
            "PartNumber": number,
            "Body": _ViewReader(chunk),
        }
        part: dict[str, Any] = {"PartNumber": number}
        if self.checksum:
            crc = _crc32c_b64(chunk)
            kwargs["ChecksumAlgorithm"] = "CRC32C"
            kwargs["ChecksumCRC32C"] = crc
            part["ChecksumCRC32C"] = crc
        resp = self.client.upload_part(**kwargs)
        part["ETag"] = resp["ETag"]
        return part

    def _abort(self, name: str, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # best effort: cleanup() catches what is left
            log.warning(
                "could not abort multipart upload",
                extra={"object": name, "bucket": self.bucket, "error": type(exc).__name__},
            )

    def _key_exists(self, name: str, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
        except TRANSLATED as exc:
            err = translate(exc, name, "stat", bucket=self.bucket)
            if isinstance(err, ObjectNotFound):
                return False
            raise err from exc
        return True

    # -- get ---------------------------------------------------------------------------

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        key = self._key(name)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError("offset and length must be non-negative")
        if length == 0:
            return b""
        if length is not None and length >= max(self.multipart_threshold, 2 * self.part_size):
            return self._get_parallel(name, key, offset, length)
        return self._get_range(name, key, offset, length)

    def _get_range(
        self,
        name: str,
        key: str,
        offset: int,
        length: int | None,
        if_match: str | None = None,
    ) -> bytes:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        ranged = offset > 0 or length is not None
        if ranged:
            end = "" if length is None else str(offset + length - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        if if_match is not None:
            kwargs["IfMatch"] = if_match

        def fetch() -> tuple[bytes, bool]:
            try:
                resp = self.client.get_object(**kwargs)
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if length is None and status == 416:
                    # offset at or past the end, no length: like a file read there
                    return b"", True
                raise
            body = resp["Body"]
            try:
                return body.read(), "ContentRange" in resp
            finally:
                body.close()

        data, partial = self._call(name, "get", fetch)
        if ranged and not partial:
            # The server ignored Range and sent the whole object.
            data = data[offset:] if length is None else data[offset : offset + length]
        if length is not None and len(data) != length:
            raise IntegrityError(
                f"object {name!r} is truncated: asked for {length} bytes at offset {offset}, got {len(data)}",
                obj=name,
            )
        return data

    def _get_parallel(self, name: str, key: str, offset: int, length: int) -> bytes:
        head = self._call(name, "get", lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        size = int(head["ContentLength"])
        if offset + length > size:
            raise IntegrityError(
                f"object {name!r} is truncated: asked for {length} bytes at offset {offset}, but it holds {size}",
                obj=name,
            )
        etag = head.get("ETag")
        step = self.part_size
        futures = [
            self._pool.submit(
                contextvars.copy_context().run,
                self._get_range,
                name,
                key,
                off,
                min(step, offset + length - off),
                etag,
            )
            for off in range(offset, offset + length, step)
        ]
        try:
            chunks = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return b"".join(chunks)

    # -- stat, list, delete ------------------------------------------------------------

    def stat(self, name: str) -> ObjectInfo:
        key = self._key(name)
        head = self._call(name, "stat", lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        return ObjectInfo(name=name, size=int(head["ContentLength"]), mtime=head["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root + prefix)
        it = iter(pages)
        while True:
            page = self._call(prefix, "list", lambda: next(it, None))
            if page is None:
                return
            for obj in page.get("Contents", []) or []:
                rel = obj["Key"][len(root) :]
                try:
                    check_name(rel)
                except InvalidName:
                    log.debug("skipping key that is not a valid object name: %r", obj["Key"])
                    continue
                yield ObjectInfo(name=rel, size=int(obj["Size"]), mtime=obj["LastModified"].timestamp())

    def delete(self, name: str) -> None:
        key = self._key(name)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            # S3 answers 204 for a missing key; some compatible servers 404.
            if exc.response.get("Error", {}).get("Code") in NOT_FOUND_CODES:
                return
            raise translate(exc, name, "delete", bucket=self.bucket) from exc
        except TRANSLATED as exc:
            raise translate(exc, name, "delete", bucket=self.bucket) from exc

    # -- maintenance -------------------------------------------------------------------

    def cleanup(self, older_than: float) -> int:
        """Abort unfinished multipart uploads under the prefix initiated before
        ``older_than`` (epoch seconds); return how many were aborted."""
        root = f"{self.prefix}/" if self.prefix else ""
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=root)
        it = iter(pages)
        aborted = 0
        while True:
            page = self._call(root or "/", "cleanup", lambda: next(it, None))
            if page is None:
                return aborted
            for up in page.get("Uploads", []) or []:
                if up["Initiated"].timestamp() >= older_than:
                    continue
                key, upload_id = up["Key"], up["UploadId"]
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                except ClientError as exc:
                    if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                        continue  # someone else finished or aborted it
                    raise translate(exc, key, "cleanup", bucket=self.bucket) from exc
                except TRANSLATED as exc:
                    raise translate(exc, key, "cleanup", bucket=self.bucket) from exc
                aborted += 1

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_client:
            with contextlib.suppress(Exception):  # closing sockets: nothing to report
                self.client.close()
