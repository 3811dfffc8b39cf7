"""A stand-in worker adapter for the agent's unit tests, on the engines' own worker side.

It is a :class:`agent.engines.service.WorkerService` — the same dispatch,
protocol checks, offer, durable keys and sweep as the vLLM scheduler half and
the SGLang linker — with a step loop of its own instead of an engine, and
captures that write real page files of made-up pages. The worker conformance
suite (``tests/worker_suite.py``) runs against it as against the real
halves, so it cannot drift from them. The real connector covers the agent's
paths in ``tests/vllm/test_agent_e2e.py``.

Knobs the tests turn: ``gate`` (a capture waits on it), ``capture_delay``,
``fail_capture`` (the capture's error), ``generation`` (the last page changes
with it), ``poison`` (a hostile worker: other bytes under the same keys),
``name_index`` (a hostile worker: the reply names another path),
``random_pages`` (incompressible and all new: a long save).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.engines import staging
from agent.engines.protocol import Keys, Next, Sweep
from agent.engines.service import Reply, Waiter, WorkerService
from agent.fs import Trust
from ckpt import WorkerFacts

PAGE_SHAPE = (2, 2, 16, 32)  # layers, K/V-ish, tokens, width: 8 KiB of float32
STEP_S = 0.002


class FakeConnector(WorkerService):
    def __init__(self, sock: Path, stage: Path, *, pages: int = 16, random_pages: bool = False) -> None:
        super().__init__(staging_dir=str(stage), trust=Trust.of())
        self.random_pages = random_pages
        self.sock = sock
        self.stage = stage
        self.pages = pages
        self.capture_delay = 0.0
        self.batch: dict[str, int] = {}  # more engine stats: the live requests and the sequence slots
        self.fail_capture: str | None = None
        self.captures = 0
        self.swept = 0
        self.generation = 0  # bump to change some pages (new KV since the last capture)
        self.poison = 0  # a hostile worker: pages under the same keys with other bytes (XORed with this)
        self.gate: threading.Event | None = None  # a capture waits on it when set
        # a hostile connector: the capture reply names this path instead of the page file it wrote
        self.name_index: Callable[[Path], str] | None = None
        self.step = 0
        self._stream: dict[str, Any] | None = None  # the capture not yet acknowledged: seq, index
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, name="fake-engine", daemon=True)
        self._loop.start()
        self.serve(sock)

    def close(self) -> None:
        self.close_server()
        self._stop.set()
        self._loop.join(5)

    def facts(self) -> dict[str, Any]:
        return WorkerFacts(
            engine="vllm",
            engine_version="0.32.0",
            attention_backend="FAKE",
            kv_layout="fake:[blocks,layers]",
            block_size=16,
            kv_dtype="float32",
            num_kv_heads=2,
            head_size=8,
            model_runner="v1",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            rank=0,
            model="/models/fake",
            model_revision="r1",
            model_digest="sha256:" + "ab" * 32,
            tokenizer_digest="sha256:" + "cd" * 32,
            prefix_hash_algo="sha256",
            prefix_hash_seed="0",
        ).model_dump(mode="json")

    # -- the engine's step loop: every boundary answers the waits and plans the captures

    def _run(self) -> None:
        while not self._stop.wait(STEP_S):
            with self.lock:
                self.step += 1
                self.retire_files()
                # no request is ever live here: a condition asking for some is never met
                waits = [w for w in self.wait_calls if self._met(w)]
                due = [w for w in self.capture_calls if self._met(w)]
                self.wait_calls = [w for w in self.wait_calls if w not in waits]
                self.capture_calls = [w for w in self.capture_calls if w not in due]
            self.answer(waits, {"ok": True, "step": self.step, "live": 0, "outputs": {}})
            for w in due:
                self.answer([w], self._capture(w))

    @staticmethod
    def _met(w: Waiter) -> bool:
        return not w.when or w.when.get("live", 0) <= 0

    def _capture(self, w: Waiter) -> Reply:
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.capture_delay)
        if self.fail_capture:
            return {"ok": False, "error": self.fail_capture}
        self.captures += 1
        seq = self.captures
        writer = staging.PageWriter(
            self.stage, f"capture-{os.getpid()}-{seq}", dtype="float32", page_shape=PAGE_SHAPE, layers=["l0", "l1"]
        )
        size = 4
        for d in PAGE_SHAPE:
            size *= d
        for i in range(self.pages):
            # Pages 0..pages-2 stay the same across captures; the last one changes with the generation.
            g = self.generation if i == self.pages - 1 else 0
            seed = (i * 7919 + g * 104729).to_bytes(8, "little")
            if self.random_pages:
                writer.write(os.urandom(32), os.urandom(size))
            else:
                data = (seed * (size // 8))[:size]
                if self.poison:
                    data = bytes(b ^ self.poison for b in data)
                writer.write(seed.ljust(32, b"k"), data)
        idx = writer.commit()
        with self.lock:
            self._stream = {"seq": seq, "index": str(writer.index_path)}
        ledger = {"schema": "gpuckpt-vllm-ledger", "version": 1, "data": {"step": 1, "block_size": 16, "requests": []}}
        return {
            "ok": True,
            "seq": seq,
            "chunk": 0,  # the whole capture in its consistent point's chunk
            "last": True,
            "index": self.name_index(writer.index_path) if self.name_index else str(writer.index_path),
            "ledger": None if w.prefix_only else ledger,
            "skipped": [],
            "step": seq,
            "pages": len(idx.keys),
            "prefix_pages": len(idx.keys),
            "tail_pages": 0,
            "requests": 0,
            "plan_s": 0.0,
            "wait_s": 0.0,
            "copy_s": 0.001,
            "bytes": idx.page_bytes * len(idx.keys),
        }

    # -- WorkerService hooks

    def description(self) -> dict[str, Any]:
        return self.describe_worker()  # not cached: tests change the facts between calls

    def describe_worker(self) -> dict[str, Any]:
        return {
            "facts": self.facts(),
            "layout": {"device": "cpu", "block_size": 16, "num_kv_heads": 2},
            "namespace": {"engine": "vllm", "model": "fake", "layout": "fake", "kv": "f32", "hash": "x"},
        }

    def stream_cancel(self, seq: int, why: str) -> bool:
        st = self._stream
        if st is None or (seq >= 0 and st["seq"] != seq):
            return False
        staging.unlink_pair(st["index"])
        self.last_stream = {"seq": st["seq"], "error": why, "chunks": 1, "lost_pages": 0}
        self._stream = None
        return True

    def on_next(self, msg: Next) -> Reply:
        """A capture is one chunk: the call after it is ``done``."""
        with self.lock:
            st = self._stream
            if st is not None and st["seq"] == msg.seq:
                self.last_stream = {"seq": msg.seq, "error": None, "chunks": 1, "lost_pages": 0}
                self._stream = None
            last = self.last_stream
            if last.get("seq") == msg.seq and last.get("error") is None:
                return {"ok": True, "done": True, **last}
            why = last.get("error") if last.get("seq") == msg.seq else "no such capture in flight"
        return {"ok": False, "error": f"capture {msg.seq}: {why}"}

    def on_keys(self, msg: Keys) -> Reply:
        """No prefix cache: no request has pages here."""
        return {"ok": True, "keys": [[] for _ in msg.requests]}

    def on_sweep(self, msg: Sweep) -> Reply:
        self.swept += 1
        return super().on_sweep(msg)

    def engine_stats(self) -> dict[str, Any]:
        return {"restored_tokens": {}, "step": self.step, "live": 0, **self.batch}
