"""An SGLang server as a gpuckpt worker: the command that starts it with the linker, a client for
its native ``/generate`` API (the canary and the resubmissions). The server as a process the tests
and benchmarks start is :class:`agent.testing.SglangProcess`.

No SGLang import: this runs on the agent's side. Requests go in and come out as token ids
(``input_ids``, ``output_ids``), so a server started with ``--skip-tokenizer-init`` works and no
text round trip can shift a token. A resubmitted request keeps its original ``rid``.
``meta_info.cached_tokens`` says how much of a resubmitted prompt came from the (restored) cache.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from agent.engines.retries import TOKEN_HEADER
from agent.engines.serving import (
    Completion,
    ServeError,
    ServingHttpClient,
    check_response,
)
from agent.engines.sglang.ledger import SAMPLING_FIELDS, carry_api
from agent.engines.types import Resubmission
from ckpt import Ledger

log = logging.getLogger("gpuckpt.serve")

#: gpuckpt's SGLang server (:mod:`.server`: SGLang's own, with gpuckpt's middleware)
SERVER_MODULE = "agent.engines.sglang.server"
#: the agent's call for the API facts of captured requests (:mod:`.middleware`)
REQUESTS_PATH = "/gpuckpt/v1/requests"

__all__ = [
    "CPU_ARGS",
    "Completion",
    "ServeError",
    "SglangClient",
    "linker_args",
    "linker_config",
    "serve_command",
]

#: The flags an SGLang 0.5.23 server needs to run on a CPU (its CPU path also needs
#: ``SGLANG_USE_CPU_ENGINE=1`` in the environment): the tests', the demo's and the benchmark's.
CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    # SGLang sizes its KV pool as the host memory free after loading the weights less
    # (1 - this) × the memory free before; with 0.05, another process allocating more than 5 % of
    # the host's free memory meanwhile (an engine starting beside it) failed the start ("Loaded
    # weights leave no GPU memory"). --max-total-tokens caps the pool anyway.
    "--mem-fraction-static",
    "0.3",
    "--max-total-tokens",
    "8192",
)
LINKER = "GpuckptLinker"
LINKER_MODULE = "agent.engines.sglang.linker"


def linker_config(
    control_socket: str, staging_dir: str | None = None, shared_group: str | None = None
) -> dict[str, Any]:
    """The ``--unified-cache-external-linker-config`` that loads gpuckpt's linker."""
    return {
        "linker": LINKER,
        "linker_module_path": LINKER_MODULE,
        "linker_extra_config": {
            "control_socket": control_socket,
            "staging_dir": staging_dir,
            "shared_group": shared_group,
        },
    }


def linker_args(control_socket: str, staging_dir: str | None = None, shared_group: str | None = None) -> list[str]:
    """The SGLang flags that load gpuckpt's linker (appended to a server's command)."""
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend",
        "dynamic",
        "--unified-cache-external-linker-config",
        json.dumps(linker_config(control_socket, staging_dir, shared_group)),
    ]


def serve_command(
    model: str,
    *,
    port: int,
    control_socket: str,
    host: str = "127.0.0.1",
    staging_dir: str | None = None,
    shared_group: str | None = None,
    python: str = sys.executable,
    extra_args: Sequence[str] = (),
    middleware: bool = False,
) -> list[str]:
    """argv of ``python -m sglang.launch_server`` with the linker on ``control_socket``;
    ``extra_args`` go last (device, backend, page size, memory…). ``middleware``: gpuckpt's
    server instead (:data:`SERVER_MODULE`, the same arguments): the clients' retries attach."""
    return [
        python,
        "-m",
        SERVER_MODULE if middleware else "sglang.launch_server",
        "--model-path",
        model,
        "--host",
        host,
        "--port",
        str(port),
        *linker_args(control_socket, staging_dir, shared_group),
        *extra_args,
    ]


class SglangClient(ServingHttpClient):
    """Client for an SGLang server's ``/generate`` (what every engine's client shares:
    :class:`agent.engines.serving.ServingHttpClient`)."""

    WHAT = "the server"
    STREAM = False
    TEE_WITHOUT_API = False

    def request_facts(self, rids: list[str]) -> dict[str, Any]:
        """The API facts gpuckpt's server recorded for these rids (``{rid: facts | None}``);
        :class:`ServeError` without its token."""
        token = self.token()
        if token is None:
            raise ServeError("no resubmission token: the worker is not gpuckpt's SGLang server")
        r = self._http.post(REQUESTS_PATH, json={"rids": rids}, headers={TOKEN_HEADER: token})
        check_response(r)
        got = r.json().get("api")
        return got if isinstance(got, dict) else {}

    def complete_ledger(self, ledger: Ledger) -> Ledger:
        """A captured ledger with what only the worker's server knows of its requests: their API
        facts (:func:`agent.engines.sglang.ledger.carry_api`), so the clients' retries attach."""
        return carry_api(ledger, self.request_facts)

    def complete(
        self,
        input_ids: Sequence[int],
        sampling: dict[str, Any],
        *,
        rid: str | None = None,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        priority: int | None = None,
        stream: bool = False,
        headers: dict[str, str] | None = None,
    ) -> Completion:
        """One ``/generate`` of ``input_ids``: the new tokens, finish reason and cached tokens.

        ``stream`` asks for server-sent events, to time the first token (``first_token_s``);
        each event's ``output_ids`` are the outputs so far, or only the new ones where the
        server streams incrementally (told apart by ``meta_info.completion_tokens``).
        """
        params = {k: sampling[k] for k in SAMPLING_FIELDS if sampling.get(k) is not None}
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": params}
        for name, value in (("rid", rid), ("extra_key", extra_key), ("cache_salt", cache_salt)):
            if value is not None:
                body[name] = value
        if priority:
            body["priority"] = priority
        t0 = time.monotonic()
        first: float | None = None
        if stream:
            body["stream"] = True
            ids: list[int] = []
            d: dict[str, Any] = {}
            with self._http.stream("POST", "/generate", json=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    check_response(r)
                for line in r.iter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    d = json.loads(line[5:])
                    new = [int(t) for t in d.get("output_ids") or []]
                    done = int((d.get("meta_info") or {}).get("completion_tokens") or 0)
                    ids = new if len(new) == done else ids + new
                    if ids and first is None:
                        first = time.monotonic() - t0
            d["output_ids"] = ids
        else:
            r = self._http.post("/generate", json=body, headers=headers)
            check_response(r)
            got = r.json()
            d = got[0] if isinstance(got, list) else got
        meta = d.get("meta_info") or {}
        fin = meta.get("finish_reason")
        out = Completion(
            str(rid or meta.get("id") or ""),
            token_ids=[int(t) for t in d.get("output_ids") or []],
            finish_reason=(fin.get("type") if isinstance(fin, dict) else fin),
            prompt_tokens=int(meta.get("prompt_tokens") or len(input_ids)),
            cached_tokens=None if meta.get("cached_tokens") is None else int(meta["cached_tokens"]),
            first_token_s=first,
        )
        out.total_s = time.monotonic() - t0
        return out

    def generate(self, prompt_ids: list[int], n: int) -> list[int]:
        """Greedy continuation of ``n`` tokens, EOS ignored: the canary's ``generate``."""
        return self.complete(prompt_ids, {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}).token_ids

    def resubmit_one(
        self, r: Resubmission, token: str | None, headers: dict[str, str] | None, stream: bool
    ) -> Completion:
        return self.complete(
            r.token_ids,
            r.sampling,
            rid=r.request_id,
            extra_key=r.sampling.get("extra_key"),
            cache_salt=r.cache_salt,
            priority=r.priority,
            stream=stream,
            headers=headers,
        )
