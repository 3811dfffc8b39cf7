"""AES-256-GCM authenticated encryption, always the last stage of a pipeline.

The stored form is ``nonce (12) | ciphertext | tag (16)``; the additional
authenticated data is the blob id, binding the ciphertext to its place. The
configuration names only the key id, never key material.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.errors import KeyMismatch, KeyMissing
from ckpt.keys import Keyring


@dataclass(frozen=True)
class AesGcm(Codec):
    key_id: str
    name: ClassVar[str] = "aes-256-gcm"

    def configuration(self) -> dict[str, Any]:
        return {"key_id": self.key_id}

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
        return self._keyring(ctx).seal(data, ctx.aad)

    def decode(self, data: Buffer, ctx: CodecContext, size_hint: int) -> Buffer:
        return self._keyring(ctx).open(data, ctx.aad, obj=ctx.obj, blob=ctx.blob)
