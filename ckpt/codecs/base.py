"""The codec interface.

A codec turns bytes into bytes and back. Codecs are small frozen dataclasses
that serialize to ``{"name": ..., "configuration": {...}}``, so stored
metadata alone rebuilds the pipeline that wrote a blob (no code, no pickle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt.keys import Keyring

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class CodecContext:
    """Per-blob facts a codec may need: the keyring and the blob's identity.

    ``aad`` binds encrypted bytes to the blob id, so a ciphertext moved to
    another blob's place fails authentication. ``obj``/``blob`` name the
    stored object in errors.
    """

    keyring: Keyring | None
    aad: bytes
    obj: str
    blob: str


class Codec(ABC):
    """One stage of a pipeline. ``encode`` and ``decode`` are pure and thread-safe."""

    name: ClassVar[str]

    @abstractmethod
    def configuration(self) -> dict[str, Any]: ...

    @abstractmethod
    def encode(self, data: Buffer, ctx: CodecContext) -> Buffer: ...

    @abstractmethod
    def decode(self, data: Buffer, ctx: CodecContext, size_hint: int) -> Buffer:
        """Invert ``encode``. ``size_hint`` is the expected output size when the
        caller knows it (the raw length for the last decode stage), else -1."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "configuration": self.configuration()}
