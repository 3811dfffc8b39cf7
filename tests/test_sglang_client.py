"""The SGLang client's own logic, against a scripted transport (no SGLang needed).

The real server is exercised by tests/sglang; these pin the request body (token
ids in, the original rid, sampling fields), the two shapes of SGLang's
streamed ``output_ids`` and error messages.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agent.engines.base import Resubmission
from agent.engines.serving import ServeError
from agent.engines.sglang.serve import SglangClient, linker_args, serve_command


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def meta(n: int, **kw: object) -> dict:
    return {"completion_tokens": n, "prompt_tokens": 5, "cached_tokens": 3, **kw}


@pytest.mark.parametrize(
    "events",
    [
        # cumulative (the default): every event carries the outputs so far
        [{"output_ids": [7], "meta_info": meta(1)}, {"output_ids": [7, 8, 9], "meta_info": meta(3)}],
        # incremental (--incremental-streaming-output): only the new ones
        [{"output_ids": [7], "meta_info": meta(1)}, {"output_ids": [8, 9], "meta_info": meta(3)}],
    ],
)
def test_streamed_outputs_are_read_in_either_shape(events: list[dict]) -> None:
    seen: list[dict] = []

    def handle(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        events[-1]["meta_info"]["finish_reason"] = {"type": "length"}
        return httpx.Response(200, content=sse(*events), headers={"content-type": "text/event-stream"})

    with SglangClient("http://w", transport=httpx.MockTransport(handle)) as c:
        out = c.complete([1, 2, 3, 4, 5], {"temperature": 0.0, "max_new_tokens": 3, "bogus": 1}, rid="r1", stream=True)
    assert out.token_ids == [7, 8, 9]
    assert out.finish_reason == "length"
    assert out.cached_tokens == 3
    assert out.first_token_s is not None
    body = seen[0]
    assert body["input_ids"] == [1, 2, 3, 4, 5]
    assert body["rid"] == "r1"
    assert body["stream"] is True
    assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 3}  # unknown fields are not sent


def test_resubmissions_keep_their_rid_and_extra_key() -> None:
    bodies: dict[str, dict] = {}

    def handle(req: httpx.Request) -> httpx.Response:
        b = json.loads(req.content)
        bodies[b["rid"]] = b
        return httpx.Response(200, json={"output_ids": [4], "meta_info": meta(1, finish_reason={"type": "stop"})})

    r = Resubmission("conv-7", [1, 2, 3], 2, [3], {"max_new_tokens": 9, "extra_key": "tenant-a"}, cache_salt="s")
    with SglangClient("http://w", transport=httpx.MockTransport(handle)) as c:
        outs = c.submit([r])
    assert outs["conv-7"].token_ids == [4]
    b = bodies["conv-7"]
    assert b["input_ids"] == [1, 2, 3]
    assert b["extra_key"] == "tenant-a"
    assert b["cache_salt"] == "s"
    assert b["sampling_params"]["max_new_tokens"] == 9


def test_a_refusal_names_the_servers_message() -> None:
    def handle(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "input too long"}})

    with SglangClient("http://w", transport=httpx.MockTransport(handle)) as c:
        with pytest.raises(ServeError, match="HTTP 400: input too long"):
            c.complete([1], {"max_new_tokens": 1})
        with pytest.raises(ServeError, match="HTTP 400: input too long"):
            c.complete([1], {"max_new_tokens": 1}, stream=True)


def test_the_server_command_carries_the_linker_flags() -> None:
    argv = serve_command("/m", port=9, control_socket="/run/c.sock", extra_args=["--page-size", "32"])
    assert argv[argv.index("--model-path") + 1] == "/m"
    flags = linker_args("/run/c.sock")
    assert argv[-2 - len(flags) : -2] == flags
    assert argv[-2:] == ["--page-size", "32"]
    cfg = json.loads(flags[-1])
    assert cfg["linker"] == "GpuckptLinker"
    assert cfg["linker_extra_config"]["control_socket"] == "/run/c.sock"
