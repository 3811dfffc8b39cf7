"""Host gpuckpt's SGLang linker on CPU KV pools, with its step boundary driven in a loop.

``python sglang_linker_host.py SOCKET STAGING`` (SGLang's interpreter): the
worker conformance suite's SGLang subject. The linker is built as SGLang's
linker factory builds it (server args, the pools' params), with no scheduler
behind it: no request is ever live, and every protocol message is served by
the real linker code.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import SimpleNamespace

import torch

from agent.engines.sglang.linker import GpuckptLinker

PAGE_SIZE, LAYERS, HEADS, HEAD_DIM, SLOTS = 16, 2, 2, 64, 1024


def main() -> None:
    sock, stage = sys.argv[1], sys.argv[2]
    if fake := os.environ.get("GPUCKPT_TEST_SGLANG_VERSION"):  # a test's SGLang of another version
        from agent.engines import versions

        versions.installed = lambda engine: fake
    pool = SimpleNamespace(
        k_buffer=[torch.zeros(SLOTS, HEADS, HEAD_DIM) for _ in range(LAYERS)],
        v_buffer=[torch.zeros(SLOTS, HEADS, HEAD_DIM) for _ in range(LAYERS)],
    )
    params = SimpleNamespace(
        page_size=PAGE_SIZE,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(8, 512, dtype=torch.int32)),
    )
    server_args = SimpleNamespace(
        tp_size=1,
        pp_size=1,
        model_path="",
        tokenizer_path=None,
        attention_backend="torch_native",
        device="cpu",
        revision=None,
        disable_overlap_schedule=True,
    )
    linker = GpuckptLinker(server_args, params, extra_config={"control_socket": sock, "staging_dir": stage})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.002):
        linker.num_completed_offloads()  # the scheduler loop's step boundary
    linker.close()


if __name__ == "__main__":
    main()
