"""Moving KV pages between the engine's paged KV tensors and host memory.

Written for CUDA and run the same way on CPU (where copies are synchronous
and buffers are not pinned), so the CPU tests exercise the code the GPU runs.

Layout: vLLM's KV tensor of one layer has the block id first
(``[num_blocks, *page_shape]``). A *page* in a page file is one block of
every layer, layer-major (:mod:`agent.engines.staging`).

**Capture** (:meth:`PageCopier.gather`): the engine must not be held up by
compression or I/O, and it must not overwrite a block before its copy is
taken. On CUDA the copies go on a side stream that first waits for the
compute stream (so the step that just ran is complete), into a pinned host
buffer laid out ``[layers, n, *page_shape]`` (each layer's copy of a run of
consecutive block ids is then one contiguous DMA); the compute stream then
waits for the copy to finish before its next kernels. The host thread does
not block: only the GPU pauses, for the D2H time of the captured bytes. The
host buffer is handed back with the event that marks the copy's end;
:meth:`Gathered.pages` (called on a background thread) waits for it and
yields each page's bytes.

**Restore** (:meth:`PageCopier.scatter`): pages are gathered into a pinned
buffer and copied to their blocks on the *current* stream with
``non_blocking=True``: the forward that reads them is queued after the
copies on the same stream, so no extra synchronization is needed; the
buffer is kept until its event completes before it is reused.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def element_count(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce ``ids`` (in order) into ``(position, first_id, length)`` runs of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b and out[-1][0] + out[-1][2] == pos:
            p, s, n = out[-1]
            out[-1] = (p, s, n + 1)
        else:
            out.append((pos, b, 1))
    return out


@dataclass
class Gathered:
    """Pages copied out of the KV tensors: ``host[layer, i]`` is block ``ids[i]`` of that layer."""

    host: torch.Tensor
    ids: list[int]
    event: Any = None  # torch.cuda.Event marking the end of the copy (CUDA only)
    recycle: Any = None  # gives the host buffer back to its copier's pool once the pages are read

    def release(self) -> None:
        """The pages are read (written out): the pinned buffer may take the next chunk."""
        if self.recycle is not None:
            self.recycle, recycle = None, self.recycle
            recycle()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def pages(self) -> Iterator[memoryview]:
        """Each page's bytes (all layers of one block), in ``ids`` order, after the copy completed."""
        self.wait()
        if not self.ids:
            return
        # [layers, n, ...] -> [n, layers, ...]: one host memcpy, off the engine's path.
        per_block = self.host.transpose(0, 1).contiguous()
        flat = per_block.view(len(self.ids), -1).view(torch.uint8)
        arr = flat.numpy()
        for i in range(len(self.ids)):
            yield memoryview(arr[i])


class PageCopier:
    """Copies pages out of and into one KV cache group's layer tensors (see module doc)."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("no KV layers")
        self.layers = list(layers)
        first = self.layers[0]
        self.page_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self.cuda = first.is_cuda
        self._side: Any = torch.cuda.Stream(device=self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        # Pinned host buffers for captures, reused: a capture streams a chunk per engine step, and
        # pinning memory per step (cudaHostAlloc) would cost more than the copy.
        self._pool: list[torch.Tensor] = []
        self._load_buf: torch.Tensor | None = None
        self._load_event: Any = None

    #: pinned buffers kept for reuse (a ring of chunks is a few at a time)
    POOL = 4

    def _host(self, n: int) -> tuple[torch.Tensor, Any]:
        """A ``[layers, n, *page]`` host buffer (a view of a pooled one on CUDA) and its recycle call.

        A buffer is not reused before its pages were read: the writer thread of an earlier chunk
        may still be draining it. Pinned on CUDA so the D2H copy is a real DMA.
        """
        if not self.cuda:
            return torch.empty((len(self.layers), n, *self.page_shape), dtype=self.dtype), None
        with self._lock:
            fit = [b for b in self._pool if b.shape[1] >= n]
            buf = min(fit, key=lambda b: int(b.shape[1])) if fit else None
            if buf is not None:
                self._pool.remove(buf)
        if buf is None:
            buf = torch.empty((len(self.layers), n, *self.page_shape), dtype=self.dtype, pin_memory=True)

        def recycle(b: torch.Tensor = buf) -> None:
            with self._lock:
                if len(self._pool) < self.POOL:
                    self._pool.append(b)

        return buf[:, :n], recycle

    def gather(self, ids: Sequence[int]) -> Gathered:
        """Start copying blocks ``ids`` to host memory; returns before the copy ends on CUDA."""
        ids = list(ids)
        host, recycle = self._host(len(ids))
        rs = runs(ids)
        if not self.cuda:
            for li, kv in enumerate(self.layers):
                for pos, start, n in rs:
                    host[li, pos : pos + n].copy_(kv[start : start + n])
            return Gathered(host, ids)
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(compute)
        self._side.wait_event(ready)
        with torch.cuda.stream(self._side):
            for li, kv in enumerate(self.layers):
                for pos, start, n in rs:
                    host[li, pos : pos + n].copy_(kv[start : start + n], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._side)
        # The blocks may be rewritten by the next step: its kernels wait for the copy.
        compute.wait_event(done)
        return Gathered(host, ids, done, recycle)

    def page(self, block_id: int) -> bytes:
        """One block of every layer, synchronously (a finished request's tail: one page)."""
        g = self.gather([block_id])
        try:
            return b"".join(bytes(p) for p in g.pages())
        finally:
            g.release()

    def scatter(
        self,
        ids: Sequence[int],
        pages: Sequence[memoryview | bytes],
        heads: tuple[int, int, int] | None = None,
        head_axis: int = 0,
    ) -> None:
        """Write ``pages[i]`` (all layers of one block) into block ``ids[i]``.

        With ``heads = (start, count, total)`` each page holds all ``total``
        KV heads (axis ``head_axis`` of a layer's page) and this copier's
        layers hold ``count`` of them from ``start`` (a tensor-parallel rank's
        shard): only those heads are copied. On CUDA the copies are queued on
        the current stream; the forward that follows on that stream sees them.
        """
        if not ids:
            return
        order = sorted(range(len(ids)), key=lambda i: ids[i])
        sids = [ids[i] for i in order]
        n = len(sids)
        with self._lock:
            if self._load_event is not None:
                self._load_event.synchronize()  # the last restore's copies have read the buffer
            buf = self._load_buf
            if buf is None or buf.shape[1] < n:
                # [layers, n, ...]: each layer's run of blocks is one contiguous H2D copy.
                buf = torch.empty((len(self.layers), n, *self.page_shape), dtype=self.dtype, pin_memory=self.cuda)
                self._load_buf = buf
            page_shape: tuple[int, ...] = (len(self.layers), *self.page_shape)
            if heads is not None:
                start, count, total = heads
                if self.page_shape[head_axis] != count:
                    raise ValueError(f"a shard of {count} heads for layers of {self.page_shape[head_axis]}")
                page_shape = (*page_shape[: 1 + head_axis], total, *page_shape[2 + head_axis :])
            page_bytes = element_count(page_shape) * buf.element_size()
            for row, i in enumerate(order):
                with warnings.catch_warnings():  # a read-only page-file mapping: only read here
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(pages[i], dtype=torch.uint8)
                if src.numel() != page_bytes:
                    raise ValueError(f"page of {src.numel()} bytes for a {page_bytes}-byte block")
                full = src.view(self.dtype).view(page_shape)
                if heads is not None and heads[1] != heads[2]:
                    full = full.narrow(1 + head_axis, heads[0], heads[1])
                buf[:, row].copy_(full)
            for li, kv in enumerate(self.layers):
                for pos, start, k in runs(sids):
                    kv[start : start + k].copy_(buf[li, pos : pos + k], non_blocking=self.cuda)
            if self.cuda:
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record(torch.cuda.current_stream(self.device))
                self._load_event = ev
