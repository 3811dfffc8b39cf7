"""The agent's configuration: a TOML file, overridden by ``GPUCKPT_AGENT__*`` variables.

Validated by pydantic at start; an invalid configuration is refused with the
field and the reason (:func:`load`). Secrets never live here: the repository
credentials come from the standard AWS chain (environment, shared files,
instance roles) and the encryption key from a key *source*
(``file:/path`` or ``env:NAME``), never the key itself.

Example (``systemd/agent.example.toml`` is the annotated version)::

    worker_id = "gpu0"
    repository = "s3://ckpt-bucket/fleet-a?region=us-east-1"
    key = "file:/etc/gpuckpt/key"
    connector_socket = "/run/gpuckpt/gpu0-connector.sock"
    worker_url = "http://127.0.0.1:8000"

    [api]
    socket = "/run/gpuckpt/gpu0.sock"
    mode = "0660"

    [checkpoint]
    interval = "10m"
    deadline = "5m"
    on_stop = true
    stop_deadline = "60s"
    preemption_file = "/run/preempt-notice"

    [restore]
    on_start = true
    # adopt = "claim"     # with pool = "<deployment>" and trust_domain = "<deployment>"

    [retention]
    keep_last = 3
    keep_within = "1d"
    gc_interval = "6h"
"""

from __future__ import annotations

import os
import re
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from agent.engines import registry
from ckpt.errors import ConfigError

ENV_PREFIX = "GPUCKPT_AGENT__"
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(value: Any) -> timedelta:
    """``30s``, ``10m``, ``1h30m``, ``7d``, a number of seconds, or ``0``."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return timedelta(seconds=value)
    text = str(value).strip().lower()
    if text == "0":
        return timedelta(0)
    if not re.fullmatch(r"(\d+[smhdw])+", text):
        raise ValueError(f"invalid duration {value!r}: use e.g. 30s, 10m, 1h, 7d, 1h30m")
    total = timedelta(0)
    for number, unit in re.findall(r"(\d+)([smhdw])", text):
        total += timedelta(**{_UNITS[unit]: int(number)})
    return total


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def _mode(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        m = value
    else:
        text = str(value).strip()
        if not re.fullmatch(r"0?[0-7]{3}", text):
            raise ValueError(f"invalid file mode {value!r}: use octal like 0660")
        m = int(text, 8)
    if m & 0o007:
        raise ValueError(f"mode {m:04o} gives others access to the control socket; use at most 0770")
    return m


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiConfig(_Section):
    socket: Path = Field(description="the agent's control API (HTTP over a Unix socket)")
    mode: Annotated[int, BeforeValidator(_mode)] = 0o660
    group: str | None = Field(None, description="group owning the socket (default: the agent's)")


class CheckpointConfig(_Section):
    interval: Duration | None = Field(None, description="periodic checkpoints; none when unset")
    deadline: Duration = timedelta(minutes=5)
    on_stop: bool = True
    stop_deadline: Duration = timedelta(seconds=60)
    preemption_file: Path | None = None
    preemption_url: str | None = None
    preemption: Literal["gce", "aws", "azure", "url", "file"] | None = Field(
        None,
        description="whose preemption notices to poll, in that provider's own protocol (agent/daemon/"
        "preemption.py): gce, aws (IMDSv2, and the rebalance recommendation as an early checkpoint), azure "
        "(Scheduled Events, acknowledged once the checkpoint is done); url and file as preemption_url and "
        "preemption_file say; unset: whichever of those two is set",
    )
    preemption_metadata_url: str | None = Field(
        None, description="the provider's metadata service (default: its documented address)"
    )
    preemption_poll: Duration | None = Field(
        None, description="how often to poll (default: what the provider recommends: gce and azure 1s, aws 5s)"
    )
    canary: bool = True
    capture_timeout: Duration = timedelta(seconds=60)
    max_staging: ByteSize = Field(
        ByteSize(256 << 20),
        description="host memory a capture's pages may take at once (staged page files and pages queued "
        "in the save); the cached full blocks stream in chunks within it",
    )
    precopy_interval: Duration | None = Field(
        None,
        description="store the worker's new cached blocks this often between checkpoints (a pre-copy), so "
        "that a checkpoint — a preemption's above all — copies only what changed since; none when unset",
    )
    copy_per_step: ByteSize = Field(
        ByteSize(16 << 20),
        description="bytes of cached blocks the worker copies per engine step after the consistent point",
    )

    @field_validator("interval", "precopy_interval")
    @classmethod
    def _positive(cls, v: timedelta | None) -> timedelta | None:
        if v is not None and v.total_seconds() <= 0:
            raise ValueError("must be positive (leave it unset for no periodic checkpoints)")
        return v


class RestoreConfig(_Section):
    on_start: bool = True
    checkpoint: str = Field("latest", description="'latest' (this worker's newest) or a checkpoint id")
    ignore_rules: list[str] = Field(default_factory=list, description="compatibility rules not to enforce")
    wait_for_worker: Duration = timedelta(minutes=10)
    require_canary: bool = Field(
        True,
        description="warm only after the canary probe matched on the worker's API (worker_url); false accepts "
        "an unchecked warm restore",
    )
    offer_ttl: Duration = Field(
        timedelta(minutes=10),
        description="how long the restored blocks stay offered to the worker (then their staging is deleted)",
    )
    max_staging: ByteSize | None = Field(
        None,
        description="host memory the restored pages may take while offered; blocks past it are not offered "
        "(default: half the staging filesystem's free space)",
    )
    adopt: Literal["none", "claim"] = Field(
        "none",
        description="'claim': with no checkpoint of its own to restore, adopt the newest orphaned final "
        "checkpoint (stop, drain, preemption) of this worker's pool, claimed in the repository so that exactly "
        "one new worker adopts each (ckpt/claims.py; a Deployment's pods); 'none': only this worker's own",
    )
    claim_lease: Duration = Field(
        timedelta(minutes=5),
        description="how long a claim holds without renewal (renewed every quarter of it while the restore "
        "runs); a claimant that died is taken over after it, by the repository's clock",
    )

    @field_validator("claim_lease")
    @classmethod
    def _lease(cls, v: timedelta) -> timedelta:
        if not 10 <= v.total_seconds() <= 86400:
            raise ValueError("must be between 10s and 1d")
        return v


class RetentionConfig(_Section):
    keep_last: int = Field(3, ge=1)
    keep_within: Duration | None = None
    gc_interval: Duration | None = Field(timedelta(hours=6), description='"0" turns scheduled gc off')
    gc_grace: Duration = timedelta(hours=1)

    @field_validator("gc_interval")
    @classmethod
    def _off(cls, v: timedelta | None) -> timedelta | None:
        return v if v is not None and v.total_seconds() > 0 else None


class AgentConfig(BaseSettings):
    """Everything ``gpuckpt agent run`` needs; see the module doc."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", case_sensitive=False
    )

    worker_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    trust_domain: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="the workers whose checkpoints may share blocks by key and restore each other's: "
        "by default this worker alone (its worker_id); a tenant or a fleet that trusts its workers may "
        "share one (docs/agent.md, trust domains)",
    )
    pool: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="the pool of interchangeable workers this one belongs to (a Deployment's name): its "
        "checkpoints are labelled with it, and with restore.adopt = 'claim' a new worker adopts the pool's "
        "orphaned final checkpoints",
    )
    repository: str
    key: str | None = Field(None, description="key source: file:/path or env:NAME")
    engine: str = Field(
        "vllm",
        description="the worker's serving engine (one of agent/engines/registry.py's): how its adapter is reached "
        "and its requests resubmitted",
    )
    connector_socket: Path = Field(
        description="the control socket of the worker's gpuckpt adapter (vLLM's connector, SGLang's cache linker)"
    )
    staging_dir: Path | None = Field(
        None,
        description="the worker's staging directory (its connector's staging_dir): the page files the "
        "connector names are read only from there (default: any directory closed to other accounts)",
    )
    shared_group: str | None = Field(
        None,
        description="the group the worker's and the agent's accounts share when they are two accounts "
        "(connector socket, staging): files of that group are trusted, and restore staging is made for it",
    )
    worker_url: str | None = Field(None, description="the worker's OpenAI-compatible API, for canary and resubmission")
    api: ApiConfig
    metrics_address: str | None = Field(None, description="host:port for /metrics; off when unset")
    checkpoint: CheckpointConfig = CheckpointConfig()
    restore: RestoreConfig = RestoreConfig()
    retention: RetentionConfig = RetentionConfig()
    log_format: Literal["json", "text"] = "json"

    @field_validator("key")
    @classmethod
    def _key_source(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("file:", "env:")):
            raise ValueError("must be a key source, 'file:/path' or 'env:NAME' (the value is not shown)")
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in registry.ENGINES:
            raise ValueError(f"unknown engine {v!r}; one of {', '.join(registry.names())}")
        return v

    @field_validator("metrics_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            _host, sep, port = v.rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{v!r} is not host:port")
        return v

    @model_validator(mode="after")
    def _adoption(self) -> AgentConfig:
        if self.restore.adopt == "claim" and (self.pool is None or self.trust_domain is None):
            raise ValueError(
                "restore.adopt = 'claim' needs pool and a trust_domain the pool's workers share (e.g. "
                "trust_domain = pool): a checkpoint restores only within its trust domain"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment overrides the file (passed as init values).
        return env_settings, init_settings


def load(path: str | os.PathLike[str] | None, **overrides: Any) -> AgentConfig:
    """Read and validate the configuration; raise :class:`ConfigError` naming each bad field."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"agent configuration {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"agent configuration {p} is not valid TOML: {exc}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return AgentConfig(**data)
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where = ".".join(str(x) for x in e["loc"]) or "(top level)"
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {msg}")
        src = f" in {path}" if path is not None else ""
        raise ConfigError(f"invalid agent configuration{src}: " + "; ".join(problems)) from None
