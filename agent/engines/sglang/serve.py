"""An SGLang server as a gpuckpt worker: the command that starts it with the linker, a client for
its native ``/generate`` API (the canary and the resubmissions). The server as a process the tests
and benchmarks start is :class:`agent.testing.SglangProcess`.

No SGLang import: this runs on the agent's side. Requests go in and come out as token ids
(``input_ids``, ``output_ids``), so a server started with ``--skip-tokenizer-init`` works and no
text round trip can shift a token. A resubmitted request keeps its original ``rid``.
``meta_info.cached_tokens`` says how much of a resubmitted prompt came from the (restored) cache.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from agent import fs
from agent.engines.retries import RESUBMIT_HEADER, TOKEN_HEADER
from agent.engines.serving import (
    NO_KEEPALIVE,
    AgentCalls,
    Completion,
    ServeError,
    check_response,
    split_left,
    tell_done,
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


class SglangClient(AgentCalls):
    """Client for an SGLang server's ``/generate`` (thread-safe; :meth:`submit` runs concurrently so
    the resubmissions batch in the server as they did before the checkpoint)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
        token_file: str | os.PathLike[str] | None = None,
        trust: fs.Trust | None = None,
    ) -> None:
        """``token_file``: where gpuckpt's server writes the worker's resubmission token (beside the
        linker's control socket): with it, resubmissions are kept for the clients' retries."""
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, transport=transport, limits=NO_KEEPALIVE
        )
        self._token_file = token_file
        self._trust = trust
        self._token: str | None = None

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

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SglangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 300.0, alive: Callable[[], bool] | None = None) -> float:
        """Poll ``/health`` until it answers 200 (``alive()`` false ends the wait); seconds waited."""
        t0 = time.monotonic()
        while True:
            try:
                if self._http.get("/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            if alive is not None and not alive():
                raise ServeError("the server exited before its API became ready")
            if time.monotonic() - t0 > timeout:
                raise ServeError(f"the server's API was not ready after {timeout:.0f} s")
            time.sleep(0.25)

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

    def submit(
        self,
        requests: Iterable[Resubmission],
        *,
        max_concurrency: int = 64,
        stream: bool = False,
        on_done: Callable[[str], None] | None = None,
    ) -> dict[str, Completion]:
        """Resubmit a restored ledger under the original rids; each completion holds the new tokens
        only (a request's whole output is ``r.output_token_ids + result[r.request_id].token_ids``)."""
        # a request whose input the ledger does not carry is never resubmitted (it would run on
        # another input); its client's retry sends the input again
        reqs = list(requests)
        left, _ = split_left(reqs)
        token = self.token()
        if token is not None:
            # a continuation its client cannot collect would be computed twice: leave it to the retry
            for r in reqs:
                if r.request_id not in left and (why := (r.api or {}).get("unattachable")):
                    left[r.request_id] = Completion(r.request_id, left_to_client=why)
            self.expect(reqs, token, left={rid: c.left_to_client or "" for rid, c in left.items()})
        reqs = [r for r in reqs if r.request_id not in left]
        if not reqs:
            return left

        def extra(r: Resubmission) -> dict[str, str] | None:
            if token is None or not r.api:
                return None
            info = {"id": r.request_id, "api": r.api, "prompt_len": r.num_prompt_tokens}
            return {RESUBMIT_HEADER: json.dumps(info, separators=(",", ":")), TOKEN_HEADER: token}

        with ThreadPoolExecutor(max_workers=min(max_concurrency, len(reqs))) as pool:
            futs = {
                r.request_id: pool.submit(
                    self.complete,
                    r.token_ids,
                    r.sampling,
                    rid=r.request_id,
                    extra_key=r.sampling.get("extra_key"),
                    cache_salt=r.cache_salt,
                    priority=r.priority,
                    stream=stream,
                    headers=extra(r),
                )
                for r in reqs
            }
            if on_done is not None:
                for rid, f in futs.items():
                    f.add_done_callback(functools.partial(tell_done, on_done, rid))
            return {**left, **{rid: f.result() for rid, f in futs.items()}}
