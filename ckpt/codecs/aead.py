"""AES-256-GCM authenticated encryption, always the last stage of a pipeline.

The stored form is a sealed message (FORMAT.md §10.1) whose additional
authenticated data is the blob id, binding the ciphertext to its place:
``seal`` 2 (what writers use) is ``0x02 | salt(32) | ciphertext | tag(16)``
under a key derived for that blob alone; ``seal`` 1 (absent from the
configuration, as written by format v1) is ``nonce(12) | ciphertext |
tag(16)`` under the repository AES key. The seal version lives in the codec
configuration, which travels with the blob into every index and manifest
naming it, so a blob copied verbatim into another pack (a gc repack) still
opens. The configuration names only the key id, never key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.errors import KeyMismatch, KeyMissing, UnsupportedVersion
from ckpt.keys import SEAL_V1, SEAL_VERSION, SEAL_VERSIONS, Keyring


@dataclass(frozen=True)
class AesGcm(Codec):
    key_id: str
    #: the sealed-message format; 1 when the stored configuration has none
    seal: int = SEAL_V1
    name: ClassVar[str] = "aes-256-gcm"

    def __post_init__(self) -> None:
        if self.seal not in SEAL_VERSIONS:
            raise UnsupportedVersion(f"codec {self.name!r}: seal", self.seal, SEAL_VERSIONS)

    @classmethod
    def for_writing(cls, key_id: str) -> AesGcm:
        """The codec a writer appends: the newest seal version."""
        return cls(key_id, seal=SEAL_VERSION)

    def configuration(self) -> dict[str, Any]:
        # Version 1 is written without the field, exactly as format v1 wrote it.
        return {"key_id": self.key_id} if self.seal == SEAL_V1 else {"key_id": self.key_id, "seal": self.seal}

    def _keyring(self, ctx: CodecContext) -> Keyring:
        if ctx.keyring is None:
            raise KeyMissing(f"blob {ctx.blob} in {ctx.obj} is encrypted and no key was given")
        if ctx.keyring.key_id != self.key_id:
            raise KeyMismatch(
                f"blob {ctx.blob} in {ctx.obj} was encrypted with key {self.key_id}, "
                f"the key given is {ctx.keyring.key_id}"
            )
        return ctx.keyring

    def encode(self, data: Buffer, ctx: CodecContext) -> Buffer:
        return self._keyring(ctx).seal(data, ctx.aad, purpose="blob", version=self.seal)

    def decode(self, data: Buffer, ctx: CodecContext, size_hint: int) -> Buffer:
        return self._keyring(ctx).open(data, ctx.aad, obj=ctx.obj, blob=ctx.blob, purpose="blob", version=self.seal)
