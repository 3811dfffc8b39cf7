"""gpuckpt's checkpoint library: the repository format, stores, codecs, pins.

Knows nothing of vLLM or of daemons. The public surface is what ``__all__``
lists; everything else may change without notice.
"""

from ckpt.blocks import Block, Existing, LoadedBlock, Namespace
from ckpt.compat import Decision, Policy, RuleResult, Verdict, check, decide
from ckpt.errors import (
    AccessDenied,
    BlocksMissing,
    CheckpointNotFound,
    ConfigError,
    EncryptionError,
    EngineError,
    EngineMismatch,
    EngineRefused,
    FormatError,
    GpuckptError,
    IncompatibleCheckpoint,
    IntegrityError,
    InvalidName,
    KeyMismatch,
    KeyMissing,
    ManifestError,
    ObjectExists,
    ObjectNotFound,
    OperationAborted,
    RepositoryError,
    RepositoryExists,
    RepositoryLocked,
    RepositoryNotFound,
    ServiceUnavailable,
    StorageFull,
    StoreError,
    StoreUnavailable,
    UnsupportedVersion,
    WorkerUnreachable,
)
from ckpt.fingerprint import host_facts, model_digest, tokenizer_digest
from ckpt.gc import GcReport
from ckpt.keys import Keyring, KeySource, generate_key
from ckpt.load import BlockFailure
from ckpt.manifest import CheckpointInfo, Ledger, Manifest
from ckpt.pins import ABSENT, HostFacts, Pins, WorkerFacts
from ckpt.repository import Repository
from ckpt.save import SaveOptions, SaveProgress
from ckpt.store import LocalStore, MemoryStore, Store
from ckpt.url import default_repo_url, open_store
from ckpt.verify import Problem, VerifyReport

__version__ = "0.1.0"

__all__ = [
    "ABSENT",
    "AccessDenied",
    "Block",
    "BlocksMissing",
    "Existing",
    "BlockFailure",
    "CheckpointInfo",
    "CheckpointNotFound",
    "ConfigError",
    "Decision",
    "EncryptionError",
    "FormatError",
    "GcReport",
    "GpuckptError",
    "HostFacts",
    "IncompatibleCheckpoint",
    "IntegrityError",
    "InvalidName",
    "KeyMismatch",
    "KeyMissing",
    "KeySource",
    "Keyring",
    "Ledger",
    "LoadedBlock",
    "LocalStore",
    "Manifest",
    "ManifestError",
    "MemoryStore",
    "Namespace",
    "ObjectExists",
    "ObjectNotFound",
    "OperationAborted",
    "ServiceUnavailable",
    "EngineError",
    "EngineMismatch",
    "EngineRefused",
    "WorkerUnreachable",
    "Pins",
    "Policy",
    "Problem",
    "Repository",
    "RepositoryError",
    "RepositoryExists",
    "RepositoryLocked",
    "RepositoryNotFound",
    "RuleResult",
    "SaveOptions",
    "SaveProgress",
    "StorageFull",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "UnsupportedVersion",
    "Verdict",
    "VerifyReport",
    "WorkerFacts",
    "__version__",
    "check",
    "decide",
    "default_repo_url",
    "generate_key",
    "host_facts",
    "model_digest",
    "open_store",
    "tokenizer_digest",
]
