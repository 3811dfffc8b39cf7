"""Zstandard compression (lossless), optionally per segment.

With ``segments = n > 1`` the input is cut into ``n`` equal contiguous
segments (the last takes any remainder) and each is stored on its own: as a
zstd frame, or raw when a sample shows it does not compress. After a
``byteplane`` stage the segments are the byte planes, whose statistics differ
wildly — the exponent plane of bf16 compresses ~2.5×, the mantissa plane not
at all — so compressing them apart is both better (one entropy table per
plane instead of one for the mix: 1.42× against 1.25× on 64 KiB bf16 pages)
and faster (the random planes are copied, not compressed).

Stored form for ``segments > 1``::

    u8 n | n × (u8 mode (0 raw, 1 zstd) | u64 stored length | u64 raw length) | payloads

and for ``segments == 1`` a single zstd frame with its content size.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zstandard

from ckpt.codecs.base import Buffer, Codec, CodecContext
from ckpt.errors import ConfigError, IntegrityError

_SEG = struct.Struct("<BQQ")
#: bytes of a segment compressed to decide whether it compresses at all
SAMPLE = 8192
#: a sample must shrink below this fraction for the segment to be compressed
WORTH_IT = 0.97


#: Encoder tunings. Decoding never needs them (zstd frames describe
#: themselves); they are recorded so a stored spec says how it was written.
#: "planes" targets byte planes of KV pages: nearly i.i.d. bytes where almost
#: all the gain is entropy coding and match search is wasted work. A short
#: hash table and long minimum match skip the search: measured on bf16
#: exponent planes, ~4.7x faster than level 1 and a slightly better ratio
#: (1.443x against 1.422x overall).
TUNINGS = ("default", "planes")


@dataclass(frozen=True)
class Zstd(Codec):
    level: int = 1
    segments: int = 1
    tuning: str = "default"
    name: ClassVar[str] = "zstd"
    # zstandard (de)compressor objects are not thread-safe: one per thread.
    _local: threading.local = field(default_factory=threading.local, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not -7 <= self.level <= 22:
            raise ConfigError(f"zstd level must be in -7..22, not {self.level}")
        if not 1 <= self.segments <= 16:
            raise ConfigError(f"zstd segments must be in 1..16, not {self.segments}")
        if self.tuning not in TUNINGS:
            raise ConfigError(f"zstd tuning must be one of {TUNINGS}, not {self.tuning!r}")

    def configuration(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"level": self.level}
        if self.segments != 1:
            conf["segments"] = self.segments
        if self.tuning != "default":
            conf["tuning"] = self.tuning
        return conf

    def _c(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            if self.tuning == "planes":
                params = zstandard.ZstdCompressionParameters.from_level(
                    self.level,
                    strategy=zstandard.STRATEGY_FAST,
                    min_match=7,
                    search_log=1,
                    hash_log=6,
                    window_log=17,
                    write_content_size=True,
                )
                c = zstandard.ZstdCompressor(compression_params=params)
            else:
                c = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            self._local.c = c
        return c

    def _d(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, data: Buffer, ctx: CodecContext) -> Buffer:
        if self.segments == 1:
            return self._c().compress(data)
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        step = n // self.segments
        bounds = [(i * step, (i + 1) * step if i < self.segments - 1 else n) for i in range(self.segments)]
        heads = []
        payloads: list[Buffer] = []
        c = self._c()
        for a, b in bounds:
            seg = mv[a:b]
            mode = 0
            out: Buffer = seg
            if b - a > 64:
                sample = seg[: min(SAMPLE, b - a)]
                if len(c.compress(sample)) < WORTH_IT * sample.nbytes:
                    z = c.compress(seg)
                    if len(z) < b - a:
                        mode, out = 1, z
            heads.append(_SEG.pack(mode, len(out), b - a))
            payloads.append(out)
        return b"".join([bytes([self.segments]), *heads, *payloads])

    def decode(self, data: Buffer, ctx: CodecContext, size_hint: int) -> Buffer:
        mv = memoryview(data).cast("B")
        if self.segments == 1:
            return self._decode_frame(mv, size_hint, ctx)

        def bad(why: str) -> IntegrityError:
            return IntegrityError(f"zstd segments of blob {ctx.blob} in {ctx.obj}: {why}", obj=ctx.obj, blob=ctx.blob)

        if mv.nbytes < 1 or mv[0] != self.segments or mv.nbytes < 1 + self.segments * _SEG.size:
            raise bad("bad segment header")
        heads = [_SEG.unpack_from(mv, 1 + i * _SEG.size) for i in range(self.segments)]
        total = sum(h[2] for h in heads)
        if size_hint >= 0 and total != size_hint:
            raise bad(f"segments add up to {total} bytes, expected {size_hint}")
        if 1 + self.segments * _SEG.size + sum(h[1] for h in heads) != mv.nbytes:
            raise bad("segment lengths do not add up to the blob")
        out = bytearray(total)
        pos = 1 + self.segments * _SEG.size
        at = 0
        for mode, slen, rlen in heads:
            payload = mv[pos : pos + slen]
            if mode == 0:
                if slen != rlen:
                    raise bad("raw segment length mismatch")
                out[at : at + rlen] = payload
            elif mode == 1:
                out[at : at + rlen] = self._decode_frame(payload, rlen, ctx)
            else:
                raise bad(f"unknown segment mode {mode}")
            pos += slen
            at += rlen
        return out

    def _decode_frame(self, data: memoryview, size_hint: int, ctx: CodecContext) -> Buffer:
        try:
            params = zstandard.get_frame_parameters(data)
            if size_hint >= 0 and params.content_size != size_hint:
                # Refuse before allocating: a corrupt or hostile frame could
                # claim any size.
                raise IntegrityError(
                    f"zstd frame of blob {ctx.blob} in {ctx.obj} claims {params.content_size} "
                    f"bytes, expected {size_hint}",
                    obj=ctx.obj,
                    blob=ctx.blob,
                )
            return self._d().decompress(data)
        except zstandard.ZstdError as exc:
            raise IntegrityError(
                f"zstd could not decode blob {ctx.blob} in {ctx.obj}: {exc}", obj=ctx.obj, blob=ctx.blob
            ) from exc
