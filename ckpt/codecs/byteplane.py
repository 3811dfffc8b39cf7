"""Byte-plane split: regroup the i-th byte of every element together.

For bf16/fp16 the high byte (sign, exponent) is highly repetitive across a KV
page while the low byte (mantissa) is close to random; zstd compresses the
split layout far better than the interleaved one (~1.46x against ~1.27x on
bf16 attention K/V). fp32 has four planes. Lossless and exactly invertible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.errors import ConfigError


@dataclass(frozen=True)
class BytePlane(Codec):
    """Split ``width``-byte elements into ``width`` planes; a remainder is kept as is."""

    width: int
    name: ClassVar[str] = "byteplane"

    def __post_init__(self) -> None:
        if self.width not in (2, 4, 8):
            raise ConfigError(f"byteplane width must be 2, 4 or 8, not {self.width}")

    def configuration(self) -> dict[str, Any]:
        return {"width": self.width}

    def encode(self, data: Buffer, ctx: CodecContext) -> Buffer:
        a = np.frombuffer(data, dtype=np.uint8)
        n = len(a) - len(a) % self.width
        out = np.empty(len(a), dtype=np.uint8)
        planes = out[:n].reshape(self.width, -1)
        # One strided copy per plane: ~10x faster than a transposed copy, and
        # numpy releases the GIL for it, so blobs split in parallel threads.
        for i in range(self.width):
            planes[i] = a[i : n : self.width]
        out[n:] = a[n:]
        return out.data

    def decode(self, data: Buffer, ctx: CodecContext, size_hint: int) -> Buffer:
        a = np.frombuffer(data, dtype=np.uint8)
        n = len(a) - len(a) % self.width
        # Decode straight into a bytearray: it is the last stage on reads and
        # callers need writable bytes they own (no further copy).
        buf = bytearray(len(a))
        out = np.frombuffer(buf, dtype=np.uint8)
        planes = a[:n].reshape(self.width, -1)
        for i in range(self.width):
            out[i : n : self.width] = planes[i]
        out[n:] = a[n:]
        del out
        return buf
