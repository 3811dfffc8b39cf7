"""Fake cloud metadata services on loopback, each speaking its cloud's documented protocol (headers,
tokens, bodies), for the preemption-notice tests. ``flip()`` schedules the preemption."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetadataServer:
    def __init__(self, cloud: str) -> None:
        self.cloud = cloud
        self.preempted = False
        self.rebalance = False
        self.maintenance = "NONE"
        self.acks: list[Any] = []
        self.requests: list[tuple[str, str]] = []
        self.broken: int | None = None  # answer every request with this status
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: str = "", ctype: str = "text/plain") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server.requests.append(("GET", self.path))
                if server.broken is not None:
                    return self._send(server.broken, "oops")
                getattr(server, f"_{server.cloud}_get")(self)

            def do_PUT(self) -> None:
                server.requests.append(("PUT", self.path))
                if server.cloud == "aws" and self.path == "/latest/api/token":
                    if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                        return self._send(400)
                    return self._send(200, "tok-123")
                self._send(404)

            def do_POST(self) -> None:
                server.requests.append(("POST", self.path))
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                if server.cloud == "azure" and self.headers.get("Metadata") == "true":
                    server.acks.append(json.loads(body))
                    return self._send(200)
                self._send(400)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _gce_get(self, h: Any) -> None:
        if h.headers.get("Metadata-Flavor") != "Google":
            return h._send(403, "missing Metadata-Flavor:Google header")
        if h.path == "/computeMetadata/v1/instance/preempted":
            return h._send(200, "TRUE" if self.preempted else "FALSE")
        if h.path == "/computeMetadata/v1/instance/maintenance-event":
            return h._send(200, self.maintenance)
        h._send(404)

    def _aws_get(self, h: Any) -> None:
        if h.headers.get("X-aws-ec2-metadata-token") != "tok-123":
            return h._send(401)
        if h.path == "/latest/meta-data/spot/instance-action":
            if not self.preempted:
                return h._send(404)
            return h._send(200, json.dumps({"action": "terminate", "time": "2026-12-02T18:00:00Z"}), "application/json")
        if h.path == "/latest/meta-data/events/recommendations/rebalance":
            if not self.rebalance:
                return h._send(404)
            return h._send(200, json.dumps({"noticeTime": "2026-12-02T17:58:00Z"}), "application/json")
        h._send(404)

    def _azure_get(self, h: Any) -> None:
        if h.headers.get("Metadata") != "true" or not h.path.startswith("/metadata/scheduledevents"):
            return h._send(400)
        events = []
        if self.preempted:
            events.append({"EventId": "E-1", "EventType": "Preempt", "NotBefore": "Wed, 02 Dec 2026 18:00:30 GMT"})
        events.append({"EventId": "E-0", "EventType": "Freeze", "NotBefore": ""})  # not a notice
        h._send(200, json.dumps({"DocumentIncarnation": 2, "Events": events}), "application/json")
