"""The gpuckpt error tree.

Every error the library raises on purpose is a :class:`GpuckptError`. Errors
from dependencies (botocore, OSError, cryptography, pydantic) are translated at
the edge that called them (``raise Mapped(...) from exc``) so callers only ever
need to catch this tree::

    GpuckptError
    ├── ConfigError                 bad URL, option or configuration value
    ├── StoreError                  the storage backend
    │   ├── ObjectNotFound          the object does not exist
    │   ├── ObjectExists            a conditional create lost: the name is taken
    │   ├── InvalidName             an object name that is malformed or hostile
    │   ├── AccessDenied            credentials refused, permission missing
    │   ├── StorageFull             no space left (ENOSPC, EDQUOT, quota)
    │   └── StoreUnavailable        network, 5xx, throttling after retries (transient)
    ├── RepositoryError             the repository as a whole
    │   ├── RepositoryNotFound      no repository at this URL
    │   ├── RepositoryExists        init on a URL that already holds one
    │   ├── RepositoryLocked        an exclusive lock (gc) or a conflicting lock
    │   └── CheckpointNotFound      no manifest with this id
    ├── FormatError                 a stored document this reader cannot read
    │   ├── UnsupportedVersion      a format version this reader does not know
    │   └── ManifestError           malformed, oversized or schema-invalid manifest
    ├── IntegrityError              stored bytes do not match their checksum,
    │                               fail authentication, or are truncated/missing
    ├── EncryptionError             keys
    │   ├── KeyMissing              the repository is encrypted, no key given
    │   └── KeyMismatch             the key given is not the repository's key
    ├── IncompatibleCheckpoint      the compatibility rules refuse a warm restore
    ├── BlocksMissing               blocks given as already stored are not in the repository
    ├── OperationAborted            a deadline passed, a caller cancelled, or a commit's last
    │                               look on the store found its lock or packs gone
    ├── ServiceUnavailable          the agent or a worker does not answer (socket, API)
    │   ├── WorkerUnreachable       (also an EngineError, and a ConnectionError) nothing
    │   │                           answers on the worker adapter's socket
    │   └── EngineRefused           (also an EngineError) the worker answered, refusing
    │       ├── agent.engines.control.ControlError   an ``ok: false`` control reply,
    │       │                                        a broken or oversized channel
    │       └── agent.engines.serving.ServeError     the worker's HTTP API refused
    └── EngineError                 the serving engine behind the worker adapter
        ├── WorkerUnreachable, EngineRefused   (above)
        ├── EngineMismatch          (also a ConfigError) the worker runs another engine
        ├── agent.engines.shards.ShardError    TP shards that do not cover the KV heads
        └── agent.engines.staging.PageFileError  (also a ValueError) a worker's page file
                                    that cannot be read as its index declares

    Defined in the agent beside what raises them, all in this tree:
    agent.fs.UnsafePath (a ConfigError: a path another account could control),
    agent.daemon.client.AgentApiError (the agent answered an error status),
    agent.engines.vllm.connector.InjectedFault (a test's injected hook failure).

Exit codes for the CLI are assigned in exactly one place, :mod:`cli.exitcodes`.
Messages name the object and the cause; they never contain secrets.
"""

from __future__ import annotations


class GpuckptError(Exception):
    """Base of every error gpuckpt raises on purpose."""


class ConfigError(GpuckptError):
    """A URL, option or configuration value is invalid."""


class StoreError(GpuckptError):
    """A storage backend operation failed.

    ``key`` names the object involved, when there is one.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectNotFound(StoreError):
    """The object does not exist."""


class ObjectExists(StoreError):
    """A conditional create found the name already taken."""


class InvalidName(StoreError):
    """An object name is malformed or would escape the store (path traversal)."""


class AccessDenied(StoreError):
    """The store refused the credentials or the operation."""


class StorageFull(StoreError):
    """The store has no space left."""


class StoreUnavailable(StoreError):
    """A transient failure: network, server error, throttling. Retrying may help."""


class RepositoryError(GpuckptError):
    """The repository as a whole is not in a usable state for this operation."""


class RepositoryNotFound(RepositoryError):
    """No repository exists at the URL."""


class RepositoryExists(RepositoryError):
    """A repository already exists at the URL."""


class RepositoryLocked(RepositoryError):
    """Another process holds a conflicting lock."""


class CheckpointNotFound(RepositoryError):
    """No checkpoint with this id exists in the repository."""


class FormatError(GpuckptError):
    """A stored document cannot be read by this version of gpuckpt."""


class UnsupportedVersion(FormatError):
    """A document's format version is unknown to this reader.

    Readers refuse versions they do not know rather than guess.
    """

    def __init__(self, what: str, version: object, supported: tuple[int, ...]) -> None:
        super().__init__(
            f"{what}: format version {version!r} is not supported by this gpuckpt "
            f"(supported: {', '.join(str(v) for v in supported)})"
        )
        self.what = what
        self.version = version
        self.supported = supported


class ManifestError(FormatError):
    """A manifest is malformed, oversized or does not match its schema."""


class IntegrityError(GpuckptError):
    """Stored bytes are corrupt: checksum mismatch, failed authentication, truncation.

    ``obj`` names the stored object (pack, manifest, index) and ``blob`` the
    blob inside it, when known.
    """

    def __init__(self, message: str, *, obj: str | None = None, blob: str | None = None) -> None:
        super().__init__(message)
        self.obj = obj
        self.blob = blob


class EncryptionError(GpuckptError):
    """A key problem."""


class KeyMissing(EncryptionError):
    """The repository is encrypted and no key was supplied."""


class KeyMismatch(EncryptionError):
    """The key supplied is not the key the repository was created with."""


class IncompatibleCheckpoint(GpuckptError):
    """The compatibility rules refuse a warm restore.

    ``reasons`` holds one line per refusing rule, naming the rule and both values.
    """

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message + ("\n  " + "\n  ".join(reasons) if reasons else ""))
        self.reasons = reasons


class BlocksMissing(GpuckptError):
    """A save was told the repository already holds some blocks (:class:`ckpt.Existing`) and it
    does not (gc removed them, or another repository): nothing was made visible. ``keys`` lists
    them; the caller copies them and saves again."""

    def __init__(self, message: str, keys: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.keys = list(keys or [])


class OperationAborted(GpuckptError):
    """An operation was cancelled or ran past its deadline; nothing was made visible."""


class ServiceUnavailable(GpuckptError):
    """The agent's control API or a worker (its connector socket or its API) does not answer."""


class EngineError(GpuckptError):
    """A serving engine's worker failed, refused or is not what it should be."""


class WorkerUnreachable(EngineError, ServiceUnavailable, ConnectionError):
    """The worker's control socket or request API does not answer (not started, crashed, hung)."""


class EngineRefused(EngineError, ServiceUnavailable):
    """The worker's adapter answered with an error (no step boundary in time, a capture it cannot take)."""


class EngineMismatch(EngineError, ConfigError):
    """The worker runs another engine (or version) than the agent was configured for."""
