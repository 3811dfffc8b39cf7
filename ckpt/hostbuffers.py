"""Host buffers: device pages → a reusable pool of host buffers, overlapped with the save.

On a CUDA host, KV pages live in device memory. The save pipeline reads host
memory, so each page is first copied into a *pinned* host buffer (pinned
memory is what lets the DMA engine copy asynchronously at full PCIe/NVLink
bandwidth) on a *side stream* (so the copy does not serialize with the
engine's compute stream). A bounded pool of buffers is reused: when the pool
is exhausted, the copy waits for the save pipeline to release a buffer, which
bounds host memory no matter how large the KV cache is.

These buffers are not the agent's *staging* (the page files a worker writes
for its agent); ``bench/gpu_check.py`` measures the device→host copy here.

Contract:

* :meth:`HostBuffers.copy` yields :class:`~ckpt.blocks.Block` objects whose
  ``data`` views a host buffer. The buffer returns to the pool when the
  consumer calls the block's ``release`` — the save pipeline does so once the
  bytes are copied into a pack (or the block was deduplicated).
* Copies are issued ``lookahead`` blocks ahead of the consumer; a block is
  yielded only after its copy's CUDA event has completed.
* The caller guarantees the source pages are not overwritten until ``copy``
  has yielded them (the engine adapter pauses or copies at a step boundary).

On a host without CUDA the same code runs with ordinary host buffers and
synchronous copies, which is what the CPU tests exercise.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ckpt.blocks import Block
from ckpt.errors import ConfigError


@dataclass
class CopyStats:
    blocks: int = 0
    bytes: int = 0
    waits_for_buffer: int = 0


class HostBuffers:
    """A pool of ``count`` host buffers of ``buffer_bytes`` each.

    ``pin`` defaults to "pin when CUDA is available". Thread-safe release.
    """

    def __init__(
        self, buffer_bytes: int, count: int = 16, *, pin: bool | None = None, device: torch.device | str | None = None
    ) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ConfigError("host buffers need a positive buffer size and count")
        self.cuda = torch.cuda.is_available()
        self.pinned = self.cuda if pin is None else pin
        self.buffer_bytes = buffer_bytes
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=self.pinned))
        self.count = count
        self.stats = CopyStats()
        self._lock = threading.Lock()
        self._stream: Any = None
        if self.cuda:
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def _take(self) -> torch.Tensor:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                self.stats.waits_for_buffer += 1
            return self._free.get()

    def _give(self, buf: torch.Tensor) -> None:
        self._free.put(buf)

    @property
    def free_buffers(self) -> int:
        return self._free.qsize()

    def copy(self, pages: Iterable[tuple[bytes, torch.Tensor]], *, lookahead: int = 4) -> Iterator[Block]:
        """Copy ``(key, tensor)`` pages to host buffers; yield Blocks in order."""
        inflight: deque[tuple[Any, Block]] = deque()
        lookahead = max(1, min(lookahead, self.count))
        for key, t in pages:
            nbytes = t.numel() * t.element_size()
            if nbytes > self.buffer_bytes:
                raise ConfigError(f"page of {nbytes} bytes exceeds the staging buffer size {self.buffer_bytes}")
            buf = self._take()
            dst = buf[:nbytes]
            src = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
            event = None
            if t.device.type == "cuda":
                assert self._stream is not None
                # The side stream must see the engine's writes to the page.
                self._stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(self._stream):
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(self._stream)
            else:
                dst.copy_(src)
            dtype = str(t.dtype).removeprefix("torch.")
            released = threading.Event()

            def release(buf: torch.Tensor = buf, released: threading.Event = released) -> None:
                if not released.is_set():
                    released.set()
                    self._give(buf)

            block = Block(key, dst.numpy().data, dtype, tuple(t.shape), release=release)
            inflight.append((event, block))
            with self._lock:
                self.stats.blocks += 1
                self.stats.bytes += nbytes
            while len(inflight) >= lookahead:
                yield self._ready(inflight.popleft())
        while inflight:
            yield self._ready(inflight.popleft())

    @staticmethod
    def _ready(item: tuple[Any, Block]) -> Block:
        event, block = item
        if event is not None:
            event.synchronize()
        return block
