"""A stand-in for the vLLM connector's control socket, for the agent's unit tests.

It speaks the same JSON-lines protocol (:mod:`agent.engines.control`)
and writes real page files, so the agent's whole checkpoint path (describe,
capture, save, retention) runs against it. The real connector covers the
same path in ``tests/vllm/test_agent_e2e.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.engines import control, staging
from ckpt import WorkerFacts

PAGE_SHAPE = (2, 2, 16, 32)  # layers, K/V-ish, tokens, width: 8 KiB of float32


class FakeConnector:
    def __init__(self, sock: Path, stage: Path, *, pages: int = 16, random_pages: bool = False) -> None:
        self.random_pages = random_pages  # incompressible, all new: a long save
        self.sock = sock
        self.stage = stage
        self.pages = pages
        self.capture_delay = 0.0
        self.fail_capture: str | None = None
        self.captures = 0
        self.swept = 0
        self.generation = 0  # bump to change some pages (new KV since the last capture)
        self.poison = 0  # a hostile worker: pages under the same keys with other bytes (XORed with this)
        self.gate: threading.Event | None = None  # a capture waits on it when set
        # a hostile connector: the capture reply names this path instead of the page file it wrote
        self.name_index: Callable[[Path], str] | None = None
        self._server = control.ControlServer(sock, self.handle)

    def close(self) -> None:
        self._server.close()

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

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        if cmd == "describe":
            return {
                "ok": True,
                "facts": self.facts(),
                "layout": {"device": "cpu", "block_size": 16, "num_kv_heads": 2},
                "namespace": {"engine": "vllm", "model": "fake", "layout": "fake", "kv": "f32", "hash": "x"},
            }
        if cmd == "capture":
            if self.gate is not None:
                self.gate.wait(30)
            time.sleep(self.capture_delay)
            if self.fail_capture:
                return {"ok": False, "error": self.fail_capture}
            self.captures += 1
            w = staging.PageWriter(
                self.stage,
                f"cap-{os.getpid()}-{self.captures}",
                dtype="float32",
                page_shape=PAGE_SHAPE,
                layers=["l0", "l1"],
            )
            size = 4
            for d in PAGE_SHAPE:
                size *= d
            for i in range(self.pages):
                # Pages 0..pages-2 stay the same across captures; the last one changes with the generation.
                g = self.generation if i == self.pages - 1 else 0
                seed = (i * 7919 + g * 104729).to_bytes(8, "little")
                if self.random_pages:
                    w.write(os.urandom(32), os.urandom(size))
                else:
                    data = (seed * (size // 8))[:size]
                    if self.poison:
                        data = bytes(b ^ self.poison for b in data)
                    w.write(seed.ljust(32, b"k"), data)
            idx = w.commit()
            ledger = {
                "schema": "gpuckpt-vllm-ledger",
                "version": 1,
                "data": {"step": 1, "block_size": 16, "requests": []},
            }
            return {
                "ok": True,
                "seq": self.captures,
                "chunk": 0,  # the whole capture in its consistent point's chunk
                "last": True,
                "index": self.name_index(w.index_path) if self.name_index else str(w.index_path),
                "ledger": ledger,
                "step": self.captures,
                "pages": len(idx.keys),
                "prefix_pages": len(idx.keys),
                "tail_pages": 0,
                "requests": 0,
                "plan_s": 0.0,
                "wait_s": 0.0,
                "copy_s": 0.001,
                "bytes": idx.page_bytes * len(idx.keys),
            }
        if cmd == "next":  # the agent read the last chunk
            return {"ok": True, "done": True, "chunks": 1, "lost_pages": 0}
        if cmd == "cancel":
            return {"ok": True, "cancelled": False}
        if cmd == "offer":
            return {"ok": True, "offered": 0}
        if cmd in ("withdraw", "ping"):
            return {"ok": True}
        if cmd == "durable":
            return {"ok": True, "durable": 0}
        if cmd == "sweep":  # as the real one: page files no capture in flight owns
            removed = []
            for p in sorted(self.stage.glob("cap-*")) if self.stage.is_dir() else []:
                p.unlink(missing_ok=True)
                removed.append(p.name)
            self.swept += 1
            return {"ok": True, "removed": removed}
        if cmd == "stats":
            return {"ok": True, "restored_tokens": {}, "step": self.captures, "live": 0}
        return {"ok": False, "error": f"unknown command {cmd!r}"}
