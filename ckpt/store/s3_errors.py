"""The one place botocore's exceptions become :mod:`ckpt.errors` (the S3 store's half of
"dependency errors translated at exactly one boundary").

:func:`translate` maps what boto3 or botocore raised for one operation on one
object to the error tree; :class:`~ckpt.store.s3.S3Store` calls it for every
exception in :data:`TRANSLATED` and raises the result ``from`` the original.
Messages name the object, the bucket and the cause, never credentials.
"""

from __future__ import annotations

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    FlexibleChecksumError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from ckpt.errors import (
    AccessDenied,
    GpuckptError,
    IntegrityError,
    ObjectExists,
    ObjectNotFound,
    StorageFull,
    StoreError,
    StoreUnavailable,
)

NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchVersion"})
EXISTS_CODES = frozenset({"PreconditionFailed", "412"})
ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "403",
    }
)
INTEGRITY_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"})
FULL_CODES = frozenset({"EntityTooLarge", "QuotaExceeded", "InsufficientStorage", "507"})
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "OperationAborted",
        "PriorRequestNotComplete",
    }
)


def translate(exc: BaseException, name: str, op: str, *, bucket: str | None = None) -> GpuckptError:
    """Map a boto3/botocore exception raised by ``op`` on object ``name`` to the
    :mod:`ckpt.errors` tree. Messages name the object, bucket and cause, never
    credentials. The caller raises the result ``from exc``."""
    where = f"{name!r}" + (f" in bucket {bucket!r}" if bucket else "")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code", "") or "")
        message = str(err.get("Message", "") or "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        status = int(status) if status else 0
        named = err.get("BucketName")
        bucket = bucket or (str(named) if named else None)
        where = f"{name!r}" + (f" in bucket {bucket!r}" if bucket else "")
        cause = f"{code or status}: {message}".rstrip(": ")
        if status:
            cause += f" (HTTP {status})"

        if code == "NoSuchBucket":
            return ObjectNotFound(f"s3 {op} {name!r}: bucket {bucket!r} does not exist ({cause})", key=name)
        if code == "NoSuchUpload":
            # The multipart upload vanished under us: aborted by a concurrent
            # cleanup, or completed by an earlier attempt whose answer was
            # lost. Retrying the whole put is the remedy.
            return StoreUnavailable(f"s3 {op} {where}: the multipart upload is gone ({cause})", key=name)
        if code in NOT_FOUND_CODES or status == 404:
            return ObjectNotFound(f"not found: {where} ({cause})", key=name)
        if code in ("InvalidRange",) or status == 416:
            return IntegrityError(
                f"object {name!r} is truncated: the range asked for runs past its end ({cause})",
                obj=name,
            )
        if code == "ConditionalRequestConflict":
            # 409: another conditional write to the name is in flight. AWS says
            # retry; the retry then wins or gets 412 (ObjectExists).
            return StoreUnavailable(f"s3 {op} {where}: conflicting conditional write in flight ({cause})", key=name)
        if code in EXISTS_CODES or status == 412:
            if op == "get":
                return StoreUnavailable(
                    f"s3 {op} {where}: the object changed while it was being read ({cause})",
                    key=name,
                )
            return ObjectExists(f"object exists: {where} ({cause})", key=name)
        # Specific codes before bare statuses: a quota error comes as a 403.
        if code in INTEGRITY_CODES:
            return IntegrityError(f"s3 {op} {where}: the server rejected the bytes' checksum ({cause})", obj=name)
        if code in FULL_CODES or status == 507:
            return StorageFull(f"storage full: s3 {op} {where} ({cause})", key=name)
        if code in ACCESS_CODES or status == 403:
            return AccessDenied(f"access denied: s3 {op} {where} ({cause})", key=name)
        if code in TRANSIENT_CODES or status >= 500 or status == 429:
            return StoreUnavailable(f"s3 {op} {where}: server unavailable ({cause})", key=name)
        return StoreError(f"s3 {op} {where}: {cause}", key=name)

    if isinstance(exc, FlexibleChecksumError):
        return IntegrityError(f"s3 {op} {where}: checksum mismatch: {exc}", obj=name)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return AccessDenied(
            f"s3 {op} {where}: no usable credentials in the boto3 chain "
            f"(environment, profile, instance role): {type(exc).__name__}",
            key=name,
        )
    if isinstance(exc, BotoConnectionError | HTTPClientError | IncompleteReadError):
        # EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError,
        # ReadTimeoutError, ResponseStreamingError ...
        return StoreUnavailable(f"s3 {op} {where}: connection failed: {type(exc).__name__}: {exc}", key=name)
    if isinstance(exc, ConnectionError | TimeoutError):
        return StoreUnavailable(f"s3 {op} {where}: connection failed: {type(exc).__name__}: {exc}", key=name)
    if isinstance(exc, BotoCoreError):
        return StoreError(f"s3 {op} {where}: {type(exc).__name__}: {exc}", key=name)
    return StoreError(f"s3 {op} {where}: {type(exc).__name__}: {exc}", key=name)


TRANSLATED = (BotoCoreError, ClientError, ConnectionError, TimeoutError)
