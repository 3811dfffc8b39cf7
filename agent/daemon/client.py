"""The CLI's client of the agent's control API (:mod:`agent.daemon.api`): HTTP over the agent's
Unix socket, JSON bodies; an error status is :class:`AgentApiError` carrying the agent's answer."""

from __future__ import annotations

import os
from typing import Any

import httpx

from ckpt.errors import GpuckptError

__all__ = ["AgentApiError", "AgentClient"]


class AgentClient:
    """The CLI's side of the API."""

    def __init__(self, path: str | os.PathLike[str], timeout: float = 30.0) -> None:
        self.path = str(path)
        # retries: a connect refused because the accept backlog is full (EAGAIN, under a flood
        # of connections) is tried again at once and after 0.5 s before it is an error.
        self._http = httpx.Client(
            transport=httpx.HTTPTransport(uds=self.path, retries=2), base_url="http://agent", timeout=timeout
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise ConnectionError(f"no agent answering on {self.path}: {exc}") from None
        data = r.json()
        if r.status_code >= 400:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise AgentApiError(r.status_code, str(err.get("message", r.text)))
        return data


class AgentApiError(GpuckptError):
    """The agent answered an error status (the message carries its answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
