"""What a client of ``vllm serve`` gets, as it gets it: one OpenAI-API call (chat or completions,
streamed or not) read into its choices' text, token ids and finish reasons; the engine's own
count of generated tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx

from agent.engines.vllm.middleware import ATTACH_HEADER

__all__ = ["call", "generated"]


def call(url: str, rid: str, endpoint: str, body: dict[str, Any], key: str = "k1") -> dict[str, Any]:
    """One API call as a client makes it: the choices' text and token ids, finish reasons, headers."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"X-Request-Id": rid, "Authorization": f"Bearer {key}"}
    body = {"model": "m", **body}
    out: dict[str, Any] = {"choices": {}}

    def take(i: int, text: str | None, ids: list[int] | None, finish: str | None) -> None:
        c = out["choices"].setdefault(i, {"text": "", "ids": [], "finish": None})
        c["text"] += text or ""
        c["ids"] += ids or []
        c["finish"] = finish or c["finish"]

    with httpx.Client(timeout=600) as h:
        if body.get("stream"):
            with h.stream("POST", f"{url}{path}", json=body, headers=headers) as r:
                assert r.status_code == 200, r.read()
                out["attach"] = r.headers.get(ATTACH_HEADER)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    for ch in ev.get("choices") or ():
                        text = (ch.get("delta") or {}).get("content") if endpoint == "chat" else ch.get("text")
                        take(ch["index"], text, ch.get("token_ids"), ch.get("finish_reason"))
        else:
            r = h.post(f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 200, r.text
            out["attach"] = r.headers.get(ATTACH_HEADER)
            for ch in r.json()["choices"]:
                text = ch["message"]["content"] if endpoint == "chat" else ch["text"]
                take(ch["index"], text, ch.get("token_ids"), ch.get("finish_reason"))
    return out


def generated(url: str) -> float:
    """The engine's own count of generated tokens (``/metrics``)."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:generation_tokens_total in /metrics")
