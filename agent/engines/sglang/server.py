"""``python -m agent.engines.sglang.server ARGS``: SGLang's own server — what ``python -m
sglang.launch_server ARGS`` runs, with the same arguments — with gpuckpt's middleware added to its
application before it serves (:mod:`.middleware`: the clients' retries attach to restored
continuations). ``gpuckpt launch`` runs it in place of SGLang's module; nothing of SGLang's code
is changed.

Everything happens under ``__main__``: SGLang starts its scheduler and detokenizer with
multiprocessing's *spawn*, whose children import this module again by name.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

#: the module ``python -m`` runs for gpuckpt's SGLang server
MODULE = "agent.engines.sglang.server"


def linker_extra(server_args: Any) -> dict[str, Any]:
    """The linker's extra config from SGLang's parsed arguments (the control socket, beside which
    the worker's token is written; ``retry_hold_s``; the continuations' bounds)."""
    raw = getattr(server_args, "unified_cache_external_linker_config", None)
    try:
        cfg = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    except ValueError:
        return {}
    extra = cfg.get("linker_extra_config") if isinstance(cfg, dict) else None
    return dict(extra) if isinstance(extra, dict) else {}


def main(argv: list[str]) -> None:
    # late: SGLang is there only in the server's environment
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints import http_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from agent.engines.sglang.middleware import install  # late: it imports SGLang's HTTP server too

    load_plugins()
    server_args = prepare_server_args(argv)
    install(
        http_server,
        linker_extra(server_args),
        incremental=bool(getattr(server_args, "incremental_streaming_output", False)),
    )
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
