"""Codecs and the pipeline that chains them.

A pipeline is a list of codec specs ``[{"name", "configuration"}, ...]``
applied in order on write and in reverse on read. The empty pipeline stores
bytes raw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt.codecs.aead import AesGcm
from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.codecs.byteplane import BytePlane
from ckpt.codecs.zstd import Zstd
from ckpt.errors import ConfigError, FormatError

REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (BytePlane, Zstd, AesGcm)}


_CONF_TYPES: dict[str, type] = {"int": int, "str": str}


def codec_from_dict(spec: Any) -> Codec:
    """Rebuild a codec from ``{"name", "configuration"}``; unknown names and bad
    configurations (this is stored metadata) are refused with FormatError."""
    if not isinstance(spec, dict) or set(spec) != {"name", "configuration"}:
        raise FormatError(f"codec spec must be {{'name', 'configuration'}}, got {spec!r}")
    name = spec["name"]
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise FormatError(f"unknown codec {name!r} (known: {', '.join(sorted(REGISTRY))})")
    conf = spec["configuration"]
    if not isinstance(conf, dict):
        raise FormatError(f"codec {name!r}: configuration must be an object")
    # Only the codec's public init fields, each of its declared type: stored
    # metadata must not reach private state (Zstd._local) or pass a float width.
    declared = dataclasses.fields(cls)  # type: ignore[arg-type]  # every codec is a dataclass
    fields = {f.name: str(f.type) for f in declared if f.init and not f.name.startswith("_")}
    for k, v in conf.items():
        if k not in fields:
            raise FormatError(f"codec {name!r}: unknown configuration key {k!r}")
        want = _CONF_TYPES.get(fields[k])
        if want is not None and type(v) is not want:
            raise FormatError(f"codec {name!r}: configuration {k!r} must be {fields[k]}, not {v!r}")
    try:
        return cls(**conf)
    except (TypeError, ConfigError) as exc:
        raise FormatError(f"codec {name!r}: bad configuration {conf!r} ({exc})") from exc


@dataclass(frozen=True)
class Pipeline:
    codecs: tuple[Codec, ...]

    @classmethod
    def from_specs(cls, specs: Sequence[Any]) -> Pipeline:
        return cls(tuple(codec_from_dict(s) for s in specs))

    def specs(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.codecs]

    def encode(self, data: Buffer, ctx: CodecContext) -> Buffer:
        for c in self.codecs:
            data = c.encode(data, ctx)
        return data

    def decode(self, data: Buffer, ctx: CodecContext, raw_length: int) -> Buffer:
        # A stage's output is raw_length bytes when every stage before it (in
        # encode order) preserves length, as byteplane does: zstd after
        # byteplane must learn the size too, to refuse a frame claiming
        # another one before allocating it (FORMAT.md §5).
        hints = []
        exact = True
        for c in self.codecs:
            hints.append(raw_length if exact else -1)
            exact = exact and isinstance(c, BytePlane)
        for c, hint in zip(reversed(self.codecs), reversed(hints), strict=True):
            data = c.decode(data, ctx, hint)
        return data

    @property
    def encrypted(self) -> bool:
        return any(isinstance(c, AesGcm) for c in self.codecs)


__all__ = [
    "AesGcm",
    "BytePlane",
    "Codec",
    "CodecContext",
    "Pipeline",
    "REGISTRY",
    "Zstd",
    "codec_from_dict",
]
