"""The ``vllm serve`` client's own logic, against a scripted transport.

The real server is exercised by ``tests/vllm/test_serve.py``; these pin the
id mapping, the request body, stream parsing and error messages.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from agent.engines.base import Resubmission
from agent.engines.vllm.serve import ServeClient, ServeError, header_request_id, kv_transfer_config, serve_command


@pytest.mark.parametrize(
    ("client_id", "header"),
    [
        ("cmpl-abc-0", "abc"),
        ("cmpl-conv-1-t2-0", "conv-1-t2"),  # dashes inside the id survive
        ("cmpl-abc-1", "cmpl-abc-1"),  # a second choice cannot be re-created under its id
        ("req0", "req0"),  # an offline LLM's id
    ],
)
def test_header_request_id_inverts_the_servers_id_scheme(client_id: str, header: str) -> None:
    assert header_request_id(client_id) == header


def test_serve_command_names_the_connector_and_keeps_caller_args_last() -> None:
    argv = serve_command("/m", "/run/w.sock", port=9000, staging_dir="/dev/shm/x", args=["--block-size", "16"])
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert cfg == kv_transfer_config("/run/w.sock", "/dev/shm/x")
    assert cfg["kv_connector"] == "GpuckptConnector"
    assert argv[-2:] == ["--block-size", "16"]
    assert "--enable-prefix-caching" in argv


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_submit_resends_token_ids_under_the_original_ids_and_collects_the_stream() -> None:
    seen: list[tuple[dict, str]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(req.content)
        seen.append((body, req.headers["X-Request-Id"]))
        return httpx.Response(
            200,
            content=sse(
                {"choices": [{"token_ids": [7], "finish_reason": None}]},
                {"choices": [{"token_ids": [8, 9], "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}},
            ),
        )

    r = Resubmission(
        request_id="cmpl-abc-0",
        token_ids=[1, 2, 3, 4, 5],
        num_prompt_tokens=3,
        output_token_ids=[4, 5],
        sampling={"temperature": 1.0, "seed": 9, "max_tokens": 3, "min_tokens": 0, "n": 1, "logits_processors": "x"},
        cache_salt="s",
    )
    with ServeClient("http://w", transport=httpx.MockTransport(handler)) as c:
        out = c.submit([r])
    body, header = seen[0]
    assert header == "abc"
    assert body["prompt"] == [1, 2, 3, 4, 5]
    assert body["model"] == "tiny"
    assert body["seed"] == 9
    assert body["max_tokens"] == 3
    assert body["cache_salt"] == "s"
    assert body["return_token_ids"] is True
    assert body["n"] == 1
    assert "logits_processors" not in body  # only fields the endpoint takes
    got = out["cmpl-abc-0"]
    assert got.token_ids == [7, 8, 9]
    assert got.finish_reason == "length"
    assert got.cached_tokens == 4
    assert got.prompt_tokens == 5
    assert got.first_token_s is not None


def test_an_http_error_names_the_status_and_the_servers_message() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"object": "error", "message": "max_tokens too large", "code": 400})

    with (
        ServeClient("http://w", model="tiny", transport=httpx.MockTransport(handler)) as c,
        pytest.raises(ServeError, match=r"HTTP 400: max_tokens too large"),
    ):
        c.generate([1, 2, 3], 4)


def test_an_error_event_mid_stream_is_raised() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse({"object": "error", "message": "engine dead"}))

    with (
        ServeClient("http://w", model="tiny", transport=httpx.MockTransport(handler)) as c,
        pytest.raises(ServeError, match="engine dead"),
    ):
        c.complete([1], {"max_tokens": 1})


def test_wait_ready_gives_up_when_the_worker_process_died() -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    with (
        ServeClient("http://w", transport=httpx.MockTransport(handler)) as c,
        pytest.raises(ServeError, match="exited before its API became ready"),
    ):
        c.wait_ready(timeout=30, alive=lambda: False)


def test_a_call_never_meets_a_connection_the_server_closed() -> None:
    """A server that closes a kept-alive connection as the next call arrives on it (uvicorn's idle
    timeout racing the call: "Server disconnected without sending a response", a resubmission
    lost under load). Here the server always does, on a connection's second request; every call
    of the worker clients gets an answer, each on a connection of its own."""
    import socket

    from agent.engines.sglang.serve import SglangClient

    served: list[int] = []
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def answer(conn: socket.socket) -> None:
        with conn:
            first = True
            while True:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if not data or not first:
                    return  # a second request on this connection: closed without an answer
                first = False
                body = json.dumps({"data": [{"id": "tiny"}]}).encode()
                served.append(1)
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                conn.sendall(head.encode() + body)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        for _ in range(3):
            with ServeClient(url) as c:
                assert c.model == "tiny"
        vllm = ServeClient(url)
        sg = SglangClient(url)
        try:
            for _ in range(3):
                vllm._model = None
                assert vllm.model == "tiny"
                assert sg._http.get("/v1/models").status_code == 200
        finally:
            vllm.close()
            sg.close()
        # the same calls over kept-alive connections fail as the agent's resubmission did
        with httpx.Client(base_url=url) as kept:
            assert kept.get("/v1/models").status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                kept.get("/v1/models")
    finally:
        srv.close()
    assert len(served) >= 9
