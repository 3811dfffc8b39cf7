"""Codecs and the pipeline that chains them.

A pipeline is a list of codec specs ``[{"name", "configuration"}, ...]``
applied in order on write and in reverse on read. The empty pipeline stores
bytes raw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpt.codecs.aead import AesGcm
from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.codecs.byteplane import BytePlane
from ckpt.codecs.zstd import Zstd
from ckpt.errors import FormatError

REGISTRY: dict[str, type[Codec]] = {c.name: c for c in (BytePlane, Zstd, AesGcm)}


def codec_from_dict(spec: Any) -> Codec:
    """Rebuild a codec from ``{"name", "configuration"}``; unknown names are refused."""
    if not isinstance(spec, dict) or set(spec) != {"name", "configuration"}:
        raise FormatError(f"codec spec must be {{'name', 'configuration'}}, got {spec!r}")
    cls = REGISTRY.get(spec["name"])
    if cls is None:
        raise FormatError(f"unknown codec {spec['name']!r} (known: {', '.join(sorted(REGISTRY))})")
    conf = spec["configuration"]
    if not isinstance(conf, dict):
        raise FormatError(f"codec {spec['name']!r}: configuration must be an object")
    try:
        return cls(**conf)
    except TypeError as exc:
        raise FormatError(f"codec {spec['name']!r}: bad configuration {conf!r}") from exc


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
        n = len(self.codecs)
        for i, c in enumerate(reversed(self.codecs)):
            data = c.decode(data, ctx, raw_length if i == n - 1 else -1)
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
