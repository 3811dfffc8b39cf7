"""What a client of ``vllm serve`` gets, as it gets it: one call of the ``openai`` client (chat or
completions, streamed or not) read into its choices' text, token ids and finish reasons; the engine's own
count of generated tokens; clients' calls run in threads, and a checkpoint taken while they run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
from openai import OpenAI, omit

from agent.engines.retries import ATTACH_HEADER

__all__ = ["Calls", "call", "checkpoint_during", "generated", "logprobs", "same_logprobs"]


def call(url: str, rid: str, endpoint: str, body: dict[str, Any], key: str = "k1") -> dict[str, Any]:
    """One API call as a client makes it, with the ``openai`` client: chat or completions, streamed
    or not as ``body`` says; vLLM's own fields (``return_token_ids``, ``ignore_eos``,
    ``structured_outputs``, ``prompt_embeds``, …) go in ``extra_body``, as vLLM's docs tell its
    users. Returns the choices' text, tool calls' arguments and token ids, finish reasons, logprobs
    (``(token, logprob, {top token: logprob})`` per output token), and gpuckpt's attach header."""
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600)
    rest = dict(body)
    stream = bool(rest.pop("stream", False))
    kw: dict[str, Any] = {"model": "m", "extra_headers": {"X-Request-Id": rid}, "extra_body": rest}
    if endpoint == "chat":
        create = client.chat.completions.with_raw_response.create
        kw["messages"] = rest.pop("messages")
    else:
        create = client.completions.with_raw_response.create  # type: ignore[assignment]
        kw["prompt"] = rest.pop("prompt", omit)  # omitted: a prompt given as embeddings (extra_body)
    out: dict[str, Any] = {"choices": {}}

    def take(ch: Any, text: str | None, tool_calls: Any = None) -> None:
        c = out["choices"].setdefault(ch.index, {"text": "", "ids": [], "finish": None, "tools": "", "logprobs": []})
        c["logprobs"] += logprobs(ch.logprobs)
        c["text"] += text or ""
        c["tools"] += "".join((t.function.arguments or "") for t in tool_calls or () if t.function)
        c["ids"] += getattr(ch, "token_ids", None) or []  # vLLM's field, beside the API's
        c["finish"] = ch.finish_reason or c["finish"]

    with client:
        raw = create(stream=stream, **kw)
        out["attach"] = raw.headers.get(ATTACH_HEADER)
        got: Any = raw.parse()  # a stream of chunks, or the completion
        for event in got if stream else [got]:
            for ch in event.choices:
                if endpoint != "chat":
                    take(ch, ch.text)
                elif stream:
                    take(ch, ch.delta.content, ch.delta.tool_calls)
                else:
                    take(ch, ch.message.content, ch.message.tool_calls)
    return out


def logprobs(lp: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """A choice's (or a chunk's) logprobs, chat's or completions', as ``(token, logprob, top)``,
    ``top`` in the response's order."""
    if lp is None:
        return []
    if getattr(lp, "content", None) is not None:  # chat
        return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs or ()]) for c in lp.content]
    tops = lp.top_logprobs or [None] * len(lp.tokens or ())
    return [
        (t, v, list((top or {}).items()))
        for t, v, top in zip(lp.tokens or (), lp.token_logprobs or (), tops, strict=True)
    ]


def same_logprobs(got: list[Any], want: list[Any], tol: float = 1e-3) -> str | None:
    """Why two answers' logprobs differ (``None``: the same tokens, values within ``tol`` — a
    continuation computes the same numbers in another batch, within float rounding)."""
    if len(got) != len(want):
        return f"{len(got)} positions, not {len(want)}"
    for i, ((t1, v1, top1), (t2, v2, top2)) in enumerate(zip(got, want, strict=True)):
        if t1 != t2 or abs(v1 - v2) > tol:
            return f"position {i}: {(t1, v1)} != {(t2, v2)}"
        if [t for t, _ in top1] != [t for t, _ in top2] or any(
            abs(a - b) > tol for (_, a), (_, b) in zip(top1, top2, strict=True)
        ):
            return f"position {i}: top {top1} != {top2}"
    return None


def generated(url: str) -> float:
    """The engine's own count of generated tokens (``/metrics``)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")


class Calls:
    """Clients' calls, each in a thread of its own: :meth:`start` them, :meth:`join` for their
    results (by name; the first error a call met is raised)."""

    def __init__(self, calls: dict[str, Callable[[], Any]], timeout: float = 600) -> None:
        self.results: dict[str, Any] = {}
        self.errors: list[BaseException] = []
        self.timeout = timeout
        self.threads = [threading.Thread(target=self._run, args=(k, f), name=f"client-{k}") for k, f in calls.items()]

    def _run(self, k: str, f: Callable[[], Any]) -> None:
        try:
            self.results[k] = f()
        except BaseException as exc:
            self.errors.append(exc)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> dict[str, Any]:
        for t in self.threads:
            t.join(self.timeout)
        assert not any(t.is_alive() for t in self.threads), "a client call did not return"
        if self.errors:
            raise self.errors[0]
        return self.results


def checkpoint_during(
    worker: Any, calls: dict[str, Callable[[], Any]], repo: Any, *, live: int, min_outputs: int = 40, **opts: Any
) -> tuple[Any, dict[str, Any]]:
    """Checkpoint a worker while ``calls`` (clients' requests, ``live`` engine requests in all) run:
    they are held to start at one step boundary, the capture is pending before any is sent and is
    taken at the first boundary where every one has ``min_outputs`` outputs, as the engine's
    scheduler judges it (the API server can lag the engine by hundreds of tokens on busy cores).
    ``opts``: more checkpoint options (``canary``, ``timeout``). Returns the manifest and, once
    every call has returned, their results."""
    from agent import session

    running = Calls(calls)
    session.hold(worker.control_socket, live, timeout=300)
    when = {"live": live, "min_outputs": min_outputs}
    taken = session.checkpoint_around(
        worker.control_socket, running.start, repo, "w0", when=when, **{"timeout": 300, **opts}
    )
    return taken.manifest, running.join()
